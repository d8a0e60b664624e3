"""Presets of ``bt-node bench quality`` (protocol v2): a config, a budget and the arms, named.

* ``tiny``: the whole protocol (LR sweep, arms, seeds, paired intervals) in seconds on a CPU, for
  tests. Same code path as the others, smaller numbers.
* ``cpu``: the runs recorded in BENCHMARKS.md ("Protocol v2"): d_model 64, 4 blocks x 1 layer,
  seq_len 128, batch 16, 1e13 measured FLOPs per arm (each arm about 4 CPU-minutes on one core).
* ``h200``: sized for at most 8 minutes on one H200 in bf16 (autocast on CUDA). The arithmetic, with
  FLOPs measured by ``--plan`` (FlopCounterMode, batch 1 scaled to 64): per arm 7e15 FLOPs; 5 arms
  (``paper``, ``forward-chained``, ``forward-streamed``, ``one-block``, ``whole``) plus the LR sweep
  (5 arms x 3 rates x 1/8 of the budget = 1.875 budgets) = 6.875 x 7e15 = 4.8e16 FLOPs. At 790 bf16
  TFLOP/s and an assumed MFU of 15 % (small d_model-512 matmuls, eager PyTorch, per-step syncs)
  that is 4.8e16 / 1.185e14 = 406 s of training, plus about a minute for start-up, FLOP counting
  and scoring 1,024 held-out windows per arm: 7-8 minutes. Epochs: the one-block reference reads
  the most, 7e15 / (measured FLOPs per step) x 64 x 512 bytes: ``--plan`` prints it (under 5 of the
  full gutenberg train split). One seed only: ``--seeds 0,1,2`` triples the main runs. ``pipeline``
  is left out (it trains the same model as ``whole``; adding it would pass the 8 minutes).
  ``tiny`` runs the same arms (and ``pipeline``) through the same code on a CPU.

A preset sets defaults; options given on the command line win.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    overrides: dict = field(default_factory=dict)
    budget: str = "120s"
    arms: tuple[str, ...] = ()
    seeds: tuple[int, ...] = (0,)
    eval_windows: int = 1024
    train_windows: int = 1024
    lr_sweep: bool = False
    sweep_fraction: float = 0.25
    k: int = 4
    needs_cuda: bool = False
    #: planning throughput (FLOP/s) for --plan's time estimate; None: no estimate
    assume_flops_per_s: float | None = None
    note: str = ""


H200_PEAK_BF16 = 790e12
H200_ASSUMED_MFU = 0.15

PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        overrides=dict(d_model=32, n_heads=2, layers_per_block=1, n_blocks=2, seq_len=32, target_dim=16,
                       batch_size=4, chunk_len=4, warmup_steps=2),
        budget="8steps", arms=("paper", "forward-chained", "forward-streamed", "pipeline", "one-block", "whole",
                                "one-block@streamed"),
        seeds=(0, 1), eval_windows=48, train_windows=16, lr_sweep=True, sweep_fraction=0.5, k=2,
        note="test-sized: every step of protocol v2 on a CPU in seconds"),
    "cpu": Preset(
        overrides=dict(d_model=64, n_heads=2, layers_per_block=1, n_blocks=4, seq_len=128, batch_size=16,
                       chunk_len=4),
        budget="1e13flops", arms=("paper", "forward-chained", "one-block", "whole"), seeds=(0, 1, 2), lr_sweep=True,
        note="BENCHMARKS.md protocol v2: one core, about 4 CPU-minutes per arm"),
    "h200": Preset(
        overrides=dict(d_model=512, n_heads=8, layers_per_block=2, n_blocks=4, seq_len=512, batch_size=64,
                       target_dim=64, chunk_len=16),
        budget="7e15flops", arms=("paper", "forward-chained", "forward-streamed", "one-block", "whole"), seeds=(0,),
        train_windows=256, lr_sweep=True, sweep_fraction=0.125, needs_cuda=True,
        assume_flops_per_s=H200_PEAK_BF16 * H200_ASSUMED_MFU,
        note="one H200, bf16 autocast, <= 8 minutes (arithmetic in bench/quality_presets.py)"),
}
