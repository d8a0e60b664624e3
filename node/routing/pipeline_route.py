"""The pipeline's wire adapter and stochastic wiring: send a stage's output to a holder of the next block.

Next to ``hops.py`` (a generation hop as the wire carries it), this is a training micro-batch as
the wire carries it: the state h_b leaves as a ``p2p.pipeline_wire.StageRequest`` to one holder of
block b+1, and the validated answer (dL/dh_b in backprop mode, the losses further down, the route)
comes back. Which holder: drawn at random with probability proportional to 1 / cost as this node
measured it (``HolderRanking.pick``: round trips of earlier calls, busy answers and failures), among
the live announced holders (read from the DHT at most every few seconds, so a holder that just
joined and announced is used from then on). Failures:

* ``outlier`` (a stage's loss screen refused to train on the micro-batch: node/pipeline/screen.py): not the
  holder's fault, and any other holder would refuse it too: the micro-batch ends (:class:`DownstreamFailed`
  ``outlier``), nothing retried, nobody banned;
* ``busy`` (the holder holds as many micro-batches as it may) or ``not_upstream`` (its view of the
  DHT does not list this node yet as a holder of the block before: node/pipeline/admission.py): back off
  briefly and draw again;
* the holder failed or did not answer (unreachable, timeout, bad answer): recorded, banned for a
  while, and another holder is tried, at most ``retries`` times; a holder that did not answer in
  time gets only the shorter collateral ban (the blame may be shared), and none when it is the only
  candidate (banning a slow chain's only holder lost every micro-batch for the ban's length);
* a stage further down failed (``downstream``, ``timeout``): the holder itself was fine; another
  holder of b+1 is tried (it may route around the failure), within the same ``retries``;
* the answer stream was cut before it was complete (``truncated``: a reset of the stream or of the
  connection between the two daemons, seen on a lightly loaded machine too: 3 times in 4,600 calls of
  a 12-minute run) is first taken for a transient fault: the same holder is asked once more at once,
  within the same ``retries``, and banned only if that fails too. Banning it on the first reset made
  a block's only holder unreachable for 10 s: 697 of 4,621 micro-batches lost in that run.

Every call is bounded by what is left of the micro-batch's deadline; when nothing is left, or no
holder remains, :class:`DownstreamFailed` ends the micro-batch (the caller counts it lost). Its
reason is ``timeout`` when time ran out, here or at a stage further down (the last holder tried
answered ``timeout`` or did not answer in time): a block-0 holder then lengthens its budget
(``node/pipeline/budget.py``).

The state is a tensor, or a :data:`StateSource`: a coroutine function asked once per try, whose
tensor is handed to the wire and not kept here (the wire drops it once encoded). A recomputing
stage gives its output up this way and recomputes it only for a retry, so it holds just its input
while the chain below runs (``PipelineEngine._outgoing``).

Holders that answered in the last ``RECENT_S`` seconds stay candidates even when a DHT read lacks
them (a read that timed out or came back partial under load is cached by the router for a few
seconds, and every micro-batch in that window used to fail with ``no_holder``: the likely cause of
arm B's 80 lost micro-batches, BENCHMARKS.md); one that fails us is banned and forgotten. Such a
pick is counted (``routed_unannounced``).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Awaitable, Callable

import torch

from blocktrain.node.routing.bans import PeerBans
from blocktrain.node.routing.ranking import HolderRanking, PeerRecord
from blocktrain.p2p.errors import HopRequestError, HopTimeoutError, RemoteHopError, drop_tracebacks
from blocktrain.p2p.pipeline_rpc import PipelineClient
from blocktrain.p2p.pipeline_wire import StageRequest, StageResponse

StateSource = Callable[[], Awaitable[torch.Tensor]]   # the state to send, made (or handed over) on demand

MIN_CALL_S = 0.3          # no call is started with less time than this left
RECENT_S = 30.0           # a holder that answered this recently stays a candidate without a DHT record
ANSWER_MARGIN_S = 0.2     # what a callee is told it has: our remaining time less this (the answer's trip)
PROBE_FACTOR = 8.0        # a holder not proven yet may take this many times a proven one's measured latency,
PROBE_MIN_S = 2.0         # and at least this: see NextStage._call_timeout


class DownstreamFailed(RuntimeError):
    """The micro-batch could not be carried past this stage; ``reason`` is a short machine word."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class NextStage:
    def __init__(self, client: PipelineClient, holders: Callable[[int, bool], Awaitable[list[str]]], *,
                 mode: str, codec: str, self_peer: str, ranking: HolderRanking | None = None,
                 bans: PeerBans | None = None, retries: int = 2, on_event: Callable[[str], None] | None = None,
                 n_blocks: int | None = None, stage_margin_s: float = 0.0):
        self.client, self.holders, self.mode, self.codec = client, holders, mode, codec
        self.self_peer, self.retries = self_peer, retries
        # what each stage from a block to the last keeps of its caller's deadline (its own margin and the
        # answer's trip): a probe's limit must leave the chain below that much on top (_call_timeout)
        self.n_blocks, self.stage_margin_s = n_blocks, stage_margin_s
        self.ranking = ranking or HolderRanking()
        self.bans = bans or PeerBans(ban_seconds=10.0)
        self.on_event = on_event or (lambda _e: None)   # "retried", "retried_same", "busy", "failed_calls",
        #                                                  "routed_unannounced"
        self._recent: dict[int, dict[str, float]] = {}   # block -> peer -> when it last answered (monotonic)

    def _known(self, block: int) -> list[str]:
        now, seen = time.monotonic(), self._recent.get(block, {})
        for p in [p for p, t in seen.items() if now - t > RECENT_S]:
            del seen[p]
        return list(seen)

    def _forget(self, block: int, peer: str) -> None:
        self._recent.get(block, {}).pop(peer, None)

    def _call_timeout(self, peer: str, pool: list[str], remaining: float, block: int | None = None) -> float:
        """How long a call to ``peer`` may take: all the time left, unless ``peer`` has not proven itself (no
        answer yet, or failing lately) while another holder of the block has; then ``PROBE_FACTOR`` times that
        holder's measured latency, at least ``PROBE_MIN_S``. A holder that takes micro-batches and never answers
        (a stalling Sybil) so costs a micro-batch a few seconds, which it then spends on another holder, instead
        of its whole budget (before: 3 stalling Sybils among 30 announced holders stopped a 2-block chain for
        ~50 s of every minute; docs/records/s28/pipeline_sybils.py). An honest holder slower than that is
        struck off for a while (a collateral ban) and tried again later.

        On top of that limit, the deadline slack of every stage from ``block`` to the last (each keeps
        ``stage_margin_s`` of what it is told and tells the next one ``ANSWER_MARGIN_S`` less): without it
        a probe of block 1 in a 4-block chain was told 1.8 s, its block 3 got a deadline already past, and a
        replica that joined after another holder of its block had answered was never proven (every probe
        failed with ``timeout``; it received 28 micro-batches in 40 s and answered none, 2026-12-06)."""
        def proven(p: str) -> PeerRecord | None:
            r = self.ranking.known(p)
            return r if r is not None and r.successes > 0 and r.latency_s is not None and r.success_rate >= 0.5 \
                else None
        if proven(peer) is not None:
            return remaining
        latencies = [r.latency_s for p in pool if p != peer and (r := proven(p)) is not None]
        if not latencies:
            return remaining
        stages = 0 if self.n_blocks is None or block is None else max(1, self.n_blocks - block)
        slack = stages * (self.stage_margin_s + ANSWER_MARGIN_S)
        return min(remaining, max(PROBE_MIN_S, PROBE_FACTOR * min(latencies)) + slack)

    async def any_holder(self, block: int) -> bool:
        """Is any holder of ``block`` announced (and not banned)? Read from the DHT at most every few seconds."""
        return any(p != self.self_peer and not self.bans.is_banned(p) for p in await self.holders(block, False))

    async def send(self, block: int, state: torch.Tensor | StateSource, targets: torch.Tensor, deadline_s: float,
                   origin: str = "", window: int | None = None) -> StageResponse:
        """Carry (state, targets) to a holder of ``block``; its answer, or DownstreamFailed. ``state``: the
        tensor, or a source asked for it once per try (its tensor is not kept here)."""
        deadline = time.monotonic() + deadline_s
        tried: set[str] = set()
        reset: set[str] = set()      # holders whose answer stream was cut once in this micro-batch
        failures, backoff, fresh, last = 0, 0.05, False, "no holder was asked"
        out_of_time = False          # the last failure was a want of time (ours or a stage's further down)
        rid = uuid.uuid4().hex
        while True:
            remaining = deadline - time.monotonic()
            if remaining < MIN_CALL_S:
                raise DownstreamFailed("timeout", f"no time left to reach block {block} ({last})")
            announced = await self.holders(block, fresh)
            pool = list(dict.fromkeys([*announced, *self._known(block)]))
            cands = [p for p in pool if p != self.self_peer and p not in tried and not self.bans.is_banned(p)]
            if not cands:
                if not fresh:        # read the DHT once more before giving up
                    fresh = True
                    continue
                raise DownstreamFailed("timeout" if out_of_time else "no_holder",   # time, not holders, ran out
                                       f"no live holder of block {block} left to ask ({last})")
            peer = self.ranking.pick(cands)
            if peer not in announced:
                self.on_event("routed_unannounced")
            slot = [state if isinstance(state, torch.Tensor) else await state()]
            remaining = deadline - time.monotonic()   # a source may have computed for a while
            if remaining < MIN_CALL_S:
                raise DownstreamFailed("timeout", f"no time left to reach block {block} ({last})")
            t0 = time.monotonic()
            allowed = self._call_timeout(peer, pool, remaining, block)
            try:   # the request is built inline: once the wire has encoded it, nothing here holds the state
                resp = await self.client.call(peer, StageRequest(
                    block, slot.pop(), targets, self.mode, self.codec,
                    deadline_s=min(600.0, max(0.1, allowed - ANSWER_MARGIN_S)),
                    request_id=f"{rid}-{failures}", origin=origin, window=window), timeout=allowed)
            except HopRequestError as e:      # nothing left this node: our own state is unsendable
                drop_tracebacks(e)
                raise DownstreamFailed("unsendable", f"cannot send the state to block {block}: {e}") from None
            except RemoteHopError as e:
                drop_tracebacks(e)   # handled here: its frames (this micro-batch's tensors) need not wait for the gc
                last = f"{peer[-8:]}: {e.code}: {e.reason}"[:300]
                if e.code == "outlier":   # a stage's loss screen refused the micro-batch itself: any holder would
                    raise DownstreamFailed("outlier", f"block {block} and on refused it ({last})") from None
                # alive and full, or our own record not yet visible to it (``not_upstream``: a holder that
                # just came online): back off, then draw again (it may be picked again); not its fault
                if e.code in ("busy", "not_upstream"):
                    self.on_event("busy")
                    self.ranking.record_failure(peer, "busy")
                    if len(cands) > 1:
                        tried.add(peer)
                    await asyncio.sleep(min(backoff, max(0.0, remaining / 4)))
                    backoff = min(1.0, backoff * 2)
                    continue
                self.on_event("failed_calls")
                out_of_time = e.code == "timeout"
                if e.code == "truncated" and peer not in reset:   # a cut stream: once more, same holder
                    reset.add(peer)
                    self.on_event("retried_same")
                else:
                    if e.code not in ("downstream", "timeout"):   # the holder itself failed us
                        self.ranking.record_failure(peer, str(e))
                        self.bans.ban(peer, f"pipeline block {block}: {e}")
                        self._forget(block, peer)
                    tried.add(peer)
            except HopTimeoutError as e:
                drop_tracebacks(e)
                last = f"{peer[-8:]}: {e}"[:300]
                out_of_time = allowed >= remaining   # a probe's shorter limit is not a want of the micro-batch's time
                self.on_event("failed_calls")
                self.ranking.record_failure(peer, "no answer in time")
                # the blame may be shared (a stage further down, a DHT read that ate the time, a machine
                # that is merely slow): set aside for the shorter collateral ban, and only where another
                # holder can take its place; banning a block's only holder turns slowness into losses
                if len(cands) > 1:
                    self.bans.strike([peer], f"pipeline block {block}: {e}", attributable=False)
                    self._forget(block, peer)
                tried.add(peer)
            else:
                self.ranking.record_success(peer, time.monotonic() - t0)
                self.bans.forgive([peer])
                self._recent.setdefault(block, {})[peer] = time.monotonic()
                return resp
            failures += 1
            if failures > self.retries:   # the reason says whether more time might have helped
                raise DownstreamFailed("timeout" if out_of_time else "failed",
                                       f"block {block}: {failures} holder(s) failed ({last})")
            self.on_event("retried")
