"""One optimizer step of one module, with everything it needs and nothing shared across blocks,
and the learning-rate schedules: warm-up then constant (the network: budgets are open-ended) or
warm-up then cosine decay to the run's own budget (budgeted offline runs, ``bench quality``)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .device import autocast
from .optim import AdamW

SCHEDULES = ("constant", "cosine")


def make_optimizer(module: nn.Module, cfg: ModelConfig, lr: float | None = None, *,
                   fused_on_cuda: bool = False) -> AdamW | torch.optim.AdamW:
    """AdamW, weight decay on matrices only. ``lr``: the peak rate (default ``cfg.lr``).

    On the CPU: blocks/optim.py's AdamW (torch's update and state_dict format, without importing
    torch._dynamo, ~65 MB per node process); ``torch.optim.AdamW`` itself when the environment sets
    BT_TORCH_OPTIM=1 or the module sits on a GPU (``fused_on_cuda``: its fused CUDA kernel, offline
    benches)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    peak = cfg.lr if lr is None else lr
    if on_cuda or os.environ.get("BT_TORCH_OPTIM", "0").strip() == "1":
        return torch.optim.AdamW(groups, lr=peak, betas=(0.9, 0.95),
                                 **({"fused": True} if fused_on_cuda and on_cuda else {}))
    return AdamW(groups, lr=peak, betas=(0.9, 0.95))


@dataclass(frozen=True)
class LrSchedule:
    """Linear warm-up over ``warmup_steps`` to ``peak``, then ``constant`` or ``cosine``.

    ``cosine`` decays from ``peak`` to ``final_ratio * peak`` over the run's budget: the fraction of
    it done is ``step / total_steps`` (a step or FLOP budget) or the ``progress`` the caller passes
    (a wall-time budget: elapsed / allowed)."""

    peak: float
    warmup_steps: int = 0
    kind: str = "constant"
    total_steps: int | None = None
    final_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.kind!r}: use {' or '.join(SCHEDULES)}")
        if not (self.peak > 0 and math.isfinite(self.peak)):
            raise ValueError(f"peak learning rate must be a positive number, got {self.peak!r}")
        if not 0.0 <= self.final_ratio <= 1.0:
            raise ValueError(f"final_ratio must be in [0, 1], got {self.final_ratio!r}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps!r}")

    def at(self, step: int, progress: float | None = None) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak
        if progress is None:
            if self.total_steps is None:
                raise ValueError("a cosine schedule needs total_steps or the progress of the budget")
            span = max(1, self.total_steps - 1 - self.warmup_steps)   # the last step runs at the floor
            progress = (step - self.warmup_steps) / span
        progress = min(1.0, max(0.0, float(progress)))
        return self.peak * (self.final_ratio + (1 - self.final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_at(step: int, cfg: ModelConfig) -> float:
    """Linear warm-up, then constant (budgets are open-ended in a volunteer network)."""
    return LrSchedule(cfg.lr, cfg.warmup_steps).at(step)


def optimizer_step(module: nn.Module, opt: AdamW | torch.optim.AdamW, cfg: ModelConfig, step: int,
                   loss_fn: Callable[[], tuple[torch.Tensor, dict]], *, lr: float | None = None) -> dict:
    """Zero grads, compute the loss, clip, step. Touches only ``module``'s parameters and ``opt``.
    ``lr``: this step's learning rate (default: ``lr_at(step, cfg)``, warm-up then constant)."""
    module.train()
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg) if lr is None else lr
    opt.zero_grad(set_to_none=True)
    loss, stats = loss_fn()
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {float(loss)} at step {step}")
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip)
    opt.step()
    return {"loss": float(loss.detach()), "grad_norm": float(gnorm), **stats}


def reference_loss_fn(model: nn.Module, windows: torch.Tensor):
    def fn():
        with autocast(windows.device):
            return model.loss(windows), {}
    return fn
