"""One optimizer step of one module, with everything it needs and nothing shared across blocks."""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .device import autocast
from .optim import AdamW


def make_optimizer(module: nn.Module, cfg: ModelConfig) -> AdamW | torch.optim.AdamW:
    """AdamW (blocks/optim.py: torch's update and state_dict format, without importing torch._dynamo);
    ``torch.optim.AdamW`` itself when the environment sets BT_TORCH_OPTIM=1."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if os.environ.get("BT_TORCH_OPTIM", "0").strip() == "1":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    return AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def lr_at(step: int, cfg: ModelConfig) -> float:
    """Linear warm-up, then constant (budgets are open-ended in a volunteer network)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


def optimizer_step(module: nn.Module, opt: AdamW | torch.optim.AdamW, cfg: ModelConfig, step: int,
                   loss_fn: Callable[[], tuple[torch.Tensor, dict]]) -> dict:
    """Zero grads, compute the loss, clip, step. Touches only ``module``'s parameters and ``opt``."""
    module.train()
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
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
