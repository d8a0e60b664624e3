"""Offline training without a network (``bt-node train-local``, ``bench quality``): all B blocks,
interleaved, and the end-to-end references, then their evaluation and checkpoints.

One *round* is one optimizer step of every block. By default the full-depth reference takes one
step per round (B block-steps cost about one reference step) and the one-block-size reference,
when asked for, ``n_blocks`` steps. With ``match_flops`` (``bench quality``) both references
instead take as many steps as the chain's analytic training FLOPs buy them (a fractional credit
carried from round to round), which matters for objectives whose block step costs more than a
plain forward+backward (chunked-masked's longer training window, forward-chained's upstream
forwards).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import checkpoint as ckpt
from .budget import Budget
from .config import ModelConfig
from .optim import AdamW
from .data import DataSplit
from .windows import WindowSampler, eval_windows
from .evaluate import evaluate_blocks, evaluate_reference
from .flops import train_flops_per_step
from .objectives import get_objective
from .reference import ReferenceLM
from .train import make_optimizer, optimizer_step, reference_loss_fn


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
    step_flops: float = 0.0     # analytic training FLOPs of one step
    credit: float = 0.0         # fractional steps carried over (match_flops)


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

    def __post_init__(self) -> None:
        torch.manual_seed(self.cfg.init_seed)
        self.objective = get_objective(self.cfg)
        self.blocks = [self.objective.build_block(b).to(self.device) for b in range(self.cfg.n_blocks)]
        self.trainees: list[_Trainee] = []
        for b, m in enumerate(self.blocks):
            gen = torch.Generator().manual_seed(self.seed * 1000 + b)
            self.trainees.append(_Trainee(
                f"block{b}", m, make_optimizer(m, self.cfg),
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
                                steps_per_round=self.cfg.n_blocks)
        self.rounds = 0
        self.seconds = 0.0
        self._set_step_flops()

    def _set_step_flops(self) -> None:
        b, t = self.cfg.batch_size, self.cfg.seq_len
        t_block = self.objective.train_tokens_per_window   # a block may see more positions per window
        fwd = [train_flops_per_step(m, b, t) / 3.0 for m in self.blocks]   # forward only: 2 N T of 6 N T
        for i, tr in enumerate(self.trainees[:len(self.blocks)]):
            tr.step_flops = (train_flops_per_step(tr.module, b, t_block)
                             + sum(fwd[:self.objective.upstream_blocks(i)]))
        chain = sum(tr.step_flops for tr in self.trainees[:len(self.blocks)])
        for tr in self.trainees[len(self.blocks):]:
            tr.step_flops = train_flops_per_step(tr.module, b, t)
            if self.match_flops:
                tr.steps_per_round = chain / tr.step_flops

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
            name, model, make_optimizer(model, self.cfg),
            WindowSampler(self.split.train, self.cfg.seq_len, seed=self.seed, worker_id=worker_id),
            lambda w, model=model: reference_loss_fn(model, w), steps_per_round=steps_per_round,
        ))

    def round(self) -> None:
        for tr in self.trainees:
            tr.credit += tr.steps_per_round
            n = int(tr.credit + 1e-9)
            tr.credit -= n
            for _ in range(n):
                w = tr.sampler.next_batch(self.cfg.batch_size).to(self.device)
                tr.last = optimizer_step(tr.module, tr.opt, self.cfg, tr.steps, tr.loss_fn(w))
                tr.steps += 1
        self.rounds += 1

    def train(self, budget: Budget, on_round: Callable[["LocalRun", float], None] | None = None) -> None:
        t0 = time.perf_counter()
        while not budget.done(self.rounds, time.perf_counter() - t0):
            self.round()
            if on_round is not None:
                on_round(self, budget.fraction(self.rounds, time.perf_counter() - t0))
        self.seconds += time.perf_counter() - t0

    def flops(self) -> dict[str, float]:
        out = {tr.name: tr.step_flops * tr.steps for tr in self.trainees}
        out["chain"] = sum(v for k, v in out.items() if k.startswith("block"))
        return out

    def evaluate(self, n_windows: int = 64, k: int = 4) -> dict:
        windows = eval_windows(self.split.eval, self.cfg.seq_len, n_windows)
        res = evaluate_blocks(self.objective, self.blocks, windows, k=k)
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
