"""The raw network of one block: F_theta(context bytes, scaled noisy state, noise level).

Input at position t: the block's OWN embedding of the clean context byte x_t, plus a projection of
the (already c_in-scaled) noisy state at t, plus a learned position embedding. The noise level
conditions every layer through adaLN (adaLN-single: one shared projection, per-layer offsets).
Attention is causal, so the output at t depends only on positions <= t. The EDM preconditioning lives in ``precond.py``, not here (as in k-diffusion).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import NoiseEmbedding, TransformerLayer, init_weights


class BlockDenoiser(nn.Module):
    def __init__(self, cfg: ModelConfig, out_dim: int, in_dim: int | None = None,
                 n_layers: int | None = None, context_vocab: int | None = None):
        super().__init__()
        d = cfg.d_model
        self.byte_emb = nn.Embedding(context_vocab or cfg.vocab_size, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d)
        self.state_proj = nn.Linear(in_dim or cfg.target_dim, d)
        self.noise_emb = NoiseEmbedding(d)
        self.layers = nn.ModuleList(
            TransformerLayer(d, cfg.n_heads, cfg.mlp_ratio, cfg.dropout, modulated=True)
            for _ in range(n_layers or cfg.layers_per_block)
        )
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))   # adaLN-single, shared by layers
        self.norm_out = nn.LayerNorm(d)
        self.head = nn.Linear(d, out_dim)
        init_weights(self)
        nn.init.zeros_(self.modulation[1].weight)   # zero modulation: layers start unconditioned
        nn.init.zeros_(self.modulation[1].bias)
        nn.init.zeros_(self.head.weight)  # F starts at 0: D = c_skip * z, logits uninformative
        nn.init.zeros_(self.head.bias)

    def forward(self, context: torch.Tensor, x_in: torch.Tensor, c_noise: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """context (N,T) long, x_in (N,T,in_dim), c_noise (N,) or (N,T) -> (N,T,out_dim)."""
        t = context.shape[1]
        pos = torch.arange(t, device=context.device)
        h = self.byte_emb(context) + self.pos_emb(pos) + self.state_proj(x_in)
        modulation = self.modulation(self.noise_emb(c_noise))
        for layer in self.layers:
            h = layer(h, modulation, attn_mask)
        return self.head(self.norm_out(h))
