"""The network of one ``chunked-continuous`` block, and the posterior it is wrapped in.

Layout as chunked-masked's network (``../chunked_masked/net.py``: [noisy || clean] streams,
block-causal mask, BD3-LM): chunk c of the noisy stream attends to itself (bidirectionally) and to
the clean chunks before it, so every chunk of a window is denoised in one pass and chunk c reads
only its own noisy state and x_0..x_{c*k}. The noisy stream carries continuous states instead of byte ids:

* ``ChunkedContinuousNet`` is the raw network F(context, x_in, c_noise) -> (N, T, 256) logits. The
  noisy input is the EDM-scaled state x_in = z / sqrt(sigma^2 + sigma_data^2) through a linear
  map, plus a Fourier embedding of c_noise = log(sigma) / 4 (per position: every chunk of a training
  window has its own noise level), plus, at a chunk's first position, an embedding of the clean byte
  before it (issue 8's prototype showed that positions need their legal previous byte).
* ``ChunkedContinuousBlock`` is the preconditioning, kept apart from the network as k-diffusion
  keeps EDM's: it turns F into the posterior over byte i's value given the noisy chunk,
      log p(y_i = v | z, clean history) = F_v + <z_i, e_v> / sigma^2 + const,
  i.e. F plays a prior over the byte and the second term is the exact Gaussian likelihood of z_i
  under z_i = e(y_i) + sigma * eps (rows of the fixed target table e all have the same norm, so
  -|e_v|^2 / 2 sigma^2 is a constant). The denoiser is the posterior mean D = softmax(.) @ e.
  At low sigma the likelihood dominates and D -> e(y) without any training, so the bound's
  integrand stays finite down to sigma_min; the network learns what the likelihood cannot know.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...config import ModelConfig
from ...layers import NoiseEmbedding, init_weights
from ...target import TargetEmbedding
from ..chunked_masked.net import MASK_ID, ChunkedMaskedNet

NO_BYTE = MASK_ID      # the "previous byte" id of a position whose previous byte is noisy


def sigma_to_c_noise(sigma: torch.Tensor) -> torch.Tensor:
    return sigma.float().log() / 4


class ChunkedContinuousNet(ChunkedMaskedNet):
    """chunked-masked's network (same streams, mask, layers and zero-initialised head) with a
    continuous noisy stream: the byte-id embedding of a noisy position is replaced by a linear map
    of its scaled state plus a noise-level embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        d = cfg.d_model
        self.in_proj = nn.Linear(cfg.target_dim, d)
        self.noise_emb = NoiseEmbedding(d)
        init_weights(self.in_proj)
        init_weights(self.noise_emb)

    def forward(self, context: torch.Tensor, x_in: torch.Tensor, c_noise: torch.Tensor) -> torch.Tensor:
        """context (N, T) clean previous bytes, x_in (N, T, D) scaled noisy state, c_noise (N, T)
        -> (N, T, 256) prior logits of y_i at every noisy position."""
        n, t, _ = x_in.shape
        dev = x_in.device
        prev = torch.full((n, t), NO_BYTE, dtype=torch.long, device=dev)
        starts = torch.arange(0, t, self.k, device=dev)
        prev[:, starts] = context[:, starts]
        pos = torch.arange(t, device=dev)
        h_noisy = (self.in_proj(x_in) + self.noise_emb(c_noise) + self.prev_emb(prev)
                   + self.pos_emb(pos) + self.stream_emb.weight[0])
        return self.run_streams(h_noisy, context)


class ChunkedContinuousBlock(nn.Module):
    """Posterior over each noisy byte given the noisy chunk and the clean history (module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.sigma_data = cfg.sigma_data
        self.net = ChunkedContinuousNet(cfg)
        self.target = TargetEmbedding(cfg)

    def forward(self, context: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """context (N, T), z (N, T, D), sigma (N, T) per position -> (N, T, 256) posterior logits (fp32)."""
        sig = sigma.float().unsqueeze(-1)
        x_in = z.float() / torch.sqrt(sig**2 + self.sigma_data**2)
        prior = self.net(context, x_in.to(z.dtype) if z.dtype != torch.float32 else x_in,
                         sigma_to_c_noise(sigma)).float()
        with torch.autocast(z.device.type, enabled=False):
            likelihood = torch.einsum("ntd,vd->ntv", z.float(), self.target.table.float()) / sig**2
        return prior + likelihood

    def denoise(self, logits: torch.Tensor) -> torch.Tensor:
        """Posterior mean of the clean embedding, (N, T, 256) -> (N, T, D), in fp32 under any autocast."""
        with torch.autocast(logits.device.type, enabled=False):
            return torch.softmax(logits.float(), dim=-1) @ self.target.table.float()


def log_uniform(lo: float, hi: float, u: torch.Tensor) -> torch.Tensor:
    """Map u in [0, 1) to sigma = lo * (hi/lo)^u."""
    return lo * torch.exp(u * math.log(hi / lo))
