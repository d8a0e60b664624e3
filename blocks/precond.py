"""EDM preconditioning as a thin wrapper around a raw network (Karras et al. 2022; k-diffusion's
``Denoiser``): D(z; sigma) = c_skip(sigma) * z + c_out(sigma) * F(c_in(sigma) * z; c_noise(sigma))."""
from __future__ import annotations

import torch
from torch import nn

from .schedule import edm_coefficients


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
