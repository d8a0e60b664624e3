"""Honest evaluation: held-out nats/byte of the composed chain, each block alone, and references,
for blocks in memory (``train-local``) or in a checkpoint directory (``bt-node eval``).

The chain never sees the byte it predicts: its state starts from pure noise and is refined by
the blocks from the context alone. A teacher-forced "denoising CE" (noisy TRUE target as input)
is leaky and is deliberately not computed here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint as ckpt
from .data import DataSplit
from .device import autocast
from .windows import eval_windows
from .model import load_blocks
from .objectives.base import Objective
from .reference import ReferenceLM


@torch.no_grad()
def evaluate_blocks(objective: Objective, blocks: Sequence[nn.Module], windows: torch.Tensor, *,
                    k: int = 4, seed: int = 0, block_alone: bool = True) -> dict:
    """The chain's held-out figures; with ``block_alone`` also each block's CE alone."""
    for m in blocks:
        m.eval()
    dev = next(blocks[0].parameters()).device
    windows = windows.to(dev)
    g = torch.Generator().manual_seed(seed)
    res = objective.score(objective.local_hops(blocks), windows, k=k, generator=g)
    out = {"chain_ce": res.ce, "chain_ce_k1": res.ce_k1, "chain_k": res.k, "ce_kind": res.ce_kind,
           "eval_tokens": res.tokens, **res.extra}
    if block_alone:
        block_ce = [objective.block_alone_ce(m, b, windows, torch.Generator().manual_seed(seed + 1 + b))
                    for b, m in enumerate(blocks)]
        out.update(block_ce=block_ce, block0_ce=block_ce[0])
    return out


@torch.no_grad()
def evaluate_reference(model: nn.Module, windows: torch.Tensor, batch: int = 32) -> float:
    model.eval()
    dev = next(model.parameters()).device
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(dev)
        total += model.score(w) * w.shape[0]
        n += w.shape[0]
    return total / n


@torch.no_grad()
def per_window_reference_ce(model: nn.Module, windows: torch.Tensor, batch: int = 64) -> np.ndarray:
    """Nats/byte of each window under an autoregressive model (the mean over its predicted bytes), run
    under the device's autocast as the chain's hops are."""
    model.eval()
    dev = next(model.parameters()).device
    out = []
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(dev)
        with autocast(dev):
            logits = model(w[:, :-1])
        ce = F.cross_entropy(logits.float().transpose(1, 2), w[:, 1:], reduction="none").mean(1)
        out.append(ce.double().cpu().numpy())
    return np.concatenate(out)


@torch.no_grad()
def per_window_chain_ce(objective: Objective, blocks: Sequence[nn.Module], windows: torch.Tensor, *,
                        k: int = 4, seed: int = 0) -> tuple[np.ndarray, dict]:
    """The chain's held-out nats/byte window by window (``objective.score`` on one window at a time,
    window i with its own generator seeded ``seed + i``), and the mean of the score's numeric
    extras over the windows (e.g. forward-chained's ``prefix_ce``: all windows have equal length,
    so the mean of per-window means is the mean over bytes)."""
    for m in blocks:
        m.eval()
    dev = next(blocks[0].parameters()).device
    ces, extras = objective.score_per_window(objective.local_hops(blocks), windows.to(dev), k=k, seed=seed)
    mean_extra = {}
    for key, value in (extras[0] if extras else {}).items():
        try:
            mean_extra[key] = np.mean([np.asarray(e[key], dtype=np.float64) for e in extras], axis=0).tolist()
        except (TypeError, ValueError):
            continue
    return np.asarray(ces, dtype=np.float64), mean_extra


def evaluate_checkpoint_dir(directory: str | Path, split: DataSplit, *, device: torch.device,
                            k: int = 4, n_windows: int = 64) -> dict:
    """Score saved blocks (and a saved reference) the same way ``train-local`` scores fresh ones."""
    cfg, objective, blocks = load_blocks(directory, device)
    windows = eval_windows(split.eval, cfg.seq_len, n_windows)
    res = evaluate_blocks(objective, blocks, windows, k=k)
    ref_path = Path(directory) / ckpt.REFERENCE_FILENAME
    if ref_path.exists():
        ref = ReferenceLM(cfg)
        ref.load_state_dict(ckpt.load_reference(ref_path, expected_config_hash=cfg.config_hash).tensors)
        res["reference_ce"] = evaluate_reference(ref.to(device), windows)
    res.update(objective=cfg.objective, protocol=split.protocol, data=split.description,
               checkpoint=str(directory), config_hash=cfg.config_hash, eval_windows=int(windows.shape[0]))
    return res
