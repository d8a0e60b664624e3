"""bench quality, protocol v2 (issue 13): arms trained one at a time to equal measured FLOPs, each at
its own learning rate chosen on a validation split carved from train, scored window by window on
the same held-out windows, over several seeds.

An *arm* is one thing trained: a block-local objective's chain (``paper``, ``forward-chained``, ...:
all B blocks, one step each per round, live upstream blocks), or an autoregressive reference:
``one-block`` (one block's depth: what one volunteer trains alone) or ``whole`` (the chain's whole
depth trained end to end in one process: the backprop ceiling). ``one-block@streamed`` is the
one-block reference given the FLOPs the first upstream-reading chain arm (``forward-chained``) runs
less its upstream forwards: what a ``forward-streamed`` network runs, since its workers receive
those activations instead of recomputing them.

Budgets: ``Xflops`` per arm (measured FLOPs, ``blocks.flops``); ``Nsteps``: the first arm takes N
rounds and every other arm the FLOPs that cost; a wall time per arm (``300s``). Every arm decays its
learning rate (warm-up, cosine) to the end of its own budget. Seed s sets both the initialisation
and the data order of every arm.

With ``out`` every result is written to a study folder as soon as it exists (``study.json``,
``lr_sweep/``, ``runs/``) and a rerun reuses what is there: a study can be resumed or extended with
more seeds or arms, never silently mixed with other settings.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from blocktrain.blocks.atomic import atomic_write, write_bytes
from blocktrain.blocks.budget import Budget
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import DataSplit, carve_validation
from blocktrain.blocks.local_run import LocalRun
from blocktrain.blocks.objectives import OBJECTIVES, get_objective
from blocktrain.blocks.windows import eval_windows

REFERENCES = {"one-block": "reference_1block", "whole": "reference"}
STREAMED = "@streamed"
LR_GRID = (1e-3, 2e-3, 4e-3)
#: nats/byte: a sweep whose best rate beat the runner-up by less than this chose within one-seed noise
#: (seed-to-seed spread about 0.016 in BENCHMARKS.md's runs; on the H200, 2026-12-04, four of five arms'
#: 1/8-budget sweeps were that close, still on the early plateau)
SWEEP_MIN_MARGIN = 0.02
MAX_EPOCHS = 5.0


class StudyError(ValueError):
    """Arms, budget or study folder that cannot be used; the message says which and why."""


def sweep_margins(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per swept arm: how much better its chosen rate scored on validation than the next best rate (inf
    with one rate). Under :data:`SWEEP_MIN_MARGIN` the sweep could not tell the rates apart."""
    out = {}
    for key, sc in scores.items():
        ranked = sorted(sc.values())
        out[key] = round(ranked[1] - ranked[0], 6) if len(ranked) > 1 else float("inf")
    return out


def arm_kind(arm: str) -> str:
    return arm[: -len(STREAMED)] if arm.endswith(STREAMED) else arm


def check_arms(arms: list[str], budget: Budget) -> None:
    if not arms:
        raise StudyError("no arms to train")
    if len(set(arms)) != len(arms):
        raise StudyError(f"an arm is named twice: {', '.join(arms)}")
    known = sorted(OBJECTIVES) + sorted(REFERENCES) + [f"one-block{STREAMED}"]
    for arm in arms:
        if arm not in known:
            raise StudyError(f"unknown arm {arm!r}; known: {', '.join(known)}")
    if any(a.endswith(STREAMED) for a in arms) and budget.seconds is not None:
        raise StudyError(f"one-block{STREAMED} is matched in FLOPs: give a FLOP or step budget, not a wall time")


@dataclass(frozen=True)
class Settings:
    cfg: ModelConfig
    budget: Budget
    eval_windows: int = 1024
    train_windows: int = 1024
    k: int = 4
    schedule: str = "cosine"
    val_fraction: float = 0.025
    sweep_fraction: float = 0.25
    lr_grid: tuple[float, ...] = LR_GRID

    def key(self, split: DataSplit) -> dict:
        """What must match for results to be pooled in one study."""
        cfg = self.cfg.to_dict()
        for volatile in ("lr", "init_seed", "objective"):
            cfg.pop(volatile)
        return {"config": cfg, "budget": str(self.budget), "eval_windows": self.eval_windows,
                "train_windows": self.train_windows, "k": self.k, "schedule": self.schedule,
                "val_fraction": self.val_fraction, "sweep_fraction": self.sweep_fraction,
                "lr_grid": list(self.lr_grid), "protocol": split.protocol, "data": split.description}


def windows_digest(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.cpu().numpy().tobytes()).hexdigest()[:16]


class Study:
    def __init__(self, settings: Settings, split: DataSplit, device: torch.device, *, out: Path | None = None,
                 log: Callable[[str], None] = lambda msg: None, flops_batch: int | None = None):
        self.s, self.device, self.log, self.flops_batch = settings, device, log, flops_batch
        self.split = split
        self.training, self.validation = carve_validation(split, settings.val_fraction)
        t = settings.cfg.seq_len
        self.test_windows = eval_windows(split.eval, t, settings.eval_windows)
        self.train_windows = eval_windows(self.training.train, t, settings.train_windows)
        self.val_windows = eval_windows(self.validation.eval, t, settings.eval_windows)
        self.out = Path(out) if out is not None else None
        self._ratio: float | None = None
        self._flops_budget: float | None = None
        if self.out is not None:
            self._check_study_folder()

    # -- study folder ---------------------------------------------------------------------------------
    def _check_study_folder(self) -> None:
        key = self.s.key(self.split)
        path = self.out / "study.json"
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise StudyError(f"{path}: unreadable study file ({e})") from None
            diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
            if diff:
                raise StudyError(f"{self.out} holds a study with other settings ({', '.join(diff)} differ); "
                                 "give another --out")
        else:
            write_json(path, key)

    def _cached(self, rel: str, compute: Callable[[], dict]) -> dict:
        path = self.out / rel if self.out is not None else None
        if path is not None and path.exists():
            self.log(f"reusing {path}")
            return json.loads(path.read_text())
        res = compute()
        if path is not None:
            write_json(path, res)
        return res

    # -- budgets --------------------------------------------------------------------------------------
    def build(self, arm: str, seed: int, lr: float, split: DataSplit) -> tuple[LocalRun, str]:
        """A fresh run of ``arm`` (its init and data order from ``seed``), and the name of its model."""
        kind = arm_kind(arm)
        cfg = self.s.cfg.replace(lr=lr, init_seed=seed)
        common = dict(seed=seed, schedule=self.s.schedule, flops_batch=self.flops_batch)
        if kind in REFERENCES:
            run = LocalRun(cfg, split, self.device, chain=False, reference=kind == "whole",
                           small_reference=kind == "one-block", **common)
            return run, REFERENCES[kind]
        return LocalRun(cfg.replace(objective=kind), split, self.device, reference=False, **common), "chain"

    def streamed_ratio(self, arms: list[str]) -> float:
        """FLOPs a streamed chain runs / FLOPs the offline chain runs (upstream forwards recomputed),
        for the first upstream-reading chain arm (``forward-chained`` if none is among ``arms``)."""
        if self._ratio is None:
            chains = [a for a in arms if a in OBJECTIVES and get_objective(
                self.s.cfg.replace(objective=a)).needs_upstream] or ["forward-chained"]
            run, _ = self.build(chains[0], 0, self.s.cfg.lr, self.training)
            self._ratio = run.round_flops_streamed() / run.round_flops()
        return self._ratio

    def flops_budget(self, arms: list[str]) -> float | None:
        """FLOPs each arm gets (None for a wall-time budget)."""
        b = self.s.budget
        if b.seconds is not None:
            return None
        if self._flops_budget is None:
            if b.flops is not None:
                self._flops_budget = b.flops
            else:
                run, _ = self.build(arms[0], 0, self.s.cfg.lr, self.training)
                self._flops_budget = b.steps * run.round_flops()
        return self._flops_budget

    def arm_budget(self, arm: str, arms: list[str], fraction: float = 1.0) -> tuple[float | None, float | None]:
        """(FLOPs, seconds) this arm trains for."""
        f = self.flops_budget(arms)
        if f is None:
            return None, self.s.budget.seconds * fraction
        if arm.endswith(STREAMED):
            f *= self.streamed_ratio(arms)
        return f * fraction, None

    # -- one arm --------------------------------------------------------------------------------------
    def train_and_score(self, arm: str, seed: int, lr: float, split: DataSplit, *, flops: float | None,
                        seconds: float | None, score_windows: torch.Tensor, train_windows: torch.Tensor | None,
                        per_window: bool) -> dict:
        run, name = self.build(arm, seed, lr, split)
        if flops is not None:
            rounds = max(1, round(flops / run.round_flops()))
            budget = Budget(steps=rounds)
            predicted = rounds * run.cfg.batch_size * run.cfg.seq_len * max(
                tr.steps_per_round for tr in run.trainees) / len(split.train)
            if predicted > MAX_EPOCHS:
                self.log(f"WARNING: {arm} will read {predicted:.2f} epochs of the training bytes "
                         f"(protocol v2 keeps every arm under {MAX_EPOCHS:g})")
        else:
            budget = Budget(seconds=seconds)
        self.log(f"{arm} seed {seed} lr {lr:g}: training for {budget} "
                 f"({run.round_flops():.3g} FLOPs per round)")
        try:
            run.train(budget)
        except FloatingPointError as e:
            if per_window:
                raise FloatingPointError(f"{arm} seed {seed} at lr {lr:g} diverged: {e}") from None
            self.log(f"{arm} lr {lr:g} diverged ({e}): scored as infinitely bad")
            return {"arm": arm, "seed": seed, "lr": lr, "val_ce": float("inf"), "diverged": str(e)}
        t0 = time.perf_counter()
        res = {"arm": arm, "kind": arm_kind(arm), "seed": seed, "lr": lr, "schedule": self.s.schedule,
               "budget": str(self.s.budget), "flops_budget": flops, "rounds": run.rounds,
               "steps": {tr.name: tr.steps for tr in run.trainees},
               "flops_per_round": run.round_flops(), "flops_per_round_streamed": run.round_flops_streamed(),
               "flops_total": sum(run.flops()[tr.name] for tr in run.trainees),
               "train_seconds": round(run.seconds, 2), "train_cpu_seconds": round(run.cpu_seconds, 2),
               "epochs": round(run.epochs(), 4),
               "ce_kind": run.objective.ce_kind if name == "chain" else "exact",
               "windows_digest": windows_digest(score_windows), "device": str(self.device),
               "torch_threads": torch.get_num_threads()}
        if per_window:
            ces, extra = run.per_window_ce(score_windows, k=self.s.k)[name]
            res.update(heldout_ce=float(ces.mean()), heldout_per_window=ces.tolist(), extra=extra)
        else:
            res["val_ce"] = run.mean_ce(score_windows, k=self.s.k)[name]
        if train_windows is not None:
            res["train_ce"] = run.mean_ce(train_windows, k=self.s.k)[name]
        res["eval_seconds"] = round(time.perf_counter() - t0, 2)
        self.log(f"{arm} seed {seed}: " + ", ".join(f"{k} {res[k]:.4f}" for k in ("heldout_ce", "val_ce", "train_ce")
                                                   if k in res) + f" ({res['train_seconds']:.0f} s training)")
        return res

    # -- the protocol ---------------------------------------------------------------------------------
    def lr_sweep(self, arms: list[str], seed: int = 0) -> dict:
        """Each swept arm at each rate of the grid, ``sweep_fraction`` of its budget, trained without the
        validation part and scored on it; the rate with the lowest validation CE is the arm's."""
        keys = list(dict.fromkeys(arm_kind(a) for a in arms))
        scores: dict[str, dict[str, float]] = {}
        for key in keys:
            flops, seconds = self.arm_budget(key, arms, self.s.sweep_fraction)
            scores[key] = {}
            for lr in self.s.lr_grid:
                res = self._cached(f"lr_sweep/{key}-lr{lr:g}.json", lambda key=key, lr=lr: self.train_and_score(
                    key, seed, lr, self.training, flops=flops, seconds=seconds, score_windows=self.val_windows,
                    train_windows=None, per_window=False))
                scores[key][f"{lr:g}"] = res["val_ce"]
        choice = {key: float(min(sc, key=sc.get)) for key, sc in scores.items()}
        return {"grid": list(self.s.lr_grid), "fraction": self.s.sweep_fraction, "seed": seed,
                "validation": self.validation.description, "validation_protocol": self.validation.protocol,
                "validation_windows": int(self.val_windows.shape[0]), "scores": scores, "choice": choice,
                "margin": sweep_margins(scores)}

    def run_arms(self, arms: list[str], seeds: list[int], lrs: dict[str, float]) -> list[dict]:
        out = []
        for seed in seeds:
            for arm in arms:
                lr = lrs[arm_kind(arm)]
                flops, seconds = self.arm_budget(arm, arms)
                out.append(self._cached(f"runs/{arm}-seed{seed}.json", lambda arm=arm, lr=lr: self.train_and_score(
                    arm, seed, lr, self.training, flops=flops, seconds=seconds, score_windows=self.test_windows,
                    train_windows=self.train_windows, per_window=True)))
        return out

    def stored_runs(self) -> list[dict]:
        """Every arm-seed result in the study folder (other invocations' seeds and arms included)."""
        if self.out is None or not (self.out / "runs").is_dir():
            return []
        return [json.loads(p.read_text()) for p in sorted((self.out / "runs").glob("*.json"))]

    def plan(self, arms: list[str], seeds: list[int], lr_sweep: bool) -> dict:
        """What the study would run, from measured FLOPs, without training."""
        rows, total = [], 0.0
        swept = len(dict.fromkeys(arm_kind(a) for a in arms)) if lr_sweep else 0
        for arm in arms:
            run, _ = self.build(arm, 0, self.s.cfg.lr, self.training)
            flops, _ = self.arm_budget(arm, arms)
            if flops is None:
                raise StudyError("--plan needs a FLOP or step budget")
            rounds = max(1, round(flops / run.round_flops()))
            reads = rounds * max(tr.steps_per_round for tr in run.trainees) * run.cfg.batch_size * run.cfg.seq_len
            rows.append({"arm": arm, "flops_per_round": run.round_flops(),
                         "flops_per_round_streamed": run.round_flops_streamed(), "rounds": rounds,
                         "flops": rounds * run.round_flops(), "epochs": reads / len(self.training.train)})
            total += rounds * run.round_flops() * len(seeds)
        sweep = sum(r["flops"] for r in rows if not r["arm"].endswith(STREAMED)) * self.s.sweep_fraction \
            * len(self.s.lr_grid) if swept else 0.0
        return {"arms": rows, "seeds": seeds, "main_flops": total, "sweep_flops": sweep,
                "total_flops": total + sweep}


def write_json(path: Path, obj: dict) -> None:
    atomic_write(path, write_bytes((json.dumps(obj, indent=1) + "\n").encode()))
