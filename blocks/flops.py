"""Analytic training FLOPs, for equal-compute comparisons (6 N T rule plus attention)."""
from __future__ import annotations

from torch import nn

from .layers import TransformerLayer


def train_flops_per_step(module: nn.Module, batch: int, seq_len: int) -> float:
    """Approximate FLOPs of one forward+backward step on (batch, seq_len) tokens.

    6 * (non-embedding parameters) * tokens for the matmuls, plus 12 * layers * T^2 * d * batch
    for attention scores and values (forward 4 T^2 d, backward twice that).
    """
    n_params = sum(p.numel() for name, p in module.named_parameters() if "emb" not in name)
    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    d = layers[0].attn.proj.in_features if layers else 0
    tokens = batch * seq_len
    return 6.0 * n_params * tokens + 12.0 * len(layers) * seq_len * seq_len * d * batch
