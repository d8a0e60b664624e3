"""A BlockTrain node: joins (or seeds) a run, trains one block, averages it with same-block
peers, serves hops for it, routes generation for anyone, and leaves cleanly.

Threads: ``train`` (optimizer steps, periodic checkpoints), ``average`` (gossip rounds, never
blocking training), the p2p event loop (RPC server and client), the DHT refresher, and the HTTP
server. Child processes (hivemind's DHT, averager, p2pd) live in this node's process group.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import threading
import time

import torch

from ..blocks.config import ModelConfig
from ..blocks.chain import HopRequest
from ..blocks.objectives import get_objective
from ..p2p.aioloop import LoopThread
from ..p2p.discovery import Discovery
from ..p2p.errors import ConfigMismatchError, RunNotFoundError
from ..p2p.hops import HopLimits
from ..p2p.identity import NodeIdentity
from ..p2p.records import BlockAnnouncement, RunManifest
from ..p2p.rpc_client import HopClient
from ..p2p.rpc_server import BlockRPCServer
from .auth import RunAuth
from blocktrain.node.averaging.round import BlockAverager
from blocktrain.blocks.default_data import resolve_default
from blocktrain.blocks.device import pick_device
from .options import NodeOptions
from blocktrain.node.routing.router import BanList, Router
from .trainer import BlockTrainer

log = logging.getLogger(__name__)
SOFTWARE_VERSION = "blocktrain/0.1.0"
PROTOCOL_VERSION = 1


FAULTS = ("nan_hops", "inf_hops", "shape_hops")


def _inject_fault(fault: str, state, logits):
    """BT_FAULT_INJECT (tests only): a poisoned hop answer of the kind a buggy or hostile holder sends."""
    if fault == "nan_hops":
        return torch.full_like(state, float("nan")), logits
    if fault == "inf_hops":
        return torch.full_like(state, float("inf")), logits
    return state[:, :-1] if state.shape[1] > 1 else state[..., :-1], logits   # shape_hops


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) and x >= 0 else None


def choose_block(holders: dict[int, list[BlockAnnouncement]], n_blocks: int) -> int:
    """The block with the fewest live holders; ties broken by least total throughput, then index."""
    def key(b: int):
        live = [a for a in holders.get(b, []) if a.is_live]
        return (len(live), sum(a.throughput for a in live), b)
    return min(range(n_blocks), key=key)


class Node:
    def __init__(self, opts: NodeOptions):
        self.opts = opts
        self.stop_event = threading.Event()
        self.started_at = time.time()
        self.state = "starting"
        self.identity: NodeIdentity | None = None
        self.discovery: Discovery | None = None
        self.loop: LoopThread | None = None
        self.server: BlockRPCServer | None = None
        self.client: HopClient | None = None
        self.trainer: BlockTrainer | None = None
        self.averager: BlockAverager | None = None
        self.router: Router | None = None
        self.http = None
        self.manifest: RunManifest | None = None
        self.cfg: ModelConfig | None = None
        self.data_used = ""
        self.resumed = False
        self.downloaded: dict | None = None
        self.checkpoints_written = 0
        self.chain_ce_history: list[tuple[float, float]] = []
        self.bans = BanList()
        self._threads: list[threading.Thread] = []
        self._avg_wakeup = threading.Event()
        self.errors: list[str] = []
        self.upstream_stats = {"refreshes": 0, "failures": 0, "bytes": 0, "seconds": 0.0}
        self.auth = RunAuth()
        # test-only fault injection (RELIABILITY.md): BT_FAULT_INJECT=nan_hops|inf_hops|shape_hops
        # makes this node answer every hop with a poisoned state, to prove callers fail over
        self.fault = os.environ.get("BT_FAULT_INJECT", "").strip()
        if self.fault and self.fault not in FAULTS:
            raise ValueError(f"BT_FAULT_INJECT={self.fault!r}: use one of {', '.join(FAULTS)} (a test knob)")
        if self.fault:
            log.warning("FAULT INJECTION ACTIVE (BT_FAULT_INJECT=%s): this node serves bad hops", self.fault)

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> "Node":
        o = self.opts
        o.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.auth = RunAuth.build(o.allowed_peers, o.run_secret_file)   # bad secret file: fail before the DHT
        fresh_identity = not (o.checkpoint_dir / "identity.key").exists()
        self.identity = NodeIdentity.load_or_create(o.checkpoint_dir / "identity.key")
        # we hold the directory's identity lock, so no live node writes here: temporary files are
        # leftovers of a process killed mid-write (the checkpoint itself is replaced atomically)
        for tmp in o.checkpoint_dir.glob(".*.tmp-*"):
            tmp.unlink(missing_ok=True)
        # hivemind's "is this identity already used in the swarm?" probe waits ~30 s for a DHT
        # lookup to time out; a key generated a moment ago cannot be in use, so skip it then
        dht_extra = {"check_if_identity_free": False} if fresh_identity else {}
        host = f"/ip4/{o.host}/tcp/{o.port}"
        announce = [f"/ip4/{o.announce_host}/tcp/{o.port}"] if o.announce_host and o.port else None
        self.discovery = Discovery.start(identity=self.identity, initial_peers=o.initial_peers,
                                         host_maddrs=[host], announce_maddrs=announce,
                                         run_ids=[o.run_id] if o.run_id else [], ttl=o.ttl, **dht_extra)
        self.peer_id = self.discovery.peer_id
        self.auth = dataclasses.replace(self.auth, self_peer=self.peer_id)
        self._resolve_run()
        self._build_trainer()
        self._start_rpc()
        self.averager = BlockAverager(self.discovery.dht, self.trainer, self.run_id, peer_id=self.peer_id,
                                      compression=o.averaging_compression,
                                      authorize=self.auth.authorize if self.auth.restricted else None,
                                      prefix=self.auth.averaging_prefix(self.run_id, self.block_index))
        if self.trainer.upstream:
            self._refresh_upstream()   # before the late join: judging a download needs blocks < b
        self._late_join()
        self.state = "online"
        self.discovery.start_announcing(self.announcement)
        if o.http_port is not None:
            self._start_http()
        self._spawn("train", self._train_loop)
        self._spawn("average", self._average_loop)
        if self.trainer.upstream:
            self._spawn("upstream", self._upstream_loop)
        if o.eval_every:
            self._spawn("eval", self._eval_loop)
        return self

    def _resolve_run(self) -> None:
        o, d = self.opts, self.discovery
        if o.config is not None:   # seeding a new run
            if not o.run_id:
                raise ValueError("seeding needs a run id")
            existing = d.get_manifest(o.run_id)
            if existing is not None and existing.config_hash != o.config.config_hash:
                raise ConfigMismatchError(f"run {o.run_id!r} already exists with config {existing.config_hash}; "
                                          f"this node's config is {o.config.config_hash}")
            self.manifest = existing or RunManifest(
                run_id=o.run_id, model_config=o.config.to_dict(), config_hash=o.config.config_hash,
                data_spec=o.data or "auto", target_seed=o.config.target_seed, protocol_version=PROTOCOL_VERSION,
                seeder_public_key=d.public_key, created_at=time.time())
            d.publish_manifest(self.manifest)
            self.cfg = o.config
        else:
            run_id = d.resolve_run(o.run_id)
            d.follow_run(run_id)
            m = d.get_manifest(run_id)
            if m is None:
                raise RunNotFoundError(f"no run {run_id!r} found through {', '.join(o.initial_peers) or 'the DHT'}")
            self.manifest = m
            self.cfg = ModelConfig.from_dict(m.model_config_dict, source=f"manifest of run {run_id}")
            if self.cfg.config_hash != m.config_hash:
                raise ConfigMismatchError(f"run {run_id!r}: manifest config hashes to {self.cfg.config_hash}, "
                                          f"but announces {m.config_hash}")
        self.run_id = self.manifest.run_id

    def _build_trainer(self) -> None:
        o, cfg = self.opts, self.cfg
        holders = self.discovery.list_holders(self.run_id)
        b = o.block if o.block is not None else choose_block(holders, cfg.n_blocks)
        if not 0 <= b < cfg.n_blocks:
            raise ValueError(f"--block {b} is out of range: run {self.run_id!r} has {cfg.n_blocks} blocks")
        spec = o.data or self.manifest.data_spec
        split, self.data_used = resolve_default(spec, cfg.seq_len, o.checkpoint_dir)
        self.split = split
        worker = int(hashlib.sha256(self.peer_id.encode()).hexdigest()[:8], 16)
        device = pick_device(o.device)
        self.trainer = BlockTrainer(cfg, b, split.train, split.eval, device=device, seed=o.seed, worker_id=worker)
        self.resumed = self.trainer.resume(o.checkpoint_dir)
        self._checkpoint_ok = True   # from here on a final checkpoint cannot overwrite one we failed to load
        self.block_index = b

    def _start_rpc(self) -> None:
        cfg, b = self.cfg, self.block_index
        self.loop = LoopThread(name=f"bt-node-{self.peer_id[-6:]}")
        p2p = self.loop.run(self.discovery.dht.replicate_p2p(), timeout=30)
        limits = HopLimits(allowed_blocks=frozenset({b}), max_batch=64, max_seq=cfg.seq_len,
                           state_dim=get_objective(cfg).state_dim(), vocab_size=cfg.vocab_size)
        self.server = BlockRPCServer(p2p, self.run_id, limits, self._serve_hop, self._serve_state,
                                     inject_delay_s=self.opts.inject_delay_ms / 1000.0,
                                     authorize=self.auth.authorize if self.auth.restricted else None)
        self.loop.run(self.server.add_block(b), timeout=30)
        self.client = HopClient(p2p, self.run_id, loop=self.loop)
        self.router = Router(self.discovery, self.client, self.run_id, cfg.n_blocks,
                             get_objective(cfg).state_dim(), local_hops={b: self.trainer.hop},
                             self_peer=self.peer_id, bans=self.bans)

    def _refresh_upstream(self) -> bool:
        """forward-chained: fetch the current state of every block < ours from its most-trained live
        holder (our own RPC) into read-only snapshots. True if every snapshot is now present."""
        holders = self.discovery.list_holders(self.run_id)
        t0 = time.perf_counter()
        for j in range(len(self.trainer.upstream)):
            cands = sorted((a for a in holders.get(j, []) if a.is_live and a.peer_id != self.peer_id),
                           key=lambda a: -a.step)
            for a in cands:
                try:
                    meta, tensors = self.client.get_block_state_sync(a.peer_id, j, timeout=30)
                    self.trainer.set_upstream(j, tensors, {"peer": a.peer_id, "step": int(meta.get("step", 0))})
                except Exception as e:  # a holder that left or sent junk: try the next one
                    self.upstream_stats["failures"] += 1
                    self.errors.append(f"upstream block {j} from {a.peer_id}: {type(e).__name__}: {e}")
                    del self.errors[:-50]
                    continue
                self.upstream_stats["bytes"] += sum(v.numel() * v.element_size() for v in tensors.values())
                break
        self.upstream_stats["refreshes"] += 1
        self.upstream_stats["seconds"] += time.perf_counter() - t0
        return self.trainer.upstream_ready()

    def _upstream_loop(self) -> None:
        """Refresh the snapshots every ``upstream_refresh`` s (every 2 s while one is still missing)."""
        while not self.stop_event.wait(self.opts.upstream_refresh if self.trainer.upstream_ready() else 2.0):
            self._refresh_upstream()

    def _late_join(self) -> None:
        """Download the block's current state from a live holder before training (unless resumed)."""
        if self.resumed:
            return
        if not self.trainer.upstream_ready():
            self.errors.append("late join skipped: no snapshot of the upstream blocks yet to judge a download by")
            return
        others = [a for a in self.discovery.list_holders(self.run_id).get(self.block_index, [])
                  if a.peer_id != self.peer_id and a.is_live]
        if not others:
            return
        self.state = "joining"
        try:
            self.downloaded = self.averager.download_state(timeout=30)
        except ValueError as e:
            self.errors.append(f"state download refused: {e}")
        if self.downloaded is None:
            for a in others:   # fall back to our own RPC
                try:
                    meta, tensors = self.client.get_block_state_sync(a.peer_id, self.block_index, timeout=30)
                    if not all(bool(torch.isfinite(v).all()) for v in tensors.values()):
                        raise ValueError("it offered non-finite block state")
                    self.trainer.load_tensors(tensors, step=int(meta.get("step", 0)),
                                              samples_seen=int(meta.get("samples_seen", 0)))
                    self.downloaded = meta
                    break
                except Exception as e:  # try the next holder
                    self.errors.append(f"state download from {a.peer_id} failed: {e}")

    def _start_http(self) -> None:
        from blocktrain.node.http.server import HttpServer
        from .service import NodeBackend
        self.http = HttpServer(NodeBackend(self), self.opts.http_host, self.opts.http_port)
        self.http.start()

    # -- serving --------------------------------------------------------------------------------
    def _serve_hop(self, block: int, state, context, sigmas, want_logits):
        s = sigmas.reshape(-1, 2).float()
        n = state.shape[0]
        if s.shape[0] == 1:
            s = s.expand(n, 2)
        out = self.trainer.hop(HopRequest(state.float(), context.long(), s[:, 0].contiguous(),
                                          s[:, 1].contiguous(), want_logits))
        if self.fault:
            return _inject_fault(self.fault, out.state, out.logits)
        return out.state, out.logits

    def _serve_state(self, block: int):
        t = self.trainer
        with t.lock:
            meta = {"step": t.step, "samples_seen": t.samples_seen, "config_hash": self.cfg.config_hash}
        return meta, t.state_tensors()

    def announcement(self) -> BlockAnnouncement:
        t = self.trainer
        return BlockAnnouncement(
            peer_id=self.peer_id, block_index=self.block_index, state=self.state, step=t.step,
            samples_seen=t.samples_seen, throughput=float(t.throughput()), load=0.0, serving=True,
            loss=_finite_or_none(t.recent_loss()),
            last_round_time=self.averager.stats.last_accepted_time if self.averager else None,
            addresses=self.discovery.visible_maddrs()[:4], software_version=SOFTWARE_VERSION,
            config_hash=self.cfg.config_hash, run_id=self.run_id)

    # -- loops ----------------------------------------------------------------------------------
    def _spawn(self, name: str, fn) -> None:
        th = threading.Thread(target=self._guard(fn), name=f"bt-{name}", daemon=True)
        th.start()
        self._threads.append(th)

    def _guard(self, fn):
        def run():
            try:
                fn()
            except Exception as e:  # a crashed loop is reported, and the node stops cleanly
                log.exception("node loop failed")
                self.errors.append(f"{type(e).__name__}: {e}")
                self.stop_event.set()
        return run

    def _train_loop(self) -> None:
        o, t = self.opts, self.trainer
        while not self.stop_event.is_set():
            if not o.train or (o.max_steps is not None and t.step >= o.max_steps) or not t.upstream_ready():
                self.stop_event.wait(0.5)
                continue
            t.train_step()
            if t.step % o.average_every == 0:
                self._avg_wakeup.set()
            if t.step % o.checkpoint_every == 0:
                self.save_checkpoint()

    def _average_loop(self) -> None:
        """A round every ``average_every`` local steps; while not training (max steps reached,
        serve-only), a round every ``average_period`` seconds so idle replicas keep converging."""
        last = time.monotonic()
        while not self.stop_event.is_set():
            woke = self._avg_wakeup.wait(timeout=0.5)
            idle = not self.opts.train or (self.opts.max_steps is not None and
                                           self.trainer.step >= self.opts.max_steps)
            if not woke and not (idle and time.monotonic() - last >= self.opts.average_period):
                continue
            last = time.monotonic()
            self._avg_wakeup.clear()
            if self.stop_event.is_set():
                break
            self.averager.round()

    def _eval_loop(self) -> None:
        """Measure held-out chain CE through the network every ``eval_every`` seconds (for the
        dashboard and /v1/status); a failed measurement (a block without holder) is just skipped."""
        from .service import NodeBackend
        backend = NodeBackend(self)
        while not self.stop_event.wait(self.opts.eval_every):
            try:
                backend.held_out_ce()
            except Exception as e:
                log.info("held-out evaluation skipped: %s", e)

    def save_checkpoint(self) -> None:
        self.trainer.save(self.opts.checkpoint_dir)
        self.checkpoints_written += 1

    # -- stop -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Leave gracefully: tombstones, final checkpoint, children stopped. Safe to call twice."""
        if self.state == "stopped":
            return
        self.state = "leaving"
        self.stop_event.set()
        self._avg_wakeup.set()
        if self.averager is not None:
            self.averager.cancel_event.set()
        for th in self._threads:
            th.join(timeout=30)
        if self.trainer is not None and getattr(self, "_checkpoint_ok", False):
            try:
                self.save_checkpoint()
            except Exception as e:
                self.errors.append(f"final checkpoint failed: {e}")
        if self.http is not None:
            self.http.stop()
        if self.discovery is not None:
            try:
                self.discovery.stop_announcing(withdraw=True)
            except Exception as e:
                log.info("withdraw failed: %s", e)
        if self.server is not None and self.loop is not None:
            try:
                self.loop.run(self.server.close(), timeout=10)
            except Exception:
                pass
        if self.averager is not None:
            self.averager.shutdown()
        if self.discovery is not None:
            self.discovery.shutdown(withdraw=False)
        if self.loop is not None:
            self.loop.stop()
        if self.identity is not None:
            self.identity.close()
        self.state = "stopped"

    def wait(self) -> None:
        while not self.stop_event.wait(0.5):
            pass
