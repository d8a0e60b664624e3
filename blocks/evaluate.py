"""Honest evaluation: held-out nats/byte of the composed chain, each block alone, and references,
for blocks in memory (``train-local``) or in a checkpoint directory (``bt-node eval``).

The chain never sees the byte it predicts: its state starts from pure noise and is refined by
the blocks from the context alone. A teacher-forced "denoising CE" (noisy TRUE target as input)
is leaky and is deliberately not computed here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from . import checkpoint as ckpt
from .data import DataSplit
from .windows import eval_windows
from .model import load_blocks
from .objectives.base import Objective
from .reference import ReferenceLM


@torch.no_grad()
def evaluate_blocks(objective: Objective, blocks: Sequence[nn.Module], windows: torch.Tensor, *,
                    k: int = 4, seed: int = 0) -> dict:
    for m in blocks:
        m.eval()
    dev = next(blocks[0].parameters()).device
    windows = windows.to(dev)
    g = torch.Generator().manual_seed(seed)
    res = objective.score(objective.local_hops(blocks), windows, k=k, generator=g)
    block_ce = [objective.block_alone_ce(m, b, windows, torch.Generator().manual_seed(seed + 1 + b))
                for b, m in enumerate(blocks)]
    return {
        "chain_ce": res.ce, "chain_ce_k1": res.ce_k1, "chain_k": res.k, "ce_kind": res.ce_kind,
        "block_ce": block_ce, "block0_ce": block_ce[0], "eval_tokens": res.tokens,
        **res.extra,
    }


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
