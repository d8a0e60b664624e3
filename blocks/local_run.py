"""Offline training without a network (``bt-node train-local``, ``bench quality``): all B blocks,
interleaved, and/or the end-to-end references, then their evaluation and checkpoints.

One *round* is one optimizer step of every block. By default the full-depth reference takes one
step per round (B block-steps cost about one reference step) and the one-block-size reference,
when asked for, ``n_blocks`` steps. With ``match_flops`` (``bench quality --protocol v1``) both
references instead take as many steps as the chain's training FLOPs buy them (a fractional credit
carried from round to round). A run without the chain (``chain=False``: one arm of ``bench quality``
protocol v2) trains only its reference(s), one step per round.

FLOPs are measured, not estimated: each trainee's step is counted once with ``FlopCounterMode`` on a
real batch (``flops.measure_step_flops``), so what a step runs is what it is charged (a chunked
block's longer window, a forward-chained block's upstream forwards without their heads, the paper
objective's fixed target table). ``upstream_flops`` keeps the upstream part apart: it is what a
worker that receives its input activations (``forward-streamed``) does not run.

``schedule="cosine"`` decays every trainee's learning rate to the end of the budget given to
:meth:`train` (its own step count for a step budget; the elapsed fraction for a wall-time budget);
the default "constant" is the network's schedule (warm-up, then constant).

Chain-trained objectives (``pipeline``, ``forward-streamed``) take one step of all their blocks
together per round, on one batch (``chain_train.chain_step``), as the network's engine does. Each
block is charged what its holder runs of that step (``chain_train.stage_step_flops``): its stage from
the state it receives (forward-streamed: no upstream forward), its loss and backward (pipeline: the
gradient w.r.t. its input included); ``upstream_flops`` is 0.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import checkpoint as ckpt
from .budget import Budget
from .chain_train import chain_step, stage_step_flops
from .config import ModelConfig
from .optim import AdamW
from .data import DataSplit
from .windows import WindowSampler, eval_windows
from .evaluate import evaluate_blocks, evaluate_reference, per_window_chain_ce, per_window_reference_ce
from .flops import measure_step_flops, measured_flops
from .objectives import get_objective
from .reference import ReferenceLM
from .train import LrSchedule, make_optimizer, optimizer_step, reference_loss_fn


@dataclass
class _Trainee:
    name: str
    module: torch.nn.Module
    opt: AdamW
    sampler: WindowSampler
    loss_fn: Callable[[torch.Tensor], Callable]
    steps_per_round: float = 1
    steps: int = 0
    last: dict = field(default_factory=dict)
    step_flops: float = 0.0     # measured training FLOPs of one step (upstream forwards included)
    upstream_flops: float = 0.0  # of which: the forwards of other blocks this step runs
    credit: float = 0.0         # fractional steps carried over (match_flops)
    schedule: LrSchedule | None = None


@dataclass
class LocalRun:
    cfg: ModelConfig
    split: DataSplit
    device: torch.device
    seed: int = 0
    reference: bool = True
    small_reference: bool = False
    match_flops: bool = False
    upstream_every: int = 1     # forward-chained: refresh block b's snapshots of blocks < b every N rounds
    chain: bool = True          # train the objective's blocks (False: only the reference(s))
    schedule: str = "constant"  # lr schedule: "constant" (network) or "cosine" (to the end of the budget)
    flops_batch: int | None = None  # count FLOPs on this many windows and scale linearly (None: batch_size)

    def __post_init__(self) -> None:
        if not (self.chain or self.reference or self.small_reference):
            raise ValueError("a LocalRun needs the chain or a reference to train")
        LrSchedule(self.cfg.lr, kind=self.schedule)    # validates the schedule's name
        torch.manual_seed(self.cfg.init_seed)
        self.objective = get_objective(self.cfg)
        self.blocks = ([self.objective.build_block(b).to(self.device) for b in range(self.cfg.n_blocks)]
                       if self.chain else [])
        self.trainees: list[_Trainee] = []
        for b, m in enumerate(self.blocks):
            gen = torch.Generator().manual_seed(self.seed * 1000 + b)
            self.trainees.append(_Trainee(
                f"block{b}", m, make_optimizer(m, self.cfg, fused_on_cuda=True),
                WindowSampler(self.split.train, self.cfg.seq_len, seed=self.seed, worker_id=b),
                lambda w, m=m, b=b, gen=gen: (lambda: self.objective.local_loss(m, b, w, gen,
                                                                                  upstream=self._upstream(b))),
            ))
        self._snapshots: list[torch.nn.Module] | None = None
        self._snap_round = -1
        self.ref = self.small_ref = None
        if self.reference:
            self.ref = ReferenceLM(self.cfg).to(self.device)
            self._add_reference("reference", self.ref, worker_id=100, steps_per_round=1)
        if self.small_reference:
            self.small_ref = ReferenceLM(self.cfg, n_layers=self.cfg.layers_per_block).to(self.device)
            self._add_reference("reference_1block", self.small_ref, worker_id=101,
                                steps_per_round=self.cfg.n_blocks if self.chain else 1)
        self.rounds = 0
        self.seconds = 0.0          # wall time spent training
        self.cpu_seconds = 0.0      # CPU time of this process spent training (steadier on a shared machine)
        self._set_step_flops()

    # -- compute accounting ---------------------------------------------------------------------------
    def _set_step_flops(self) -> None:
        n = self.flops_batch or self.cfg.batch_size
        scale = self.cfg.batch_size / n
        w = eval_windows(self.split.train, self.cfg.seq_len, n)
        if w.shape[0] < n:
            w = w.repeat((n + w.shape[0] - 1) // w.shape[0], 1)[:n]
        w = w.to(self.device)
        upstream_state = getattr(self.objective, "upstream_state", None)
        if self.blocks and not self.objective.block_local:   # what each block's holder runs of a chain step
            for tr, f in zip(self.trainees, stage_step_flops(self.objective, self.blocks, w)):
                tr.step_flops = scale * f
        for b, tr in enumerate(self.trainees[:len(self.blocks)] if self.objective.block_local else []):
            gen = torch.Generator().manual_seed(0)
            up = self.blocks[:b] if self.objective.needs_upstream else None
            tr.step_flops = scale * measure_step_flops(
                tr.module, lambda: self.objective.local_loss(tr.module, b, w, gen, upstream=up))
            if up and upstream_state is not None:
                tr.upstream_flops = scale * measured_flops(lambda: upstream_state(up, w[:, :-1]))
        chain = sum(tr.step_flops for tr in self.trainees[:len(self.blocks)])
        for tr in self.trainees[len(self.blocks):]:
            tr.step_flops = scale * measure_step_flops(tr.module, reference_loss_fn(tr.module, w))
            if self.match_flops and self.chain:
                tr.steps_per_round = chain / tr.step_flops

    def round_flops(self) -> float:
        """Measured training FLOPs of one round (every trainee's steps of it)."""
        return sum(tr.step_flops * tr.steps_per_round for tr in self.trainees)

    def round_flops_streamed(self) -> float:
        """One round less the upstream forwards: what workers that receive activations would run."""
        return sum((tr.step_flops - tr.upstream_flops) * tr.steps_per_round for tr in self.trainees)

    def flops(self) -> dict[str, float]:
        out = {tr.name: tr.step_flops * tr.steps for tr in self.trainees}
        out["chain"] = sum(v for k, v in out.items() if k.startswith("block"))
        return out

    def epochs(self) -> float:
        """Passes over the training bytes by the trainee that read the most."""
        return max(tr.sampler.windows_drawn for tr in self.trainees) * self.cfg.seq_len / len(self.split.train)

    # -- training -------------------------------------------------------------------------------------
    def _upstream(self, b: int) -> list[torch.nn.Module] | None:
        """Blocks 0..b-1 as block b sees them: live (``upstream_every`` 1) or snapshots refreshed
        every ``upstream_every`` rounds (the staleness of a networked worker)."""
        if not self.objective.needs_upstream:
            return None
        if self.upstream_every <= 1:
            return self.blocks[:b]
        if self._snapshots is None or self.rounds % self.upstream_every == 0 and self._snap_round != self.rounds:
            self._snapshots = [copy.deepcopy(m).requires_grad_(False) for m in self.blocks[:-1]]
            self._snap_round = self.rounds
        return self._snapshots[:b]

    def _add_reference(self, name: str, model: torch.nn.Module, worker_id: int, steps_per_round: int):
        self.trainees.append(_Trainee(
            name, model, make_optimizer(model, self.cfg, fused_on_cuda=True),
            WindowSampler(self.split.train, self.cfg.seq_len, seed=self.seed, worker_id=worker_id),
            lambda w, model=model: reference_loss_fn(model, w), steps_per_round=steps_per_round,
        ))

    def round(self, progress: float | None = None) -> None:
        first = 0
        if not self.objective.block_local:   # chain-trained: one step of every block on one batch
            blocks = self.trainees[:len(self.blocks)]
            w = blocks[0].sampler.next_batch(self.cfg.batch_size).to(self.device)
            lr = blocks[0].schedule.at(blocks[0].steps, progress) if blocks[0].schedule is not None else None
            stats = chain_step(self.objective, self.blocks, [tr.opt for tr in blocks], self.cfg, blocks[0].steps, w,
                               lr=lr)
            for tr, st in zip(blocks, stats):
                tr.last, tr.steps = st, tr.steps + 1
            first = len(self.blocks)
        for tr in self.trainees[first:]:
            tr.credit += tr.steps_per_round
            n = int(tr.credit + 1e-9)
            tr.credit -= n
            for _ in range(n):
                w = tr.sampler.next_batch(self.cfg.batch_size).to(self.device)
                lr = tr.schedule.at(tr.steps, progress) if tr.schedule is not None else None
                tr.last = optimizer_step(tr.module, tr.opt, self.cfg, tr.steps, tr.loss_fn(w), lr=lr)
                tr.steps += 1
        self.rounds += 1

    def _set_schedules(self, budget: Budget) -> None:
        for tr in self.trainees:
            total = (max(1, math.ceil(tr.steps + tr.steps_per_round * (budget.steps - self.rounds)))
                     if budget.steps is not None else None)
            tr.schedule = LrSchedule(self.cfg.lr, self.cfg.warmup_steps, self.schedule, total_steps=total)

    def train(self, budget: Budget, on_round: Callable[["LocalRun", float], None] | None = None) -> None:
        """Train until ``budget`` (rounds or wall time) is spent; a cosine schedule ends with it."""
        self._set_schedules(budget)
        t0, c0 = time.perf_counter(), time.process_time()
        while not budget.done(self.rounds, time.perf_counter() - t0):
            progress = None if budget.steps is not None else budget.fraction(0, time.perf_counter() - t0)
            self.round(progress)
            if on_round is not None:
                on_round(self, budget.fraction(self.rounds, time.perf_counter() - t0))
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.process_time() - c0

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluate(self, n_windows: int = 64, k: int = 4) -> dict:
        windows = eval_windows(self.split.eval, self.cfg.seq_len, n_windows)
        res = evaluate_blocks(self.objective, self.blocks, windows, k=k) if self.chain else {}
        if self.ref is not None:
            res["reference_ce"] = evaluate_reference(self.ref, windows)
        if self.small_ref is not None:
            res["single_block_reference_ce"] = evaluate_reference(self.small_ref, windows)
        res.update(
            objective=self.cfg.objective, protocol=self.split.protocol, data=self.split.description,
            tokens=self.rounds * self.cfg.batch_size * self.cfg.seq_len, seconds=round(self.seconds, 2),
            steps_per_block=self.rounds, eval_windows=int(windows.shape[0]),
            config_hash=self.cfg.config_hash,
        )
        return res

    def per_window_ce(self, windows: torch.Tensor, k: int = 4) -> dict[str, tuple[np.ndarray, dict]]:
        """Nats/byte of each window for each model this run trains: ``chain`` (the composed blocks),
        ``reference``, ``reference_1block``; each with the score's extras averaged over windows."""
        out: dict[str, tuple[np.ndarray, dict]] = {}
        if self.chain:
            out["chain"] = per_window_chain_ce(self.objective, self.blocks, windows, k=k)
        for name, model in (("reference", self.ref), ("reference_1block", self.small_ref)):
            if model is not None:
                out[name] = (per_window_reference_ce(model, windows), {})
        return out

    def mean_ce(self, windows: torch.Tensor, k: int = 4, batch: int = 64) -> dict[str, float]:
        """Mean nats/byte over ``windows`` (scored in batches: for figures that need no per-window
        values, such as the train CE)."""
        out: dict[str, float] = {}
        n = windows.shape[0]
        if self.chain:
            parts = [evaluate_blocks(self.objective, self.blocks, windows[i:i + batch], k=k, seed=i,
                                     block_alone=False)["chain_ce"] * windows[i:i + batch].shape[0]
                     for i in range(0, n, batch)]
            out["chain"] = float(sum(parts) / n)
        for name, model in (("reference", self.ref), ("reference_1block", self.small_ref)):
            if model is not None:
                out[name] = float(per_window_reference_ce(model, windows).mean())
        return out

    def save(self, out: Path) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        ckpt.save_config(out, self.cfg)
        samples = self.rounds * self.cfg.batch_size
        for b, m in enumerate(self.blocks):
            ckpt.save_block(out / ckpt.block_filename(b), m.state_dict(), config=self.cfg, block_index=b,
                            step=self.rounds, samples_seen=samples)
        if self.ref is not None:
            ckpt.save_reference(out / "reference.safetensors", self.ref.state_dict(), config=self.cfg,
                                step=self.rounds, samples_seen=samples)
