"""A BlockTrain node: joins (or seeds) a run, trains one block, averages it with same-block peers,
serves hops for it, routes generation for anyone, and leaves cleanly.

The node is a composition of small handles, started in order and stopped in reverse by one owner
(:class:`~blocktrain.node.loops.Teardown`): identity, discovery (hivemind's DHT and p2pd, child
processes), the trainer, the RPC server/client and router, the averager (another child
process), the HTTP server, the announcement refresher, then the loops (training, averaging,
held-out evaluation, upstream refresh). :meth:`snapshot` is the one status object the HTTP API,
web page and CLI read; :meth:`generate`, :meth:`score`, :meth:`evaluate` and :meth:`average_now`
are what they may ask of it.

:meth:`stop` leaves within :data:`STOP_DEADLINE` seconds whatever hangs: every teardown step has a
budget (the ``budget=`` of each push below; ``teardown.timings`` records what each took).

Over 400 lines because the start order, the block a node serves (which a rebalancing move,
``node/rebalance.py``, swaps) and the stop are one composition; splitting them would scatter it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import threading
import time
from typing import Callable

from blocktrain.blocks.windows import eval_windows, text_windows
from blocktrain.blocks.default_data import AUTO, resolve_default
from blocktrain.blocks.device import pick_device
from blocktrain.blocks.objectives import get_objective
from blocktrain.node import generation
from blocktrain.node.auth import RunAuth
from blocktrain.node.averaging.clock import AverageClock
from blocktrain.node.averaging.rounds import BlockAverager
from blocktrain.node.loops import DutyCycle, Loop, Teardown
from blocktrain.node.memory import release_startup_pages, tune_malloc
from blocktrain.node.options import NodeOptions
from blocktrain.node.reachability import Reachability
from blocktrain.node.pipeline.compose import start_pipeline
from blocktrain.node.runs import member_data, published_data_spec, resolve_run
from blocktrain.node.routing.bans import PeerBans
from blocktrain.node.routing.hops import serve_local
from blocktrain.node.routing.ranking import HolderRanking
from blocktrain.node.routing.router import Router
from blocktrain.node.routing.selection import choose_block
from blocktrain.node.state_fetch import ChainJudge, LossJudge, StateFetcher, StateJudge, state_bytes, transfer_timeout
from blocktrain.node.status import NodeStatus, build_status
from blocktrain.node.trainer import BlockTrainer
from blocktrain.node.upstream import UpstreamSnapshots
from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.discovery import Discovery
from blocktrain.p2p.errors import ConfigMismatchError, IdentityInUseError
from blocktrain.p2p.hops import HopLimits
from blocktrain.p2p.identity import NodeIdentity
from blocktrain.p2p.records import BlockAnnouncement, RunAddress, RunManifest
from blocktrain.p2p.rpc_client import HopClient, get_node_info
from blocktrain.p2p.rpc_server import BlockRPCServer, InfoService

log = logging.getLogger(__name__)
SOFTWARE_VERSION = "blocktrain/0.1.0"
PROTOCOL_VERSION = 1
STOP_DEADLINE = 7.0   # seconds for the graceful stop; steps still to go then get 0.2 s each (exit < 10 s)
LOOP_STOP_S = 3.0               # a loop's time to end when the node stops
MANIFEST_KEEP_PERIOD_S = 600.0  # at most this long between checks that the run's manifest is in the DHT
FINAL_CHECKPOINT_S = 4.0        # the final checkpoint's budget for a block whose step and save are quick;
FINAL_CHECKPOINT_MAX_S = 120.0  # a slower one gets twice its longest recent step and save, at most this
SAVE_BYTES_PER_S = 50e6         # a first save's time, estimated before one was timed (weights and AdamW state)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) and x >= 0 else None


def _asked(what: str, stopped_when_asked: bool) -> None:
    """A teardown step's check: a child that had to be killed is a problem worth reporting."""
    if not stopped_when_asked:
        raise RuntimeError(f"{what} did not stop when asked and was killed")


class Node:
    def __init__(self, opts: NodeOptions):
        self.opts = opts
        self.stop_event = threading.Event()      # set when the node should stop (signal, crashed loop)
        self.started_at = time.time()
        self.state = "starting"
        self.teardown = Teardown()
        self.duty = DutyCycle(opts.train_duty)   # the share of wall time this node's own training may use
        self.errors: list[str] = []
        self.failure: str | None = None           # why the node stopped on its own (a crashed loop)
        self.manifest_kept: dict = {}              # the last keep_manifest: {"last": stored|copied|enough|..., "at"}
        self.loops: list[Loop] = []
        self.resumed = False
        self.downloaded: dict | None = None
        self.late_join: dict | None = None        # how the late join's download went: via, seconds, MB
        self.checkpoints_written = 0
        self.checkpoints_failed = 0           # periodic writes the disk refused (full, read-only): training goes on
        self.checkpoint_error: str | None = None   # why the last write failed; None once one succeeds again
        self.last_checkpoint: dict | None = None   # {"block", "step", "at"} of the last checkpoint written
        self.last_save_s: float | None = None   # how long the last checkpoint took to write
        self.chain_ce_history: list[tuple[float, float]] = []
        self.route_bans = PeerBans()          # holders whose hops failed
        self.ranking = HolderRanking()        # what this node measured of other peers
        self.discovery = self.trainer = self.averager = self.http = self.upstream = None
        self.server = self.client = self.router = None
        self.pipeline = None                  # the pipeline engine, for chain-trained runs (node/pipeline)
        self.pipeline_server = None           # its rpc_train service (both replaced when the node moves)
        self.block_since = time.monotonic()   # when this node took its current block (rebalancing dwell)
        self.moving_to: int | None = None     # a rebalancing move in progress (node/rebalance.py)
        self.rebalancer = None
        self.old_averager = None              # a move's old averager, until the move retires it
        self._serving: dict[int, BlockTrainer] = {}   # block -> trainer answering its hops and state RPC
        self._handlers: dict = {}
        self._checkpoint_ok = False
        self._avg_wakeup = threading.Event()

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> "Node":
        o, td = self.opts, self.teardown
        tune_malloc()   # node/memory.py: return freed heap to the system
        try:
            o.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:   # a path under a file, a read-only or missing mount: say which directory
            raise OSError(f"cannot use checkpoint directory {o.checkpoint_dir}: {e.strerror or e}") from None
        self.auth = RunAuth.build(o.allowed_peers, o.run_secret_file)   # bad secret file: fail before the DHT
        fresh_identity = not (o.checkpoint_dir / "identity.key").exists()
        try:
            identity = NodeIdentity.load_or_create(o.checkpoint_dir / "identity.key")
        except IdentityInUseError as e:   # most often a second node started in the same folder as the first
            raise IdentityInUseError(f"checkpoint directory {o.checkpoint_dir} is in use by another node (pid "
                                     f"{e.holder}): stop that node, or give this one its own folder with "
                                     f"--checkpoint-dir", e.holder) from None
        td.push("identity", identity.close, budget=1.0)
        # we hold the directory's identity lock, so no live node writes here: temporary files are
        # leftovers of a process killed mid-write (the checkpoint itself is replaced atomically)
        for tmp in o.checkpoint_dir.glob(".*.tmp-*"):
            tmp.unlink(missing_ok=True)
        # hivemind's "is this identity already used in the swarm?" probe waits ~30 s for a DHT
        # lookup to time out; a key generated a moment ago cannot be in use, so skip it then
        dht_extra = {"check_if_identity_free": False} if fresh_identity else {}
        announce = [f"/ip4/{o.announce_host}/tcp/{o.port}"] if o.announce_host and o.port else None
        self.discovery = Discovery.start(identity=identity, initial_peers=o.initial_peers,
                                         host_maddrs=[f"/ip4/{o.host}/tcp/{o.port}"], announce_maddrs=announce,
                                         run_ids=[o.run_id] if o.run_id else [], ttl=o.ttl,
                                         reachability="auto", **dht_extra)
        td.push("discovery", lambda: _asked("the DHT process", self.discovery.shutdown(withdraw=False, timeout=1.0)),
                budget=3.0)
        # nobody can dial us? then serve through a relay, or train without serving (node/reachability.py)
        self.reach = Reachability(self.discovery, lambda: self.discovery.list_holders(self.run_id))
        self.peer_id = self.discovery.peer_id
        self.auth = dataclasses.replace(self.auth, self_peer=self.peer_id)
        self.loop = LoopThread(name=f"bt-node-{self.peer_id[-6:]}")
        td.push("rpc loop", lambda: self.loop.stop(timeout=1.0), budget=1.5)
        self.p2p = self.loop.run(self.discovery.dht.replicate_p2p(), timeout=30)
        self._resolve_run()
        self._build_trainer()
        if o.config is not None:   # a seeder publishes its run once its own block is built: a bad --block,
            self.discovery.publish_manifest(self.manifest)   # --device or checkpoint leaves no run behind
        self._start_rpc()
        if not self.trainer.objective.block_local:   # pipeline / forward-streamed: train along the chain
            start_pipeline(self)
        self.averager = self.new_averager(self.trainer)
        td.push("averager", self._stop_averagers, budget=3.0)
        if self.upstream is not None and self.block_index > 0:
            self.refresh_upstream()   # before the late join: judging a download needs blocks < b
        self._join_announced()
        if o.http_port is not None:
            from blocktrain.node.http.server import HttpServer
            self.http = HttpServer(self, o.http_host, o.http_port, operator_token=o.operator_token)
            self.http.start()
            td.push("http", self.http.stop, budget=2.0)
        td.push("announcements", lambda: self.discovery.stop_announcing(withdraw=True, timeout=2.5), budget=3.0)
        td.push("final checkpoint", self._final_checkpoint, budget=self.final_checkpoint_budget)
        self._start_loop("train", self._train if self.pipeline is None else self._run_pipeline,
                         budget=self.train_loop_budget)
        self._start_loop("average", self._average)
        if self.upstream is not None and self.block_index > 0:
            self._start_loop("upstream", lambda stop: self.upstream.run(stop, self.refresh_upstream))
        if o.eval_every:
            self._start_loop("eval", self._eval)
        self._start_loop("manifest", self._keep_manifest)
        if self.reach.private:
            self._start_loop("reachability", self.reach.run)
        # forward-chained nodes (snapshots of blocks < b, rebuilt for a new block) stay put
        if o.rebalance and not self.trainer.objective.needs_upstream:
            from blocktrain.node.rebalance import Rebalancer
            self.rebalancer = Rebalancer(self, dwell_s=o.rebalance_dwell, period_s=o.ttl / 3)
            self._start_loop("rebalance", self.rebalancer.run)
        release_startup_pages()   # node/memory.py: library code touched only while starting
        return self

    def _run_pipeline(self, stop: threading.Event) -> None:
        """The train loop of a chain-trained node: the current engine's ``run``; after a rebalancing move
        retires it, the new block's engine (node/rebalance.py)."""
        while not stop.is_set():
            engine = self.pipeline
            engine.run(stop)
            while engine is self.pipeline and not stop.is_set():   # it returned without a move (its event loop
                                                                    # is gone: the node is stopping): no spin
                stop.wait(0.1)

    def _keep_manifest(self, stop: threading.Event) -> None:
        """Keep the run's manifest in the DHT (``Discovery.keep_manifest``): the seeder refreshes its
        record, other members keep copies signed by the seeder, so the run stays joinable for as long
        as any member runs, not only for the manifest's lifetime after the seeder's last store."""
        period = min(self.manifest.ttl_s / 4, MANIFEST_KEEP_PERIOD_S)
        while not stop.is_set():
            try:
                done = self.discovery.keep_manifest(self.manifest)
                if done != self.manifest_kept.get("last"):
                    log.info("run manifest: %s", done)
                self.manifest_kept = {"last": done, "at": time.time()}
            except Exception as e:   # the DHT unreachable for now: the next period tries again
                log.warning("keeping the run's manifest in the DHT failed: %s", e)
            stop.wait(period)

    def _stop_averagers(self) -> None:
        old, self.old_averager = self.old_averager, None   # a move's old one, if a stop came mid-move
        if old is not None:
            old.shutdown()
        _asked("the averager process", self.averager.shutdown())

    def _start_loop(self, name: str, body, budget: float | Callable[[], float] = LOOP_STOP_S) -> None:
        loop = Loop(name, body, on_crash=self._crashed).start()
        self.loops.append(loop)
        seconds = budget if callable(budget) else (lambda: budget)
        self.teardown.push(f"{name} loop", lambda: loop.stop(timeout=seconds()), budget=seconds)

    def _crashed(self, name: str, e: BaseException) -> None:
        self._error(f"{type(e).__name__}: {e}")
        self.failure = self.failure or f"{name} loop: {type(e).__name__}: {e}"
        self.stop_event.set()

    def _error(self, msg: str) -> None:
        self.errors.append(msg)
        del self.errors[:-50]

    def _resolve_run(self) -> None:
        o, d = self.opts, self.discovery
        if o.config is None:   # joining: whose manifest to believe is node/runs.py's rule
            ask = lambda peer: self.loop.run(get_node_info(self.p2p, peer, timeout=10), timeout=15)  # noqa: E731
            self.manifest, self.cfg = resolve_run(d, RunAddress(o.run_id, o.seeder), o.initial_peers, ask)
            self.run_id = self.manifest.run_id
            return
        if not o.run_id:   # seeding a new run
            raise ValueError("seeding needs a run id")
        others = [m for m in d.claimants(o.run_id) if m.seeder != self.peer_id]
        if others:
            raise ConfigMismatchError(f"run id {o.run_id!r} is already claimed by seeder(s) "
                                      f"{', '.join(m.seeder for m in others)}; choose another run id")
        existing = d.get_manifest(o.run_id, seeder=self.peer_id)
        if existing is not None and existing.config_hash != o.config.config_hash:
            raise ConfigMismatchError(f"run {o.run_id!r} already exists with config {existing.config_hash}; "
                                      f"this node's config is {o.config.config_hash}")
        self.cfg, self.run_id = o.config, o.run_id
        self.split, self.data_used = resolve_default(o.data or AUTO, self.cfg.seq_len, o.checkpoint_dir,
                                                     file_backed=True)
        manifest = existing or RunManifest(
            run_id=o.run_id, model_config=o.config.to_dict(), config_hash=o.config.config_hash,
            data_spec=published_data_spec(o.data or AUTO, self.split), target_seed=o.config.target_seed,
            protocol_version=PROTOCOL_VERSION, seeder_public_key=d.public_key, created_at=time.time(),
            ttl_s=o.manifest_ttl)
        if manifest.ttl_s != o.manifest_ttl or not manifest.signature_ok():   # signed: members keep copies of it
            manifest = manifest.model_copy(update={"ttl_s": o.manifest_ttl}).signed(d.record_key)
        self.manifest = manifest
        d.trust(self.manifest)   # read the run as its seeder; published by start() once the block is built

    @property
    def run_address(self) -> str:
        """What members paste to join this run and believe only its seeder's manifest."""
        return f"{self.run_id}@{self.manifest.seeder}"

    def _build_trainer(self) -> None:
        o, cfg = self.opts, self.cfg
        b = o.block if o.block is not None else choose_block(self.discovery.list_holders(self.run_id), cfg.n_blocks)
        if not 0 <= b < cfg.n_blocks:
            raise ValueError(f"--block {b} is out of range: run {self.run_id!r} has {cfg.n_blocks} blocks")
        self.block_index = b
        if o.config is None:   # a member: its own --data, else the run's named dataset (never a path)
            self.split, self.data_used = member_data(self.manifest.data_spec, o.data, cfg.seq_len, o.checkpoint_dir)
        objective = get_objective(cfg)
        if objective.needs_upstream:   # block 0 keeps none, but reports that in its status
            self.upstream = UpstreamSnapshots(objective, b, pick_device(o.device), refresh_s=o.upstream_refresh)
        self.trainer = self.new_trainer(b)
        self.resumed = self.trainer.resume(o.checkpoint_dir)
        self._checkpoint_ok = True   # from here on a final checkpoint cannot overwrite one we failed to load

    def new_trainer(self, b: int) -> BlockTrainer:
        """A fresh trainer of block ``b`` on this node's data, device and seed (at start, or for a move)."""
        o = self.opts
        return BlockTrainer(self.cfg, b, self.split.train, self.split.eval, device=pick_device(o.device),
                            seed=o.seed, worker_id=self.data_stream, upstream=self.upstream,
                            lr_decay_s=o.lr_decay_seconds)

    @property
    def data_stream(self) -> int:
        """Which stream of training windows this node draws (with ``--seed``): ``--data-stream``, else one of
        its own from its peer id (members of a run draw different windows; a benchmark passes each worker's
        index, so a rerun draws the same windows). A resumed checkpoint continues the stream it saved."""
        if self.opts.data_stream is not None:
            return self.opts.data_stream
        return int(hashlib.sha256(self.peer_id.encode()).hexdigest()[:8], 16)

    def new_averager(self, trainer: BlockTrainer) -> BlockAverager:
        """The averager of ``trainer``'s block (rounds only: a block's state is downloaded over the block
        RPC from announced holders and judged, :meth:`_late_join`)."""
        o, b = self.opts, trainer.block_index
        return BlockAverager(self.discovery.dht, trainer, self.run_id, peer_id=self.peer_id,
                             compression=o.averaging_compression,
                             authorize=self.auth.authorize if self.auth.restricted else None,
                             prefix=self.auth.averaging_prefix(self.run_id, b))

    def _hop(self, req):
        """The RPC server's hop handler: the request's block, if this node serves it now."""
        handler = self._handlers.get(req.block_index)
        if handler is None:
            raise ValueError(f"block {req.block_index} is not served here any more")
        return handler(req)

    def serve_block(self, trainer: BlockTrainer) -> None:
        """Answer hops and state requests for ``trainer``'s block (at start, and a move's new block)."""
        b = trainer.block_index
        self._serving[b] = trainer
        self._handlers[b] = serve_local(trainer.hop)
        self.server.limits = dataclasses.replace(self.server.limits, allowed_blocks=frozenset({b}))
        self.loop.run(self.server.add_block(b), timeout=30)

    def unserve_block(self, b: int) -> None:
        self.loop.run(self.server.remove_block(b), timeout=30)
        self._handlers.pop(b, None)
        self._serving.pop(b, None)

    def _start_rpc(self) -> None:
        cfg, b, o, p2p = self.cfg, self.block_index, self.opts, self.p2p
        objective = self.trainer.objective
        limits = HopLimits(allowed_blocks=frozenset({b}), max_batch=64, max_seq=cfg.seq_len,
                           state_dim=objective.state_dim(), vocab_size=cfg.vocab_size)
        self.server = BlockRPCServer(p2p, self.run_id, limits, self._hop, lambda blk: self._serving[blk].served_state(),
                                     inject_delay_s=o.inject_delay_ms / 1000.0,
                                     authorize=self.auth.authorize if self.auth.restricted else None)
        self.serve_block(self.trainer)
        self.teardown.push("rpc server", lambda: self.loop.run(self.server.close(), timeout=1.0), budget=1.5)
        self.loop.run(InfoService.serve(p2p, self._info), timeout=30)
        self.client = HopClient(p2p, self.run_id, loop=self.loop)
        self.router = Router(self.discovery, self.client, self.run_id, cfg.n_blocks,
                             local_hops={b: self.trainer.hop}, self_peer=self.peer_id, bans=self.route_bans,
                             ranking=self.ranking)
        self.fetcher = StateFetcher(self.client, objective, ranking=self.ranking, self_peer=self.peer_id,
                                    config_hash=cfg.config_hash)

    def _info(self) -> dict:
        """What this node tells a member that asks which run it serves."""
        return {"runs": [{"run_id": self.run_id, "seeder": self.manifest.seeder, "config_hash": self.cfg.config_hash}]}

    def refresh_upstream(self) -> bool:
        return self.upstream.refresh(self.fetcher, self.discovery.list_holders(self.run_id), self.errors)

    def _join_announced(self) -> None:
        """Announce this node's block as ``joining`` while it downloads the block's state, then as
        ``online``. Other joiners' ``choose_block`` counts a joining record (concurrent joiners spread
        over the blocks instead of all taking the same least-held one); routers, state fetches and the
        rebalancing rule's ready counts ignore it: the node is not ready (Petals servers announce
        JOINING the same way). The simulator (``bench/sim``) models exactly this."""
        self.state = "joining"
        self.discovery.start_announcing(self.announcements)
        # on every exit path from here (a failed late join too), the records are withdrawn
        self.teardown.push("joining announcement", lambda: self.discovery.stop_announcing(withdraw=True, timeout=2.5),
                           budget=3.0)
        self._late_join()
        self.state = "online"
        self.discovery.stop_announcing(withdraw=False)   # restart the refresher: "online" is stored now,
        self.discovery.start_announcing(self.announcements)   # not at its next period

    def _late_join(self) -> None:
        """Download the block's current state before training (unless resumed): the best of up to
        ``--state-sources`` online holders' states, judged (:meth:`state_judge`) over the block RPC."""
        if self.resumed:
            return
        if not self.trainer.ready():
            self._error("late join skipped: no snapshot of the upstream blocks yet to judge a download by")
            return
        others = [a for a in self.discovery.list_holders(self.run_id).get(self.block_index, [])
                  if a.peer_id != self.peer_id and a.state == "online"]   # joiners have nothing to give yet
        if not others:
            return
        t0 = time.monotonic()
        nbytes = state_bytes(self.trainer.module)
        timeout = transfer_timeout(nbytes)   # 30 s, or more for a block a slow link cannot carry in 30 s
        judge = self.state_judge(self.trainer, {})
        got = self.fetcher.fetch_best(self.block_index, others, judge, sources=self.opts.state_sources,
                                      errors=self.errors, timeout=timeout)
        if got is not None:
            self.trainer.load_state(got.tensors, step=int(got.meta.get("step", 0)),
                                    samples_seen=int(got.meta.get("samples_seen", 0)))
            self.downloaded = got.meta
        self.late_join = {"via": "block rpc" if got is not None else None, "s": round(time.monotonic() - t0, 2),
                          "mb": round(nbytes / 1e6, 2), "from": got.peer if got is not None else None,
                          "judged_by": "check loss" if self.trainer.judges_by_loss else "chain ce",
                          "fresh": _finite_or_none(judge.fresh),
                          "compared": got.compared if got is not None else []}

    def state_judge(self, trainer: BlockTrainer, held: dict) -> StateJudge:
        """How a downloaded state of ``trainer``'s block is judged before this node trains it (a late
        join, a move): a block-local block by its own check loss, a chain-trained one by the chain's
        held-out CE on the trainer's check windows with the offered block in place, the blocks in
        ``held`` (block -> hop) run here and the others through the network; either refuses a state
        worse than ``trainer``'s fresh block by the averaging margin (``max_loss_increase``)."""
        margin = self.averager.policy.max_loss_increase
        if trainer.judges_by_loss:
            return LossJudge(trainer, margin)
        b = trainer.block_index
        router = Router(self.discovery, self.client, self.run_id, self.cfg.n_blocks, local_hops=dict(held),
                        self_peer=self.peer_id, bans=self.route_bans, ranking=self.ranking, discovery_grace_s=1.0)

        def chain_ce(hop) -> float:
            router.local_hops[b] = hop
            return generation.score(trainer.objective, router, trainer.check_windows, 1)["chain_ce"]

        return ChainJudge(trainer.objective, b, chain_ce, trainer.module, margin)   # a fresh block: nobody uses it yet

    def announcements(self) -> list[BlockAnnouncement]:
        """What the refresher stores: this node's block, and while it moves, the block it is joining."""
        anns = [self.announcement()]
        moving_to = self.moving_to
        if moving_to is not None:
            anns.append(anns[0].model_copy(update={"block_index": moving_to, "state": "joining", "step": 0,
                                                    "samples_seen": 0, "loss": None, "last_round_time": None}))
        return anns

    def announcement(self) -> BlockAnnouncement:
        t = self.trainer
        return BlockAnnouncement(
            peer_id=self.peer_id, block_index=self.block_index, state=self.state, step=t.step,
            samples_seen=t.samples_seen, throughput=float(t.throughput()), serving=self.reach.serving,
            loss=_finite_or_none(t.recent_loss()),
            last_round_time=self.averager.stats.last_accepted_time if self.averager else None,
            addresses=self.reach.addresses()[:4], software_version=SOFTWARE_VERSION,
            config_hash=self.cfg.config_hash, run_id=self.run_id)

    # -- loops ----------------------------------------------------------------------------------
    def _idle(self) -> bool:
        o = self.opts
        return not o.train or (o.max_steps is not None and self.trainer.step >= o.max_steps)

    def _train(self, stop: threading.Event) -> None:
        while not stop.is_set():
            t = self.trainer   # re-read: a rebalancing move swaps it between steps
            if self._idle() or not t.ready():
                stop.wait(0.5)
                continue
            self.duty.paced(lambda: self._step(t), stop)

    def _step(self, t: BlockTrainer) -> None:
        t.train_step()
        self._after_step()

    def _after_step(self) -> None:
        """After each optimizer step (local, or the pipeline engine's): wake averaging, checkpoint."""
        t, o = self.trainer, self.opts
        if t.step % o.average_every == 0:
            self._avg_wakeup.set()
        if t.step % o.checkpoint_every == 0:
            self.try_checkpoint()

    def _average(self, stop: threading.Event) -> None:
        """A round every ``average_every`` local steps; with ``average_clock``, also once in each period
        of that many seconds of the wall clock, at the same instant on every holder of the block
        (replicas that step at different rates still look for a group together); while not training
        (max steps reached, serve-only), a round every ``average_period`` seconds so idle replicas
        keep converging."""
        last = time.monotonic()
        clock = AverageClock(self.opts.average_clock, self.cfg.n_blocks, lambda: self.block_index)
        while not stop.is_set():
            woke = self._avg_wakeup.wait(timeout=0.5)
            on_clock = clock.due()
            if not (woke or on_clock or (self._idle() and time.monotonic() - last >= self.opts.average_period)):
                continue
            last = time.monotonic()
            self._avg_wakeup.clear()
            if stop.is_set():
                break
            if not self._block_has_peers():
                self.averager.stats.skipped_alone += 1
                continue
            self.averager.round()

    def _block_has_peers(self) -> bool:
        """Does another node announce this block? A round alone forms no group, and its matchmaking
        (hivemind polls the DHT for partners until its timeout) kept an idle lone node at 77-91% of a
        core and slowed its training 3-9x through the GIL (BENCHMARKS.md "Idle cost"). Unknown (DHT
        unreadable): try."""
        try:
            holders = self.router.holders().get(self.block_index, [])
        except Exception as e:
            log.info("could not read this block's holders (%s); trying the round", e)
            return True
        return any(a.peer_id != self.peer_id and a.state == "online" for a in holders)

    def _eval(self, stop: threading.Event) -> None:
        """Held-out chain CE through the network every ``eval_every`` seconds (for the dashboard and
        /v1/status); a failed measurement (a block without holder) is just skipped."""
        while not stop.wait(self.opts.eval_every):
            try:
                self.evaluate()
            except Exception as e:
                log.info("held-out evaluation skipped: %s", e)

    def save_checkpoint(self, trainer: BlockTrainer | None = None) -> None:
        """Write this block's checkpoint (or ``trainer``'s: a rebalancing move's old block); raises what the
        write raised. Every file is replaced atomically, so a failed write leaves the last good checkpoint."""
        t = trainer or self.trainer
        t0 = time.monotonic()
        t.save(self.opts.checkpoint_dir)
        self.last_save_s = time.monotonic() - t0
        self.checkpoints_written += 1
        self.last_checkpoint = {"block": t.block_index, "step": t.step, "at": time.time()}
        if self.checkpoint_error is not None:
            log.warning("checkpoint written again (block %d, step %d)", t.block_index, t.step)
            self.checkpoint_error = None

    def try_checkpoint(self, trainer: BlockTrainer | None = None) -> bool:
        """A checkpoint while the node runs: a write the disk refuses (OSError: full, read-only, quota,
        permissions) is reported (log, errors, status) and the node trains and serves on, retrying at the
        next one; its state lives on in its replicas and in the checkpoint on disk, which a failed write
        leaves as it was. A volunteer's full disk used to stop the node. Other errors still raise."""
        t = trainer or self.trainer
        try:
            self.save_checkpoint(t)
            return True
        except OSError as e:
            self.checkpoints_failed += 1
            first = self.checkpoint_error is None
            kept = (f"the checkpoint of step {self.last_checkpoint['step']} stays" if self.last_checkpoint
                    else "no earlier checkpoint of this run")
            self.checkpoint_error = (f"checkpoint of block {t.block_index} at step {t.step} not written to "
                                     f"{self.opts.checkpoint_dir}: {e.strerror or e}; training and serving go on "
                                     f"({kept}, retried every --checkpoint-every {self.opts.checkpoint_every} steps)")
            if first:   # once per streak of failures: the errors list keeps room for other news
                log.error("%s", self.checkpoint_error)
                self._error(self.checkpoint_error)
            else:
                log.debug("%s", self.checkpoint_error)
            return False

    def train_loop_budget(self) -> float:
        """Seconds the stop waits for the train loop: 3, or the step in progress if steps are slower."""
        if self.trainer is None:
            return LOOP_STOP_S
        return min(FINAL_CHECKPOINT_MAX_S, max(LOOP_STOP_S, 1.5 * self.trainer.lock.longest_recent_hold() + 1.0))

    def final_checkpoint_budget(self) -> float:
        """Seconds the stop gives its final checkpoint: it waits for the step in progress (the trainer's
        lock), then writes the block and its AdamW state. 4 s unless this block's recent steps or
        saves were slower; then twice those (at most 2 minutes), so that a big block's stop does not
        abandon its checkpoint (a second Ctrl-C still exits at once)."""
        if self.trainer is None:
            return FINAL_CHECKPOINT_S
        save = self.last_save_s
        if save is None:
            save = 3 * state_bytes(self.trainer.module) / SAVE_BYTES_PER_S
        need = 2.0 * (self.trainer.lock.longest_recent_hold() + save) + 1.0
        return min(FINAL_CHECKPOINT_MAX_S, max(FINAL_CHECKPOINT_S, need))

    def _final_checkpoint(self) -> None:
        if self._checkpoint_ok:
            try:
                self.save_checkpoint()
            except Exception as e:
                self._error(f"final checkpoint failed: {e}")
                self.failure = self.failure or f"final checkpoint failed: {e}"

    # -- what the API may ask ------------------------------------------------------------------
    def generate(self, prompt: bytes, max_bytes: int, mode: str, seed: int | None, temperature: float) -> dict:
        out = generation.generate(self.trainer.objective, self.router, prompt, max_bytes, mode, seed=seed,
                                  temperature=temperature)
        out.pop("bytes")
        return out

    def generate_limits(self) -> dict[str, dict[str, int]]:
        return generation.limits(self.trainer.objective)

    def score(self, text: bytes, k: int) -> dict:
        res = generation.score(self.trainer.objective, self.router, text_windows(text, self.cfg.seq_len), k)
        return {"ce": res["chain_ce"], "ce_kind": res["ce_kind"], "bytes_scored": res["tokens"], "k": res["k"],
                "route": res["route"]}

    def evaluate(self, n_windows: int = 16, k: int = 2) -> dict:
        """Held-out chain CE through the network now (recorded for the dashboard)."""
        windows = eval_windows(self.split.eval, self.cfg.seq_len, n_windows)
        res = generation.score(self.trainer.objective, self.router, windows, k)
        self.chain_ce_history.append((time.time(), res["chain_ce"]))
        del self.chain_ce_history[:-100]
        return res

    def average_now(self) -> dict:
        v = self.averager.round()
        if v is None:
            return {"accepted": None, "reason": self.averager.stats.last_failure}
        return {"accepted": v.accepted, "reason": v.reason, "relative_change": v.relative_change}

    def snapshot(self) -> NodeStatus:
        return build_status(self)

    # -- stop -----------------------------------------------------------------------------------
    def stop(self, deadline: float = STOP_DEADLINE) -> None:
        """Leave gracefully: loops, final checkpoint, tombstones, HTTP, averager, RPC, DHT (and p2pd),
        identity; within ``deadline`` seconds. Safe to call twice."""
        if self.state == "stopped":
            return
        self.state = "leaving"
        self.stop_event.set()
        for loop in self.loops:   # every loop at once, so each join below finds its loop ending
            loop.stop_event.set()
        self._avg_wakeup.set()
        if self.averager is not None:
            self.averager.cancel_event.set()
        if self.pipeline is not None:   # no new micro-batches: callers retry them elsewhere
            self.pipeline.leave()
        extra = (self.train_loop_budget() - LOOP_STOP_S) + (self.final_checkpoint_budget() - FINAL_CHECKPOINT_S)
        if extra > 0:
            log.warning("stopping waits for the training step in progress, then writes the final checkpoint: "
                        "up to %.0f s more than usual (signal again to exit at once)", extra)
        self.teardown.close(deadline=deadline + max(0.0, extra))
        self.errors.extend(self.teardown.errors)
        self.state = "stopped"

    def wait(self) -> None:
        while not self.stop_event.wait(0.5):
            pass
