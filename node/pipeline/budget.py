"""A block-0 holder's time budget per micro-batch: adaptive, as TCP's retransmission timeout is.

A fixed budget fails slow chains for good. At d_model 768 with five workers on two cores a
micro-batch's round trip (forwards queued behind the others in flight at every stage, the
backwards, the hand-offs) passed the 60 s default most of the time: 3 of 16 and 0 of 19
micro-batches completed in 360 s (BENCHMARKS.md, "Memory of an averaging round"); a chain always
slower than the budget trains no block at all ("A chain slower than its micro-batch timeout").
So the budget is estimated the way RFC 6298 estimates a retransmission timeout, with the configured
``--pipeline-timeout`` as its floor and ``--pipeline-timeout-max`` as its ceiling:

* each completed micro-batch's round trip R (block 0's call to block 1 sent to its answer back)
  updates a smoothed mean and mean deviation (the first: SRTT = R, RTTVAR = R / 2; then
  RTTVAR <- 3/4 RTTVAR + 1/4 |SRTT - R|, SRTT <- 7/8 SRTT + 1/8 R), and the budget becomes
  max(SRTT + 4 RTTVAR, 2 SRTT), clamped to [floor, ceiling]. The second term is ours (TCP's is a
  1 s minimum): every stage keeps a margin of the deadline it passes on (its backward, the answer's
  trip), so a chain needs more than its measured round trip, and a steady chain's RTTVAR decays to
  nothing: with SRTT + 4 RTTVAR alone a 3-stage chain with a steady 1.22 s round trip lost 20 of 51
  micro-batches (each lost one doubling the budget, which then decayed back);
* a micro-batch lost for want of time doubles the budget (clamped), once per budget: micro-batches
  in flight together that time out together double it once, not once each (Karn's back-off).

Round trips of micro-batches that were retried on another holder are measured too (longer, so the
estimate errs towards waiting). A stalled holder therefore costs at most the current budget per
micro-batch it holds (and is set aside for a while where its block has another holder:
``node/routing/pipeline_route.py``); a chain that is merely slow is waited for. ``floor ==
ceiling`` gives the old fixed budget.
"""
from __future__ import annotations

import threading

K_VAR = 4.0          # RFC 6298's K
MIN_FACTOR = 2.0     # and never under twice the smoothed round trip (below)
ALPHA, BETA = 1 / 8, 1 / 4


class MicrobatchBudget:
    def __init__(self, floor_s: float, ceiling_s: float):
        if not 0 < floor_s <= ceiling_s:
            raise ValueError(f"a micro-batch budget needs 0 < floor <= ceiling, got {floor_s} and {ceiling_s}")
        self.floor_s, self.ceiling_s = float(floor_s), float(ceiling_s)
        self._lock = threading.Lock()
        self._budget = self.floor_s
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.samples = self.backoffs = 0

    def _clamp(self, s: float) -> float:
        return min(self.ceiling_s, max(self.floor_s, s))

    def current(self) -> float:
        """The budget to give the next micro-batch, in seconds."""
        with self._lock:
            return self._budget

    def completed(self, round_trip_s: float) -> None:
        """A micro-batch came back after ``round_trip_s``: one more sample."""
        r = max(0.0, float(round_trip_s))
        with self._lock:
            if self.srtt is None:
                self.srtt, self.rttvar = r, r / 2
            else:
                self.rttvar = (1 - BETA) * self.rttvar + BETA * abs(self.srtt - r)
                self.srtt = (1 - ALPHA) * self.srtt + ALPHA * r
            self.samples += 1
            self._budget = self._clamp(max(self.srtt + K_VAR * self.rttvar, MIN_FACTOR * self.srtt))

    def timed_out(self, budget_used_s: float) -> None:
        """A micro-batch given ``budget_used_s`` ran out of time: double the budget, unless another
        micro-batch of the same budget already did."""
        with self._lock:
            if budget_used_s >= self._budget and self._budget < self.ceiling_s:
                self._budget = self._clamp(self._budget * 2)
                self.backoffs += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"budget_s": round(self._budget, 3), "floor_s": self.floor_s, "ceiling_s": self.ceiling_s,
                    "srtt_s": None if self.srtt is None else round(self.srtt, 3),
                    "rttvar_s": round(self.rttvar, 3), "samples": self.samples, "backoffs": self.backoffs}
