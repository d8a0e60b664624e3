"""Gossip averaging of same-block replicas with hivemind's DecentralizedAverager.

No coordinator: replicas of block b of run R meet under the DHT prefix ``{R}_block{b}`` every
few local steps, all-reduce their parameters weighted by samples since the last round, and each
one accepts the result only after robust checks (``acceptance.py``). Training never waits on a
round: rounds run in their own thread, and the accepted *change* (average - snapshot) is added to
the live weights, so steps taken during the round are kept. The averager also serves the block's
current state to late joiners (``load_state_from_peers``).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from hivemind.averaging import DecentralizedAverager

from .acceptance import AcceptancePolicy, Verdict, judge
from .trainer import BlockTrainer

log = logging.getLogger(__name__)
# "could not find a group" is the normal outcome of a round with no same-block peer online;
# hivemind logs it as an error with a traceback. Our own stats and log lines report rounds.
logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)


class _BlockStateAverager(DecentralizedAverager):
    """A DecentralizedAverager whose shared state is the trainer's live block (for late joiners)."""

    trainer: BlockTrainer | None = None

    def get_current_state(self):
        t = self.trainer
        if t is None:
            return super().get_current_state()
        with t.lock:
            tensors = [p.detach().to("cpu").clone() for p in t.module.parameters()]
            meta = {"step": t.step, "samples_seen": t.samples_seen, "config_hash": t.cfg.config_hash,
                    "block_index": t.block_index}
        return meta, tensors, self.tensor_infos


@dataclass
class AveragingStats:
    attempted: int = 0
    succeeded: int = 0
    rejected: int = 0
    failed: int = 0
    last_round_time: float | None = None
    last_group_size: int = 0
    last_verdict: str = ""
    history: list = field(default_factory=list)   # (time, group size, accepted, reason)


class BlockAverager:
    def __init__(self, dht, trainer: BlockTrainer, run_id: str, *, peer_id: str = "",
                 policy: AcceptancePolicy | None = None, target_group_size: int = 4,
                 matchmaking_time: float = 3.0, round_timeout: float = 20.0, compression=None,
                 banned: "callable | None" = None):
        from hivemind.compression import NoCompression
        self.trainer, self.run_id, self.peer_id = trainer, run_id, peer_id
        self.policy = policy or AcceptancePolicy()
        self.round_timeout = round_timeout
        self.stats = AveragingStats()
        self.round_no = 0
        self.banned = banned
        self.prefix = f"{run_id}_block{trainer.block_index}"
        tensors = [p.detach().to("cpu").clone() for p in trainer.module.parameters()]
        self.averager = _BlockStateAverager(
            averaged_tensors=tensors, dht=dht, start=False, prefix=self.prefix,
            target_group_size=target_group_size, min_group_size=2, min_matchmaking_time=matchmaking_time,
            request_timeout=max(1.0, matchmaking_time / 2), compression=compression or NoCompression(),
            allow_state_sharing=True, next_chunk_timeout=10.0, sender_timeout=5.0, reducer_timeout=10.0,
        )
        self.averager.trainer = trainer
        self.averager.run_in_background(await_ready=True, timeout=60)
        self._lock = threading.Lock()
        self.cancel_event = threading.Event()

    # -- late joiners -----------------------------------------------------------------------------
    def download_state(self, timeout: float = 30.0) -> dict | None:
        """Fetch the block's current state from a live holder; returns its metadata or None."""
        got = self.averager.load_state_from_peers(timeout=timeout)
        if got is None:
            return None
        meta, tensors = got
        params = list(self.trainer.module.parameters())
        if not isinstance(meta, dict) or meta.get("config_hash") != self.trainer.cfg.config_hash:
            raise ValueError("a peer offered state for a different config; refusing it")
        if len(tensors) != len(params) or any(t.shape != p.shape for t, p in zip(tensors, params)):
            raise ValueError("a peer offered block state of the wrong shape; refusing it")
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            raise ValueError("a peer offered non-finite block state; refusing it")
        with self.trainer.lock:
            for p, t in zip(params, tensors):
                p.data.copy_(t.to(p.device, p.dtype))
            self.trainer.step = int(meta.get("step", 0))
            self.trainer.samples_seen = int(meta.get("samples_seen", 0))
        return meta

    # -- one round --------------------------------------------------------------------------------
    def round(self) -> Verdict | None:
        """Run one averaging round now (blocking this thread). None if no group formed."""
        with self._lock:
            return self._round()

    def _round(self) -> Verdict | None:
        t = self.trainer
        self.round_no += 1
        self.stats.attempted += 1
        with t.lock:
            snapshot = [p.detach().to("cpu").clone() for p in t.module.parameters()]
            weight = float(max(1, t.samples_since_average))
            step = t.step
        with self.averager.get_tensors() as shared:
            for s, x in zip(shared, snapshot):
                s.copy_(x)
        stamp = {"round": self.round_no, "step": step, "peer": self.peer_id,
                 "config_hash": t.cfg.config_hash, "n_tensors": len(snapshot)}
        gathered = None
        try:
            control = self.averager.step(gather=stamp, weight=weight, timeout=self.round_timeout,
                                         allow_retries=False, wait=False)
            deadline = time.monotonic() + self.round_timeout + 30
            while not control.done():
                if self.cancel_event.is_set() or time.monotonic() > deadline:
                    control.cancel()
                    break
                time.sleep(0.1)
            if control.done() and not control.cancelled():
                gathered = control.result(timeout=1)
        except Exception as e:  # hivemind raises on broken rounds; training goes on regardless
            log.info("averaging round %d failed: %s", self.round_no, e)
        if not gathered:
            self.stats.failed += 1
            return None
        group = [g for g in gathered.values() if isinstance(g, dict)]
        if len(group) != len(gathered) or any(g.get("config_hash") != t.cfg.config_hash or
                                              g.get("n_tensors") != len(snapshot) for g in group):
            verdict = Verdict(False, "group members disagree on config or tensor layout")
        else:
            with self.averager.get_tensors() as shared:
                averaged = [s.detach().clone() for s in shared]
            verdict = judge(snapshot, averaged, self.policy, self._check_loss)
        self.stats.last_group_size = len(gathered)
        self.stats.last_round_time = time.time()
        self.stats.last_verdict = verdict.reason
        self.stats.history.append((time.time(), len(gathered), verdict.accepted, verdict.reason))
        del self.stats.history[:-100]
        if not verdict.accepted:
            self.stats.rejected += 1
            log.warning("rejected averaging round %d: %s", self.round_no, verdict.reason)
            return verdict
        with t.lock:
            for p, a, s in zip(t.module.parameters(), averaged, snapshot):
                p.data.add_((a - s).to(p.device, p.dtype))
            t.samples_since_average = 0
        self.stats.succeeded += 1
        return verdict

    def _check_loss(self, tensors) -> float:
        t = self.trainer
        probe = t.objective.build_block(t.block_index).to(t.device)
        with torch.no_grad():
            for p, x in zip(probe.parameters(), tensors):
                p.copy_(x.to(p.device, p.dtype))
        return t.check_loss(probe)

    def shutdown(self) -> None:
        self.cancel_event.set()
        try:
            self.averager.shutdown()
        except Exception:  # already gone
            pass
