"""The network of one ``forward-residual`` block: a forward-chained block whose later blocks start as
the identity on the stream and read it through a copy of block 0's readout (see ``objective.py``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ..forward_chained.net import ForwardChainedBlock


class ForwardResidualBlock(ForwardChainedBlock):
    def __init__(self, cfg: ModelConfig, b: int):
        super().__init__(cfg, b)
        if b == 0:
            return
        d = cfg.d_model
        self.head = None                 # reads through block 0's readout (buffers below)
        self.norm_out = None
        self.register_buffer("readout_norm_weight", torch.ones(d))
        self.register_buffer("readout_norm_bias", torch.zeros(d))
        self.register_buffer("readout_weight", torch.zeros(cfg.vocab_size, d))
        self.register_buffer("readout_bias", torch.zeros(cfg.vocab_size))
        for layer in self.layers:
            for lin in (layer.attn.proj, layer.mlp.out):
                nn.init.zeros_(lin.weight)
                nn.init.zeros_(lin.bias)

    @torch.no_grad()
    def adopt_readout(self, first: ForwardChainedBlock) -> None:
        """Copy block 0's final norm and head (from its snapshot) into this block's readout."""
        self.readout_norm_weight.copy_(first.norm_out.weight)
        self.readout_norm_bias.copy_(first.norm_out.bias)
        self.readout_weight.copy_(first.head.weight)
        self.readout_bias.copy_(first.head.bias)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.first:
            return super().logits(h)
        h = F.layer_norm(h, (h.shape[-1],), self.readout_norm_weight.to(h.dtype), self.readout_norm_bias.to(h.dtype))
        return F.linear(h, self.readout_weight.to(h.dtype), self.readout_bias.to(h.dtype))
