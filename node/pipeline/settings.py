"""The pipeline engine's settings (per worker), validated; no heavy imports (the CLI checks flags here)."""
from __future__ import annotations

from dataclasses import dataclass

CODECS = ("fp32", "fp16", "8bit")   # the same names as p2p.pipeline_wire.CODECS (checked by the tests)


@dataclass(frozen=True)
class PipelineSettings:
    inflight: int = 1            # micro-batches a block-0 holder keeps in flight (1: none stale; BENCHMARKS.md)
    accumulate: int = 1          # micro-batches per optimizer step
    codec: str = "fp32"          # what this worker sends: fp32 | fp16 | 8bit (answers use the caller's)
    timeout_s: float = 60.0      # one micro-batch's budget, from block 0 and back: the start and floor of
    timeout_max_s: float = 600.0  # an adaptive budget (node/pipeline/budget.py) that never exceeds this
    max_stash: int = 16          # micro-batches a stage holds between forward and backward (then: busy)
    retries: int = 2             # other holders of the next block tried after a failure
    weight_stash: bool = False   # a backward after a weight change uses the weights its forward used (PipeDream)
    flush: bool = False          # block 0: windows of `inflight` micro-batches, each finished before the next
                                 # (GPipe; with accumulate == inflight on every holder: no stale weights)
    recompute: bool = False      # keep only a held micro-batch's input, not its graph; its backward runs the
                                 # forward again first (GPipe's re-materialisation: memory of one graph, not K)
    layer_checkpoint: bool = False   # every forward with a graph keeps each layer's input only; the backward runs
                                     # the layer again (activation checkpointing: one layer's graph, not a block's)
    loss_screen: float = 0.0     # a stage computing a loss refuses micro-batches whose loss is this many nats/byte
                                 # above the median of those it trained on (node/pipeline/screen.py); 0: off
    check_rate: float = 0.0      # backprop, blocks before the last: the share of answers recomputed from the route's
                                 # downloaded states before their backward, besides each holder's first (verify.py); 0: off

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"pipeline compression must be one of {', '.join(CODECS)}, got {self.codec!r}")
        for name in ("inflight", "accumulate", "max_stash"):
            if not 1 <= getattr(self, name) <= 4096:
                raise ValueError(f"pipeline {name} must be in [1, 4096], got {getattr(self, name)}")
        if not 1.0 <= self.timeout_s <= 600.0:
            raise ValueError(f"pipeline timeout must be in [1, 600] seconds, got {self.timeout_s}")
        if not self.timeout_s <= self.timeout_max_s <= 600.0:
            raise ValueError(f"pipeline timeout max must be in [timeout ({self.timeout_s:g}), 600] seconds, "
                             f"got {self.timeout_max_s}")
        if not 0.0 <= self.loss_screen <= 100.0:
            raise ValueError(f"pipeline loss screen must be in [0, 100] nats/byte (0: off), got {self.loss_screen}")
        if not 0.0 <= self.check_rate <= 1.0:
            raise ValueError(f"pipeline check rate must be in [0, 1] (0: off), got {self.check_rate}")
        if not 0 <= self.retries <= 16:
            raise ValueError(f"pipeline retries must be in [0, 16], got {self.retries}")
