"""Gossip averaging of same-block replicas: the round policy (hivemind stays behind p2p/averager.py).

No coordinator: replicas of block b of run R meet under the DHT prefix ``{R}_block{b}`` every
few local steps, all-reduce their parameters weighted by samples since the last complete round, and each
one accepts the result only after robust checks (``acceptance.py``). Training never waits on a
round: rounds run in their own thread, and the accepted *change* (group mean - the weights we
sent) is handed to the trainer, which adds it to the live weights, so steps taken during the round
are kept. The weights go straight into the averager's buffers and the change is read there in
place (p2p/averager.py): a round holds no copy of the block of ours, except the weights sent, kept
for the check loss of objectives judged by it. A block's state is not downloaded through the
averager (hivemind's state sharing stays off): late joiners and movers fetch it over the block RPC
from announced holders and judge it (``node/state_fetch.py``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from blocktrain.node.averaging.acceptance import (AcceptancePolicy, Verdict, check_group, judge,
                                                  round_completeness, tensors_norm, weight_sketch)
from blocktrain.node.routing.bans import PeerBans
from blocktrain.node.trainer import BlockTrainer
from blocktrain.p2p.averager import BlockAveragerHandle, RoundFailed

log = logging.getLogger(__name__)


@dataclass
class AveragingStats:
    attempted: int = 0
    succeeded: int = 0
    rejected: int = 0
    failed: int = 0
    partial: int = 0          # accepted rounds whose result moved < 90 % of the way to the group's mean
    stalled: int = 0          # members that joined a group of ours, then sent or reduced nothing (banned)
    skipped_alone: int = 0    # scheduled rounds not tried: no other holder of the block announced
    last_completeness: float | None = None
    last_round_time: float | None = None
    last_accepted_time: float | None = None
    last_group_size: int = 0
    last_verdict: str = ""
    last_failure: str = ""    # why the last round that formed no usable group failed
    history: list = field(default_factory=list)   # (time, group size, accepted, reason)
    round_seconds: list = field(default_factory=list)   # wall time of recent rounds that formed a group
    round_started: list = field(default_factory=list)   # wall-clock instants recent rounds began (any outcome)
    compression: str = "fp32"


class BlockAverager:
    def __init__(self, dht, trainer: BlockTrainer, run_id: str, *, peer_id: str = "",
                 policy: AcceptancePolicy | None = None, compression: str = "fp32",
                 authorize: Callable[[str], bool] | None = None, prefix: str | None = None,
                 bans: PeerBans | None = None, **handle_kw):
        self.trainer, self.run_id, self.peer_id = trainer, run_id, peer_id
        self.policy = policy or AcceptancePolicy()
        self.stats = AveragingStats(compression=compression)
        self.round_no = 0
        self.prefix = prefix or f"{run_id}_block{trainer.block_index}"
        self.authorize = authorize          # private runs: may this peer average with us?
        self.bans = bans or PeerBans()      # peers blamed for rejected rounds (see acceptance.py)
        # the averager's buffers take their shapes from the live weights; their values are never read
        # before a round stages the weights (and they are given back once the averager is up)
        self.handle = BlockAveragerHandle(dht, [p.detach() for p in trainer.module.parameters()], prefix=self.prefix,
                                          compression=compression, state=trainer.shared_state,
                                          authorize=authorize, **handle_kw)
        self._lock = threading.Lock()
        self.cancel_event = threading.Event()

    def traffic(self) -> dict:
        return self.handle.traffic()

    # -- one round --------------------------------------------------------------------------------
    def round(self) -> Verdict | None:
        """Run one averaging round now (blocking this thread). None if no group formed."""
        with self._lock:
            return self._round()

    def _round(self) -> Verdict | None:
        t = self.trainer
        self.round_no += 1
        self.stats.attempted += 1
        self.stats.round_started.append(time.time())
        del self.stats.round_started[:-20]
        if not t.ready():   # e.g. forward-chained without snapshots of blocks < b: cannot judge a round
            return self._failed(t.not_ready_reason())
        try:
            with self.handle.staging() as buffers:
                weight, step = t.parameters_for_round(buffers)
        except RoundFailed as e:
            return self._failed(e.reason)
        # read from the staged buffers, which nothing writes until the round starts
        sent = [x.clone() for x in buffers] if t.judges_by_loss else None   # the check loss needs them
        stamp = {"round": self.round_no, "step": step, "peer": self.peer_id,
                 "config_hash": t.cfg.config_hash, "n_tensors": len(buffers),
                 "weight": weight, "sketch": weight_sketch(buffers)}
        sent_norm = tensors_norm(buffers)
        t0 = time.monotonic()
        try:
            with self.handle.round(weight=weight, gather=stamp, refused=self.bans.banned(),
                                   cancel=self.cancel_event) as res:
                self.stats.round_seconds.append(round(time.monotonic() - t0, 3))
                del self.stats.round_seconds[:-100]
                return self._settle(res.gathered, res.change, stamp, sent, sent_norm, res.stalled, res.unaveraged)
        except RoundFailed as e:
            if e.refused:   # we left a group holding banned peers
                return self._record(Verdict(False, e.reason), 0)
            return self._failed(e.reason)

    def _settle(self, gathered: dict, change: list, stamp: dict, sent, sent_norm: float,
                stalled: tuple[str, ...] = (), unaveraged: float = 0.0) -> Verdict:
        """Judge a round that formed a group and apply its change if accepted."""
        t = self.trainer
        others = [p for p in gathered if p != self.peer_id]
        verdict = check_group(gathered, self_peer=self.peer_id, config_hash=t.cfg.config_hash,
                              n_tensors=len(change), authorize=self.authorize, banned=self.bans.is_banned)
        if verdict is not None:
            self.bans.strike(verdict.offenders, verdict.reason, attributable=True)
        else:
            def check_losses() -> tuple[float, float]:   # the copy of the weights sent becomes the average
                before = t.check_loss_of(sent)
                for x, c in zip(sent, change):
                    x.add_(c)
                return before, t.check_loss_of(sent)

            # chain-trained blocks have no loss alone: judged on finiteness and change size only
            verdict = judge(change, self.policy, local_norm=sent_norm,
                            check_losses=check_losses if t.judges_by_loss else None)
            if verdict.accepted:
                self.bans.forgive(others)
            else:   # the mean cannot be pinned on one member: blame every other member (acceptance.py)
                verdict = dataclasses.replace(verdict, offenders=tuple(sorted(others)))
                self.bans.strike(others, verdict.reason, attributable=len(others) == 1)
        if stalled:
            verdict = self._stalled(verdict, stalled, unaveraged)
        self._record(verdict, len(gathered))
        if not verdict.accepted:
            log.warning("rejected averaging round %d: %s", self.round_no, verdict.reason)
            return verdict
        # a round some member stalled averaged part of the block, or nothing but our own values (a partner that
        # never sent): resetting our averaging weight after it made the next round's mean the partner's weights
        # alone (RELIABILITY.md gap 9: the fresher replica then rejected that round)
        t.apply_change(change, complete=not stalled)
        self.stats.succeeded += 1
        self._note_completeness(gathered, stamp, change)
        self.stats.last_accepted_time = time.time()
        return verdict

    def _stalled(self, verdict: Verdict, peers: tuple[str, ...], unaveraged: float) -> Verdict:
        """Members that joined the group and then sent us nothing, or never returned the part they reduced:
        hivemind left them out (their share of our tensors kept our own values) after its sender and
        reducer timeouts, so each such round takes those timeouts longer. Which member it was is known
        exactly, but a stall is as often an honest member that crashed or is overloaded as an attack: each is
        banned for the short (collateral) time, doubling for a member that does it again."""
        self.stats.stalled += len(peers)
        self.bans.strike(list(peers), "stalled an all-reduce (sent or reduced nothing)", attributable=False)
        note = (f"{len(peers)} member(s) stalled the all-reduce, {unaveraged:.0%} of the block not averaged, "
                f"banned: {', '.join(peers)}")
        log.warning("averaging round %d: %s", self.round_no, note)
        return dataclasses.replace(verdict, reason=f"{verdict.reason}; {note}")

    def _record(self, verdict: Verdict, group_size: int) -> Verdict:
        s = self.stats
        if group_size:
            s.last_group_size = group_size
            s.last_round_time = time.time()
        if not verdict.accepted:
            s.rejected += 1
        s.last_verdict = verdict.reason
        s.history.append((time.time(), group_size, verdict.accepted, verdict.reason))
        del s.history[:-100]
        return verdict

    def _failed(self, why: str) -> None:
        self.stats.failed += 1
        self.stats.last_failure = why[:300]

    def _note_completeness(self, gathered: dict, stamp: dict, change) -> None:
        """Diagnostics only: did the all-reduce average every part? (members' claims are not trusted
        for acceptance; a member that lies here only skews this counter)."""
        try:
            members = [(float(g["weight"]), [float(x) for x in g["sketch"]]) for g in gathered.values()]
            if any(len(s) != len(stamp["sketch"]) or not all(map(math.isfinite, [w, *s])) for w, s in members):
                return   # a member sent no usable sketch (an older node, or garbage)
            result = [o + c for o, c in zip(stamp["sketch"], weight_sketch(change))]   # the sketch is linear
            c = round_completeness(stamp["sketch"], result, members)
        except (KeyError, TypeError, ValueError):
            return
        if c is not None and not math.isfinite(c):
            return
        self.stats.last_completeness = c
        if c is not None and c < 0.9:
            self.stats.partial += 1
            log.info("averaging round %d was partial: moved %.0f %% of the way to the group's mean",
                     self.round_no, 100 * c)

    def shutdown(self) -> bool:
        """Stop the averager process; False if it did not stop when asked and was killed."""
        self.cancel_event.set()
        return self.handle.shutdown()
