"""``bt-node bench pipeline --lr-sweep``: each arm's learning rate chosen on a validation part carved from
the training bytes (protocol v2), then the bench itself at the chosen rates.

For every rate of the grid (default {1e-3, 2e-3, 4e-3}) the whole bench runs once, with the same
objectives, layout, wall time, references and seed, on the training bytes WITHOUT their last books
(``blocks/data.py`` ``carve_validation``: whole books, as the test split holds out whole books), and
every arm is scored on windows of those last books. Each arm (every objective's network, the
whole-size reference and the one-block reference) takes the rate with its lowest validation CE; then
the bench runs on the full training bytes with those rates and is scored on the held-out test
windows, which the choice never saw. Serving and the curve are skipped in the sweep's runs.

The one-block reference is one process scored twice (at one worker's CPU budget and after the same
wall time): it is chosen by its headline reading (after the wall time; at the CPU budget with
``--no-wall-reference``), and both readings share its rate. An arm given ``--lr ARM=RATE`` keeps that
rate and is not swept. The schedule is ``--lr-schedule``'s for every run of the sweep and the final
one (default: warm-up then constant, as a volunteer node trains; ``cosine``: every arm decays over its
own budget); the sweep chooses the peak rate for this wall time.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable

from blocktrain.bench.pipeline import PipelineBenchSettings, run_bench_pipeline
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import carve_validation
from blocktrain.blocks.default_data import resolve_default
from blocktrain.node.swarm.run import typed_settings

GRID = (1e-3, 2e-3, 4e-3)     # protocol v2's grid


def arm_ce(res: dict, arm: str) -> float:
    """An arm's headline CE in one bench result: an objective's chain, or a reference."""
    if arm in res["runs"]:
        return res["runs"][arm]["chain_ce"]
    refs = res["references"]
    if arm == "one_block":
        return (refs.get("one_block") or refs["one_block_cpu"])["ce"]
    return refs[arm]["ce"]


def choose(table: dict[float, dict[str, float]]) -> dict[str, float]:
    """Per arm, the rate with the lowest validation CE (ties: the smaller rate)."""
    arms = list(next(iter(table.values())))
    return {a: min(table, key=lambda lr: (table[lr][a], lr)) for a in arms}


def run_lr_sweep(s: PipelineBenchSettings, *, grid: tuple[float, ...] = GRID, fraction: float = 0.025,
                 windows: int = 512, workdir: str | None = None,
                 on_progress: Callable[[str], None] | None = None) -> dict:
    """The sweep, then the bench at the chosen rates; the final result carries ``lr_sweep``."""
    say = on_progress or (lambda _msg: None)
    if len(set(grid)) < 2 or not all(lr > 0 for lr in grid):
        raise ValueError(f"an lr grid needs at least two distinct positive rates, got {list(grid)}")
    cfg = ModelConfig.from_dict(typed_settings(list(s.overrides)), source="bench pipeline config")
    s.validate(cfg)
    fixed = dict(s.lrs)
    free = [a for a in s.arms() if a not in fixed]
    if not free:
        raise ValueError("--lr fixes every arm's rate: nothing to sweep")
    scratch = Path(tempfile.mkdtemp(prefix="bt-lr-sweep-"))
    try:
        split, _ = resolve_default(s.data, cfg.seq_len, scratch)
        _, validation = carve_validation(split, fraction)
        data = scratch / "data"          # the sweep's corpus: train = the head, test = the carved books
        data.mkdir()
        (data / "train.txt").write_bytes(validation.train.tobytes())
        (data / "test.txt").write_bytes(validation.eval.tobytes())
        table: dict[float, dict[str, float]] = {}
        for lr in grid:
            say(f"lr sweep: {lr:g} for {', '.join(free)}; validation {validation.eval_name}")
            run = replace(s, data=str(data), lrs={**{a: lr for a in free}, **fixed}, serving=False, curve_every=0.0,
                          eval_windows=windows, train_windows=0)
            res = run_bench_pipeline(run, workdir=str(scratch / f"lr-{lr:g}"), on_progress=say)
            table[lr] = {a: arm_ce(res, a) for a in free}
            shutil.rmtree(scratch / f"lr-{lr:g}", ignore_errors=True)
            say("lr sweep: " + ", ".join(f"{a} {ce:.4f}" for a, ce in table[lr].items()) + f" at {lr:g}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    chosen = choose(table)
    say("lr sweep chose: " + ", ".join(f"{a} {lr:g}" for a, lr in chosen.items()))
    final = run_bench_pipeline(replace(s, lrs={**fixed, **chosen}), workdir=workdir, on_progress=say)
    final["lr_sweep"] = {
        "grid": list(grid), "validation": validation.protocol, "validation_bytes": int(len(validation.eval)),
        "trained_on_bytes": int(len(validation.train)), "validation_windows": windows,
        "validation_ce": {f"{lr:g}": table[lr] for lr in grid}, "chosen": chosen, "fixed": fixed,
        "method": ("each rate: the whole bench (same settings, serving and curve off) trained on the training bytes "
                   "without the carved books and scored on windows of those books; per arm the rate with the "
                   "lowest CE; then this run on the full training bytes, scored on the test windows"),
    }
    return final
