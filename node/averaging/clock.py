"""--average-clock: when the replicas of a block look for an averaging group by the wall clock.

Step-triggered rounds (every ``--average-every`` local steps) bring replicas together only when their
steps line up; replicas that step minutes apart (a slow ``pipeline`` chain) may never meet that way.
So every holder of a block also starts a round once in each period of the wall clock (UTC), at an
instant all of that block's holders share; the blocks' instants are spread evenly over the period, so
a run's holders do not all start matchmaking on the DHT in the same second."""
from __future__ import annotations

import math
import time
from typing import Callable


def next_clock_slot(now: float, period: float, offset: float = 0.0) -> float:
    """The first instant after ``now`` that is ``offset`` past a multiple of ``period`` seconds of the wall
    clock (an --average-clock instant)."""
    return (math.floor((now - offset) / period) + 1) * period + offset


def clock_offset(period: float, block: int, n_blocks: int) -> float:
    """Where in each --average-clock period the holders of ``block`` look for a group: the same instant for
    every replica of a block, the blocks spread evenly over the period."""
    return period * block / n_blocks


class AverageClock:
    """The --average-clock instants of the block a node holds now. :meth:`due` is true once at each of
    them. The block is read on every call (``block``): after a rebalancing move the next instant is at
    once the new block's, so the node's first clocked round there meets the new block's holders rather
    than looking for partners at the old block's instant. ``period <= 0``: never due."""

    def __init__(self, period: float, n_blocks: int, block: Callable[[], int],
                 now: Callable[[], float] = time.time):
        self.period, self.n_blocks, self._block, self._now = period, n_blocks, block, now
        self.for_block = block()
        self.slot = self._next(self.for_block)

    def _next(self, block: int) -> float:
        if self.period <= 0:
            return math.inf
        return next_clock_slot(self._now(), self.period, clock_offset(self.period, block, self.n_blocks))

    def due(self) -> bool:
        block = self._block()
        if block != self.for_block:          # moved: this block's instants from now on
            self.for_block, self.slot = block, self._next(block)
            return False
        if self._now() < self.slot:
            return False
        self.slot = self._next(block)        # strictly after now: an instant is never taken twice
        return True
