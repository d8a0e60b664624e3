"""Loss screening: a stage does not train on a micro-batch whose loss is far above what it has been training on.

The upstream gate (admission.py) lets only announced holders of the block before send a stage training traffic,
but announcing is open to anyone: a Sybil that announces itself as a holder of block b-1 is served. Where the
loss is computed (the last block in ``pipeline`` runs; every block in ``forward-streamed`` runs, each on its own
head) the targets are the sender's, so such a Sybil could send targets that are all ``x`` and make the chain
learn to answer ``x`` to everything (docs/records/s36/sybil_poison_probe.py). Poisoned targets are, by design,
text the model has not been learning: their loss is far above the losses of the honest micro-batches it trains
on. So a computing stage (opt-in, ``--pipeline-loss-screen``: off by default, RELIABILITY.md says why) keeps
the losses of the last ``window`` micro-batches it trained on, and refuses (the typed ``outlier`` answer: no
backward, no gradient to any block of the chain) one whose loss exceeds their median by more than ``margin``
nats/byte, or by more than ``spread`` robust standard deviations (1.4826 x the median absolute deviation) where
the honest losses spread wider than that. Only losses of micro-batches it
trained on enter the window, so refused poison never moves the threshold.

The senders' weights move too, and not always a little: a holder of block b-1 that restarted from an old checkpoint
or started fresh (no state to download), or one a Sybil of a later block wrecked with gradients (RELIABILITY.md gap
13), sends activations on which every loss is far above the window; refusing them for good would leave that block
never trained through the chain again. So once the stage has refused everything it was sent for ``valve_s``
seconds (``valve_n`` micro-batches at least), and trained on none, the window is emptied and warms up again on
what comes (counted ``resets``): while any sender's micro-batches pass, none of this happens.

Weights written from outside training (an accepted averaging round, a loaded state) can move every honest loss at
once; were that move larger than the margin, the stage would refuse all it is sent from then on, and its window,
fed only by what it trains on, would never follow. So the screen keeps the inputs of the last micro-batch it
trained on (one micro-batch: the engine's ``reference``), and after such a write the engine scores it again and
the whole window moves by the change in its loss (:meth:`LossScreen.rebase`).

Limits (RELIABILITY.md "Training traffic"): the first ``warmup`` micro-batches a stage trains on are not screened
(nothing to compare with: a Sybil present from a run's first step is not stopped, nor one that is the only sender
for ``valve_s``); poison whose loss stays within the margin (targets close to the text's own statistics) is
trained on, each such micro-batch moving the weights as much as an honest one does. Micro-batches of a block-0
holder's own data (a 1-block run) are never screened.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque

__all__ = ["LossScreen"]

log = logging.getLogger(__name__)

ROBUST_SD = 1.4826   # the median absolute deviation of a normal distribution, in standard deviations


class LossScreen:
    """``reason = screen.refuses(loss)`` (None: train on it, then ``screen.trained(loss)``). ``margin <= 0``: off."""

    def __init__(self, margin: float = 1.0, *, window: int = 128, warmup: int = 32, spread: float = 6.0,
                 valve_s: float = 60.0, valve_n: int = 16, clock=time.monotonic):
        if warmup > window:
            raise ValueError("the warm-up cannot be longer than the window it fills")
        self.margin, self.warmup, self.spread = margin, warmup, spread
        self.valve_s, self.valve_n, self._clock = valve_s, valve_n, clock
        self._trained_at = clock()     # when it last trained on a micro-batch (or was made)
        self._refused_since = 0        # micro-batches refused since then
        self.resets = 0
        self._losses: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.refused = 0
        self.rebased = 0
        self.reference: tuple[object, object, float] | None = None   # (inputs, targets, loss) last trained on

    @property
    def on(self) -> bool:
        return self.margin > 0

    def threshold(self) -> float | None:
        """The highest loss trained on now; None while warming up (or off)."""
        with self._lock:
            if not self.on or len(self._losses) < self.warmup:
                return None
            xs = list(self._losses)
        med = statistics.median(xs)
        mad = statistics.median(abs(x - med) for x in xs)
        return med + max(self.margin, self.spread * ROBUST_SD * mad)

    def refuses(self, loss: float) -> str | None:
        limit = self.threshold()
        if limit is None or loss <= limit:
            return None
        with self._lock:
            if self._refused_since >= self.valve_n and self._clock() - self._trained_at >= self.valve_s:
                self._losses.clear()   # everything refused for valve_s: the senders moved, not only attackers
                self._refused_since = 0
                self.resets += 1
                log.warning("loss screen: every micro-batch refused for %.0f s (%d and more); warming up again on what "
                            "comes (the senders' weights moved)", self.valve_s, self.valve_n)
                return None
            self.refused += 1
            self._refused_since += 1
        return (f"its loss {loss:.3f} nats/byte is above this stage's screen {limit:.3f} (the median of the "
                f"last {len(self._losses)} losses it trained on plus its margin): not trained on")

    def trained(self, loss: float, inputs=None, targets=None) -> None:
        with self._lock:
            self._losses.append(float(loss))
            self._trained_at, self._refused_since = self._clock(), 0
            if inputs is not None:
                self.reference = (inputs, targets, float(loss))

    def rebase(self, loss_now: float) -> float:
        """The reference micro-batch's loss under the weights as they are now (after a write from outside
        training): move every loss of the window by its change; returns that change."""
        with self._lock:
            if self.reference is None or not self._losses:
                return 0.0
            inputs, targets, then = self.reference
            shift = float(loss_now) - then
            self._losses = deque((x + shift for x in self._losses), maxlen=self._losses.maxlen)
            self.reference = (inputs, targets, float(loss_now))
            self.rebased += 1
            return shift
