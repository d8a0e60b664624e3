"""The end-to-end reference: a plain causal byte Transformer trained with next-byte cross entropy."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import TransformerLayer, init_weights, residual_stream


class ReferenceLM(nn.Module):
    def __init__(self, cfg: ModelConfig, n_layers: int | None = None):
        super().__init__()
        d = cfg.d_model
        self.n_layers = n_layers or cfg.reference_layers
        self.byte_emb = nn.Embedding(cfg.vocab_size, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d)
        self.layers = nn.ModuleList(
            TransformerLayer(d, cfg.n_heads, cfg.mlp_ratio, cfg.dropout) for _ in range(self.n_layers)
        )
        self.norm_out = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab_size)
        init_weights(self)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm_out(residual_stream(self, None, context, embed=True)))

    def loss(self, windows: torch.Tensor) -> torch.Tensor:
        logits = self(windows[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))

    @torch.no_grad()
    def score(self, windows: torch.Tensor) -> float:
        return float(self.loss(windows))
