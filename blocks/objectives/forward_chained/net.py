"""The network of one ``forward-chained`` block: layers on the residual stream and a local head."""
from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from ...layers import TransformerLayer, init_weights, residual_stream


class ForwardChainedBlock(nn.Module):
    """``layers_per_block`` pre-LN Transformer layers on the residual stream, plus a local head."""

    def __init__(self, cfg: ModelConfig, b: int):
        super().__init__()
        d = cfg.d_model
        self.first = b == 0
        if self.first:
            self.byte_emb = nn.Embedding(cfg.vocab_size, d)
            self.pos_emb = nn.Embedding(cfg.seq_len, d)
        self.layers = nn.ModuleList(
            TransformerLayer(d, cfg.n_heads, cfg.mlp_ratio, cfg.dropout) for _ in range(cfg.layers_per_block))
        self.norm_out = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab_size)
        init_weights(self)

    def stream(self, h: torch.Tensor | None, context: torch.Tensor) -> torch.Tensor:
        """The block's output state: h_b from h_{b-1} (block 0: from the bytes)."""
        return residual_stream(self, h, context, embed=self.first)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm_out(h))

    def forward(self, h: torch.Tensor | None, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.stream(h, context)
        return h, self.logits(h)
