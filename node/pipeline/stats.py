"""What one worker's pipeline engine did: micro-batch counts, losses, stalled time, memory.

``Activity`` measures *stalled time*: wall time during which this worker had at least one
micro-batch in flight (a block-0 holder's own, or a stage call it is serving) and was computing
none, i.e. every one of them was waiting on the network (or on the compute queue being empty
because answers had not come back). Bytes are counted on the wire side (``p2p.pipeline_rpc``).
"""
from __future__ import annotations

import resource
import threading
import time
from collections import Counter

import torch


class Activity:
    def __init__(self):
        self._lock = threading.Lock()
        self.inflight = self.computing = 0
        self.stalled_s = self.compute_s = 0.0
        self._since = time.monotonic()

    def change(self, *, inflight: int = 0, computing: int = 0) -> None:
        with self._lock:
            now = time.monotonic()
            if self.computing:
                self.compute_s += now - self._since
            elif self.inflight:
                self.stalled_s += now - self._since
            self._since = now
            self.inflight += inflight
            self.computing += computing

    def snapshot(self) -> dict:
        self.change()   # bring the sums up to now
        with self._lock:
            return {"stalled_s": round(self.stalled_s, 3), "compute_s": round(self.compute_s, 3),
                    "inflight_now": self.inflight}


class PipelineStats:
    """Counters (thread-safe). As a block-0 holder: ``started`` micro-batches, ``completed`` (the
    gradient came back, or streamed: the chain answered), ``lost`` (dropped, by reason). As a stage:
    ``received`` calls served, ``refused_busy``, ``refused_not_upstream`` (a caller not announced as a holder
    of the block before: node/pipeline/admission.py), ``refused_outlier`` (a micro-batch whose loss this stage's
    screen refused: node/pipeline/screen.py; answered ``outlier``, not trained on), ``gradient_checks`` of the next
    block's answers (node/pipeline/verify.py; ``_failed``: the holder banned, ``_inconclusive``: could not be made;
    either drops the micro-batch), ``failed_downstream``, ``expired_in_queue`` (a call
    whose deadline passed while its forward waited for the compute thread: answered ``timeout``, not
    run). Both: ``sent`` onward calls that were answered, ``failed_calls`` (a holder failed or timed
    out), ``retried`` (another holder was asked after a failure; ``retried_same``: the same holder,
    once, after its answer stream was cut), ``routed_unannounced`` (a holder picked from those that
    answered recently, absent from the DHT read), ``busy`` answers met, ``recomputed`` backwards (the weights had
    changed since the forward; ``recomputed_stashed``: of those, on the stashed weights the forward used),
    ``resent_recomputed`` (a recomputing stage, which gives its output to the wire, ran its forward
    again for a retry),
    ``steps`` optimizer steps taken (``window_steps_deferred``: window changes at which a flushed stage
    kept accumulating because a graph still awaited its backward; ``window_steps_forced``: steps taken
    at a window change anyway, after ``MAX_DEFERRED`` such waits); ``peak_weight_stash_bytes``: the most bytes of weight copies alive
    at once (weight stashing). ``times_s``: where a micro-batch's wall time went at this worker, summed
    (``call``: onward calls, request sent to answer decoded; ``serve``: calls served, request decoded to
    answer ready; ``forward`` / ``backward``: compute; ``compute_queue``: waiting for the compute thread).
    A hand-off's cost is the caller's ``call`` less the callee's ``serve`` for the same calls."""

    KEYS = ("started", "completed", "received", "answered", "refused_busy", "failed_downstream", "sent",
            "failed_calls", "retried", "retried_same", "busy", "recomputed", "recomputed_stashed",
            "resent_recomputed", "routed_unannounced", "steps", "microbatches_accumulated",
            "window_steps_deferred", "window_steps_forced", "expired_in_queue", "refused_not_upstream",
            "refused_outlier", "gradient_checks", "gradient_checks_failed", "gradient_checks_inconclusive")

    def __init__(self):
        self._lock = threading.Lock()
        self.c = Counter({k: 0 for k in self.KEYS})
        self.lost: Counter = Counter()
        self.driver_wait_s = 0.0
        self.peak_held = 0
        self.peak_weight_stash_bytes = 0
        self.times: Counter = Counter()
        self.activity = Activity()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.c[key] += n

    def timed(self, key: str, seconds: float) -> None:
        with self._lock:
            self.times[key] += seconds

    def lose(self, reason: str) -> None:
        with self._lock:
            self.lost[reason] += 1

    def held(self, n: int) -> None:
        with self._lock:
            self.peak_held = max(self.peak_held, n)

    def stashed(self, nbytes: int) -> None:
        with self._lock:
            self.peak_weight_stash_bytes = max(self.peak_weight_stash_bytes, nbytes)

    def waited(self, seconds: float) -> None:
        with self._lock:
            self.driver_wait_s += seconds

    def snapshot(self) -> dict:
        with self._lock:
            out = {k: int(self.c[k]) for k in self.KEYS}
            out.update(lost=int(sum(self.lost.values())), lost_by_reason=dict(self.lost),
                       driver_wait_s=round(self.driver_wait_s, 3), peak_held=self.peak_held,
                       peak_weight_stash_bytes=self.peak_weight_stash_bytes,
                       times_s={k: round(v, 3) for k, v in self.times.items()})
        out.update(self.activity.snapshot())
        out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        return out
