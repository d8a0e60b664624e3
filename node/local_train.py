"""Local training and evaluation without a network: all B blocks (interleaved) and references.

Equal compute: one *round* is one optimizer step of every block and one step of the
full-depth reference at the same batch (B block-steps cost about one reference step). The
one-block-size reference, when asked for, gets ``n_blocks`` steps per round so that it too
spends the same training FLOPs as the whole chain.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..blocks import checkpoint as ckpt
from ..blocks.config import ModelConfig
from ..blocks.data import DataSplit, WindowSampler, eval_windows
from ..blocks.evaluate import evaluate_blocks, evaluate_reference
from ..blocks.flops import train_flops_per_step
from ..blocks.objectives import get_objective
from ..blocks.reference import ReferenceLM
from ..blocks.train import make_optimizer, optimizer_step, reference_loss_fn
from .budget import Budget


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or auto")
    return torch.device(name)


@dataclass
class _Trainee:
    name: str
    module: torch.nn.Module
    opt: torch.optim.Optimizer
    sampler: WindowSampler
    loss_fn: Callable[[torch.Tensor], Callable]
    steps_per_round: int = 1
    steps: int = 0
    last: dict = field(default_factory=dict)


@dataclass
class LocalRun:
    cfg: ModelConfig
    split: DataSplit
    device: torch.device
    seed: int = 0
    reference: bool = True
    small_reference: bool = False

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
                lambda w, m=m, b=b, gen=gen: (lambda: self.objective.local_loss(m, b, w, gen)),
            ))
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

    def _add_reference(self, name: str, model: torch.nn.Module, worker_id: int, steps_per_round: int):
        self.trainees.append(_Trainee(
            name, model, make_optimizer(model, self.cfg),
            WindowSampler(self.split.train, self.cfg.seq_len, seed=self.seed, worker_id=worker_id),
            lambda w, model=model: reference_loss_fn(model, w), steps_per_round=steps_per_round,
        ))

    def round(self) -> None:
        for tr in self.trainees:
            for _ in range(tr.steps_per_round):
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
        b, t = self.cfg.batch_size, self.cfg.seq_len
        t_block = self.objective.train_tokens_per_window   # a block may see more positions per window
        out = {tr.name: train_flops_per_step(tr.module, b, t_block if tr.name.startswith("block") else t) * tr.steps
               for tr in self.trainees}
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
