"""The shared target: a fixed embedding of the 256 byte values, generated from a seed, never trained.

Every block denoises toward the same target space, so blocks trained on different machines
compose, yet they share no trainable parameter. Rows have per-coordinate std ``sigma_data`` (row
norm sigma_data * sqrt(target_dim)), matching the EDM preconditioning's data scale.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig


def target_table(cfg: ModelConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.target_seed)
    e = torch.randn(cfg.vocab_size, cfg.target_dim, generator=g, dtype=torch.float64)
    e = e / e.norm(dim=1, keepdim=True) * (cfg.sigma_data * cfg.target_dim**0.5)
    return e.float()


class TargetEmbedding(nn.Module):
    """Holds the table as a non-persistent buffer: it is rebuilt from the seed, never saved or trained."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("table", target_table(cfg), persistent=False)

    def forward(self, byte_ids: torch.Tensor) -> torch.Tensor:
        return self.table[byte_ids]
