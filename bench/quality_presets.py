"""Presets of ``bt-node bench quality`` (protocol v2): a config, a budget and the arms, named.

* ``tiny``: the whole protocol (LR sweep, arms, seeds, paired intervals) in seconds on a CPU, for
  tests. Same code path as the others, smaller numbers.
* ``cpu``: the runs recorded in BENCHMARKS.md ("Protocol v2"): d_model 64, 4 blocks x 1 layer,
  seq_len 128, batch 16, 1e13 measured FLOPs per arm (each arm about 4 CPU-minutes on one core).
* ``h200``: sized for at most 8 minutes on one H200 in bf16 (autocast on CUDA), 5 arms (``paper``,
  ``forward-chained``, ``forward-streamed``, ``one-block``, ``whole``) plus the LR sweep (5 arms x 3
  rates x 1/8 of the budget). Its size comes from the one run on a lent H200 (2026-12-04, BENCHMARKS.md
  "GPU: one H200"): at 7e15 measured FLOPs per arm that run needed more than 8 minutes (stopped at 500
  s, one step before its summary), because ``paper`` ran at 53.5 TFLOP/s where the other arms ran at
  138-199 (the 15 % MFU planned before held for them, not for paper) and its scoring took 50 s. At
  those measured rates and scoring times (:data:`H200_MEASURED`) 5e15 FLOPs per arm is planned at
  about 6.3 minutes; ``--plan`` prints the prediction (:func:`predict_seconds`). Not rerun at 5e15.
  Epochs: the one-block reference reads the most (``--plan``; under 5 of the gutenberg train split).
  One seed only: ``--seeds 0,1,2`` triples the main runs. ``pipeline`` is left out (it trains the same
  model as ``whole``). ``tiny`` runs the same arms (and ``pipeline``) through the same code on a CPU.

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
    #: measured rates and times for --plan's time estimate (:func:`predict_seconds`); None: no estimate
    timing: "PresetTiming | None" = None
    note: str = ""


@dataclass(frozen=True)
class PresetTiming:
    """What one run of a preset measured on its machine: training FLOP/s and scoring seconds per arm
    kind, the LR sweep's scoring in all, and the rest (start-up, FLOP counting, data)."""
    flops_per_s: dict
    score_s: dict
    sweep_score_s: float
    other_s: float
    source: str


#: `bench quality --preset h200` at 7e15 FLOPs per arm on one H200, 2026-12-04 (BENCHMARKS.md "GPU: one
#: H200"): each arm's measured FLOPs / its training wall time; its held-out scoring (1,024 windows); the
#: sweep's 15 scorings together (9.4 s); other: the bench's 500 s less training (412 s) and scoring (70 s)
H200_MEASURED = PresetTiming(
    flops_per_s={"paper": 53.5e12, "forward-chained": 180.9e12, "forward-streamed": 176.1e12,
                 "one-block": 138.4e12, "whole": 199.3e12},
    score_s={"paper": 49.6, "forward-chained": 5.1, "forward-streamed": 5.5, "one-block": 0.06, "whole": 0.16},
    sweep_score_s=9.4, other_s=18.0, source="one H200, bf16, 2026-12-04 (BENCHMARKS.md 'GPU: one H200')")


def predict_seconds(timing: PresetTiming, plan: dict, *, sweep_fraction: float, n_rates: int,
                    swept: bool) -> dict:
    """Wall time of a planned study (``Study.plan``'s result) at ``timing``'s rates: each arm's FLOPs
    (and its sweep share) at its own rate, plus the scorings and the rest. An arm the timing never
    measured is charged at the slowest measured rate and scoring."""
    slow_rate, slow_score = min(timing.flops_per_s.values()), max(timing.score_s.values())
    train = sweep = score = 0.0
    for row in plan["arms"]:
        kind = row["arm"].split("@")[0]
        rate = timing.flops_per_s.get(kind, slow_rate)
        train += row["flops"] * len(plan["seeds"]) / rate
        score += timing.score_s.get(kind, slow_score) * len(plan["seeds"])
        if swept and "@" not in row["arm"]:
            sweep += row["flops"] * sweep_fraction * n_rates / rate
    total = train + sweep + score + (timing.sweep_score_s if swept else 0.0) + timing.other_s
    return {"train_s": round(train, 1), "sweep_s": round(sweep, 1), "score_s": round(score, 1),
            "total_s": round(total, 1), "timing_source": timing.source}

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
        budget="5e15flops", arms=("paper", "forward-chained", "forward-streamed", "one-block", "whole"), seeds=(0,),
        train_windows=256, lr_sweep=True, sweep_fraction=0.125, needs_cuda=True, timing=H200_MEASURED,
        note="one H200, bf16 autocast, <= 8 minutes (arithmetic in bench/quality_presets.py)"),
}
