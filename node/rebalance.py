"""Rebalancing in a running node: move to a needier block, make before break.

The decision is :func:`~blocktrain.node.routing.selection.choose_rebalance`, the same code the
simulator (``bench/sim``) runs, checked once per announcement period (TTL/3) with a fresh random
draw. Its hysteresis (a surplus of 2, the old block keeps 2 live and 2 ready holders, ``min_dwell_s``
on a block before leaving it, a probability so that not every donor moves at once) keeps nodes from
flapping. Its urgent rule (a block with one ready holder or none is rescued without the dwell)
ignores the dwell, so the dwell alone cannot stop a node retrying a refused move every period: a
move that fails restarts the dwell (no ordinary move for ``min_dwell_s``) and the node makes no
move at all for ``RETRY_PERIODS`` periods.

A move from block m to block t (:meth:`Rebalancer.move`), while the node keeps training and serving m:

0. confirm that m keeps ``min_keep`` holders: that many of m's other holders must answer the info RPC
   for this run and config (announced records alone are cheap to forge: Sybil holders of m must
   not talk the real ones out of it); otherwise the move is refused;
1. announce t as ``joining`` (the refresher stores both records; ``block_load`` then counts this
   node in t only, so other donors do not rush to the same hole);
2. download t's state from up to ``--state-sources`` live holders through
   :meth:`~blocktrain.node.state_fetch.StateFetcher.fetch_best` (finite, loads strictly, this run's config
   hash) and keep the best as a late joiner does (``Node.state_judge``: its held-out check loss, or for a
   chain-trained block the chain's held-out CE with it in place; worse than a fresh block's is refused and
   the next holder asked); no acceptable offer: the move is abandoned (the ``joining`` record is
   tombstoned), nothing of block m changed;
3. look at the DHT again (:func:`~blocktrain.node.routing.selection.switch_counts`): if block m would
   keep fewer than ``min_keep`` ready holders and no more than t will have (its holders left during the
   download, or another donor of m decided on a view that did not show this node's move: the one with
   the smaller peer id goes, the other defers), the move is abandoned as in 2: leaving would only trade
   one short block for another;
4. start t's averager (a child process), serve t's hops and state, then switch: trainer, averager,
   router, announcement (t ``online``); m's checkpoint is written and m's record tombstoned;
5. after a grace period (routers cache holder lists for 3 s) stop serving m and its averager.

A chain-trained node (``pipeline``, ``forward-streamed``) moves the same way (its download judged by the
chain's CE, block m run here and the others through the network); before
the switch t's pipeline engine is built and its ``rpc_train`` service registered, refusing work
(``busy``) until the switch commits it; then the train loop leaves m's engine (its ``run`` returns; new
micro-batches to m are refused, ``busy``, so their senders try m's other holders; those m holds finish
or expire) for t's, carrying on the node's pipeline totals; step 5 also stops m's engine and service.
Micro-batches of m in flight at the switch may be lost (counted); no wait is unbounded.

Forward-chained objectives (a block trains on snapshots of the blocks before it) do not move: the
node does not start a rebalancer for them (a move would also have to rebuild those snapshots).
"""
from __future__ import annotations

import logging
import random
import threading
import time

from blocktrain.node.pipeline.compose import PreparedSwitch
from blocktrain.node.routing.selection import (RebalancePolicy, block_load, choose_rebalance, may_switch, ready_load,
                                               switch_counts)
from blocktrain.node.state_fetch import state_bytes, transfer_timeout

log = logging.getLogger(__name__)
GRACE_S = 5.0   # keep serving the old block this long after its tombstone (routers cache holders 3 s)
RETRY_PERIODS = 6   # after a refused move, no move for this many periods (60 s at the default 30 s TTL)
CONFIRM_TRIES = 8   # holders of the old block asked whether they serve the run before leaving it
CONFIRM_TIMEOUT_S = 3.0


class MoveRefused(Exception):
    """A move abandoned before the switch; the node still holds its old block, unchanged."""


class Rebalancer:
    def __init__(self, node, *, dwell_s: float, period_s: float, policy: RebalancePolicy | None = None,
                 rng: random.Random | None = None):
        self.node = node
        self.policy = policy or RebalancePolicy(min_dwell_s=dwell_s)
        self.period_s = period_s
        self.rng = rng or random.Random()
        self.moves: list[dict] = []          # finished moves: from, to, at, took_s, state_from, why (the view)
        self.refused: list[dict] = []        # abandoned moves: to, at, reason
        self.checks = 0
        self.retry_at = 0.0                  # monotonic: no move before this (set by a refused move)
        self.last_view: list[int] | None = None   # live holders per block at the last check
        self.last_ready: list[int] | None = None  # ready (online) holders per block at the last check
        self.last_held_s = 0.0                    # how long this node had held its block at the last check
        self._lock = threading.Lock()

    def status(self) -> dict:
        n = self.node
        return {"enabled": True, "checks": self.checks, "moving_to": n.moving_to,
                "held_for_s": round(time.monotonic() - n.block_since, 1),
                "min_dwell_s": self.policy.min_dwell_s, "last_view": self.last_view,
                "retry_in_s": round(max(0.0, self.retry_at - time.monotonic()), 1),
                "moves": self.moves[-10:], "refused": self.refused[-10:]}

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.period_s):
            self.check(stop)

    def check(self, stop: threading.Event) -> int | None:
        """One look at the run: move if the policy says so; returns the block moved to, or None."""
        n = self.node
        self.checks += 1
        holders = n.discovery.list_holders(n.run_id)
        self.last_view = block_load(holders, n.cfg.n_blocks)[0]
        self.last_ready = ready_load(holders, n.cfg.n_blocks)
        self.last_held_s = time.monotonic() - n.block_since
        if time.monotonic() < self.retry_at:
            return None
        t = choose_rebalance(holders, n.cfg.n_blocks, n.block_index, n.peer_id,
                             held_for_s=self.last_held_s, draw=self.rng.random(), policy=self.policy)
        if t is None or stop.is_set():
            return None
        return self.move(t, holders, stop)

    def move(self, t: int, holders: dict, stop: threading.Event) -> int | None:
        n = self.node
        m, t0 = n.block_index, time.monotonic()
        # why: the view the rule decided on, and whether block t was short (rule 5) or the move ordinary
        live, ready = self.last_view, self.last_ready
        short = bool(live and ready and self.policy.wanted(ready[t], live[t] - ready[t]) > 0)
        why = {"live": live, "ready": ready, "held_s": round(self.last_held_s, 1),
               "rule": "short block" if short else "ordinary"}
        log.info("rebalancing: moving from block %d to block %d (holders per block %s)", m, t, self.last_view)
        try:   # before anything is announced: nothing to undo if m cannot spare this node
            self._confirm_keepers(m, holders)
        except MoveRefused as e:
            self._refused(t, str(e))
            return None
        with self._lock:
            new_avg = switch = None
            n.moving_to = t
            try:
                n.discovery.announce(n.announcements()[-1])   # t as joining, now (the refresher repeats it)
                trainer, fetched = self._download(t, holders)
                if stop.is_set():
                    raise MoveRefused("the node is stopping")
                self._check_switch(m, t)   # m's holders may have left (or moved) while this node downloaded
                new_avg = n.new_averager(trainer)
                if n.pipeline is not None:   # chain-trained: t's engine, its rpc_train up but refusing until committed
                    switch = PreparedSwitch(n, trainer)
                if stop.is_set():
                    raise MoveRefused("the node is stopping")
                self._switch(m, trainer, new_avg, switch)
            except Exception as e:
                reason = str(e) if isinstance(e, MoveRefused) else f"{type(e).__name__}: {e}"
                self._abandon(t, new_avg, reason, switch)
                return None
            try:   # committed: from here on block t is this node's, whatever the DHT says
                self._reannounce(withdraw_block=m)
            except Exception as e:   # the old record then lives out its TTL
                n._error(f"withdrawing the record of block {m} after the move: {type(e).__name__}: {e}")
        self.moves.append({"from": m, "to": t, "at": time.time(), "took_s": round(time.monotonic() - t0, 2),
                           "state_from": fetched.peer, "step": trainer.step, "why": why})
        del self.moves[:-50]
        log.info("rebalancing: now holding block %d (was %d), took %.1f s", t, m, time.monotonic() - t0)
        stop.wait(GRACE_S)
        self._retire(m, switch)
        return t

    def _confirm_keepers(self, m: int, holders: dict) -> None:
        """Before leaving block m: at least ``min_keep`` of its other holders must answer the info RPC
        as members of this run with this config. DHT records alone are cheap to forge (a Sybil
        announcing many holders of m would otherwise talk every real holder out of it); a record
        whose peer does not answer is not a holder m can rely on. Asks at most ``CONFIRM_TRIES``
        holders, those the router has measured as good first."""
        n = self.node
        need = self.policy.min_keep
        # ready (online) holders only, as the rule counts them: a joiner still downloading keeps nothing yet
        others = [a.peer_id for a in holders.get(m, []) if a.state == "online" and a.peer_id != n.peer_id]
        others = n.ranking.order(others)   # measured good holders first, failing ones last
        confirmed = 0
        for peer in others[:CONFIRM_TRIES]:
            try:
                runs = n.client.get_info_sync(peer, timeout=CONFIRM_TIMEOUT_S)
            except Exception as e:   # no answer, a refusal, a timeout: not a holder to rely on
                log.info("rebalancing: holder %s of block %d did not confirm: %s", peer, m, e)
                continue
            if any(r["run_id"] == n.run_id and r["config_hash"] == n.cfg.config_hash for r in runs):
                confirmed += 1
                if confirmed >= need:
                    return
        raise MoveRefused(f"block {m} would keep {confirmed} confirmed holder(s) besides this node "
                          f"(asked {min(len(others), CONFIRM_TRIES)} of {len(others)} announced), fewer than {need}")

    def _check_switch(self, m: int, t: int) -> None:
        """Just before the switch, on a fresh DHT view: holders that confirmed at the start may have left
        meanwhile, and a donor of m that decided within the same period (neither saw the other's move)
        may be leaving too. Refuses the move unless m keeps ``min_keep`` ready holders or more than t
        will have (:func:`~blocktrain.node.routing.selection.may_switch`)."""
        n = self.node
        keep, come = switch_counts(n.discovery.list_holders(n.run_id), n.cfg.n_blocks, m, t, n.peer_id)
        if not may_switch(keep, come, self.policy):
            raise MoveRefused(f"block {m} would keep {keep} ready holder(s) and block {t} has {come} besides "
                              f"this node: leaving would only trade one short block for another")

    def _download(self, t: int, holders: dict):
        """A trainer of block t holding the best checked state of up to ``--state-sources`` of t's live
        holders, judged as a late joiner's download is (``Node.state_judge``; a chain-trained block by the
        chain's CE with it in place, this node's block m run here)."""
        n = self.node
        others = [a for a in holders.get(t, []) if a.state == "online" and a.peer_id != n.peer_id]
        trainer = n.new_trainer(t)
        timeout = transfer_timeout(state_bytes(trainer.module))   # a large block over a slow link needs more than 30 s
        judge = n.state_judge(trainer, {n.block_index: n.trainer.hop})
        got = n.fetcher.fetch_best(t, others, judge, sources=n.opts.state_sources, errors=n.errors, timeout=timeout)
        if got is None:
            raise MoveRefused(f"no holder of block {t} offered an acceptable state")
        trainer.load_state(got.tensors, step=int(got.meta.get("step", 0)), samples_seen=int(got.meta.get("samples_seen", 0)))
        return trainer, got

    def _switch(self, m: int, trainer, new_avg, switch: PreparedSwitch | None) -> None:
        """Serve block t and make it this node's block; block m is still served until :meth:`_retire`.
        A chain-trained node's train loop moves to t's engine last (``switch.commit``)."""
        n = self.node
        n.serve_block(trainer)
        old = n.trainer
        n.try_checkpoint(old)   # block m's last local state stays on disk (a full disk does not stop the move)
        n.trainer, n.averager, n.old_averager = trainer, new_avg, n.averager
        n.router.local_hops = {trainer.block_index: trainer.hop}
        n.block_index, n.block_since, n.moving_to = trainer.block_index, time.monotonic(), None
        n.downloaded = {"from_move": True}
        if switch is not None:
            switch.commit()

    def _reannounce(self, withdraw_block: int) -> None:
        """Tombstone this node's record of ``withdraw_block`` and keep refreshing the others."""
        n = self.node
        n.discovery.withdraw(n.run_id, withdraw_block)   # also stops the refresher
        if not n.stop_event.is_set():   # a stopping node's teardown withdraws everything itself
            n.discovery.start_announcing(n.announcements)

    def _retire(self, m: int, switch: PreparedSwitch | None = None) -> None:
        n = self.node
        if switch is not None:   # block m's engine and rpc_train service
            try:
                switch.retire_old()
            except Exception as e:
                n._error(f"stopping the pipeline engine of block {m}: {type(e).__name__}: {e}")
        try:
            n.unserve_block(m)
        except Exception as e:  # the daemon may be going away with the node
            n._error(f"stopping to serve block {m}: {type(e).__name__}: {e}")
        old, n.old_averager = n.old_averager, None
        if old is not None and not old.shutdown():
            n._error(f"the averager process of block {m} did not stop when asked and was killed")

    def _refused(self, t: int, reason: str) -> None:
        """Book a move to t that will not happen; back off (the node still holds its old block)."""
        log.warning("rebalancing: move to block %d abandoned: %s", t, reason)
        self.node.block_since = time.monotonic()   # no ordinary move for a full dwell
        self.retry_at = time.monotonic() + RETRY_PERIODS * self.period_s   # and no urgent one for a while
        self.refused.append({"to": t, "at": time.time(), "reason": reason})
        del self.refused[:-50]

    def _abandon(self, t: int, new_avg, reason: str, switch: PreparedSwitch | None = None) -> None:
        n = self.node
        n.moving_to = None
        self._refused(t, reason)
        if new_avg is not None:
            new_avg.shutdown()
        if switch is not None and not switch.committed:   # prepared, never committed
            try:
                switch.cancel()
            except Exception as e:
                n._error(f"dropping the pipeline engine of block {t}: {type(e).__name__}: {e}")
        if t in n._serving and t != n.block_index:
            n.unserve_block(t)
        try:
            self._reannounce(withdraw_block=t)
        except Exception as e:
            n._error(f"withdrawing the joining record of block {t}: {type(e).__name__}: {e}")
        n._error(f"move to block {t} abandoned: {reason}")
