"""The network of one ``paper`` block: the raw denoiser F, its EDM preconditioning, and the
next-byte readout that makes them a block.

``BlockDenoiser`` is the raw network F_theta(context bytes, scaled noisy state, noise level).
Input at position t: the block's OWN embedding of the clean context byte x_t, plus a projection of
the (already c_in-scaled) noisy state at t, plus a learned position embedding. The noise level
conditions every layer through adaLN (adaLN-single: one shared projection, per-layer offsets).
Attention is causal, so the output at t depends only on positions <= t.

``EDMPrecond`` is the preconditioning, a thin wrapper kept apart from F (Karras et al. 2022; k-diffusion's
``Denoiser``): D(z; sigma) = c_skip(sigma) * z + c_out(sigma) * F(c_in(sigma) * z; c_noise(sigma)).

``PaperBlock`` reads next-byte logits off D against the fixed target table (see ``objective.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ...layers import NoiseEmbedding, TransformerLayer, init_weights
from ...target import TargetEmbedding
from .schedule import edm_coefficients


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


class EDMPrecond(nn.Module):
    def __init__(self, net: nn.Module, sigma_data: float):
        super().__init__()
        self.net = net
        self.sigma_data = sigma_data

    def forward(self, z: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """z (N,T,D) noisy state, sigma (N,) per sequence -> denoised estimate D (N,T,D)."""
        c = edm_coefficients(sigma.to(z.dtype).view(-1, 1, 1), self.sigma_data)
        f = self.net(context, c.c_in * z, c.c_noise.view(-1), attn_mask)
        return c.c_skip * z + c.c_out * f.to(z.dtype)


class PaperBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.sigma_data = cfg.sigma_data
        self.precond = EDMPrecond(BlockDenoiser(cfg, out_dim=cfg.target_dim), cfg.sigma_data)
        self.target = TargetEmbedding(cfg)
        self.logit_scale = nn.Parameter(torch.zeros(()))
        self.logit_bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, z: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor):
        d = self.precond(z, sigma, context)
        weight = self.target.table.to(d.dtype) * (self.logit_scale.exp() / self.sigma_data**2)
        logits = F.linear(d, weight, self.logit_bias)   # one fused op: one saved activation
        return d, logits
