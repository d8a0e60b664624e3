"""Noise schedule: a truncated log-normal over [sigma_min, sigma_max] cut into B equal-mass ranges.

EDM (Karras et al. 2022) samples training noise as ln(sigma) ~ N(P_mean, P_std^2). DiffusionBlocks
truncates that density to [sigma_min, sigma_max] and gives each block a range of equal probability
mass, so every block gets an equally hard share of the denoising work. Block 0 holds the HIGHEST
noise (it starts the chain from pure noise), block B-1 the lowest.

Mass is measured from the top: u = 0 at sigma_max, u = 1 at sigma_min; block b owns
u in [b/B, (b+1)/B], widened by ``overlap`` of one block's mass on each side (clipped).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...config import ModelConfig

_SQRT2 = math.sqrt(2.0)


def _ndtr(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(x / _SQRT2))


@dataclass(frozen=True)
class EDMCoefficients:
    c_skip: torch.Tensor
    c_out: torch.Tensor
    c_in: torch.Tensor
    c_noise: torch.Tensor


def edm_coefficients(sigma: torch.Tensor, sigma_data: float) -> EDMCoefficients:
    """EDM preconditioning (Karras et al. 2022, Table 1)."""
    sigma = torch.as_tensor(sigma)
    sd2 = sigma_data**2
    denom = sigma**2 + sd2
    return EDMCoefficients(
        c_skip=sd2 / denom,
        c_out=sigma * sigma_data / denom.sqrt(),
        c_in=1.0 / denom.sqrt(),
        c_noise=sigma.log() / 4.0,
    )


def edm_loss_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma * sigma_data)^2 = 1 / c_out^2."""
    sigma = torch.as_tensor(sigma)
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


class NoiseSchedule:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.n_blocks = cfg.n_blocks
        self.sigma_min, self.sigma_max = cfg.sigma_min, cfg.sigma_max
        self.p_mean, self.p_std = cfg.p_mean, cfg.p_std
        self.overlap = cfg.overlap
        lo = (math.log(cfg.sigma_min) - cfg.p_mean) / cfg.p_std
        hi = (math.log(cfg.sigma_max) - cfg.p_mean) / cfg.p_std
        self._phi_lo = float(_ndtr(torch.tensor(lo, dtype=torch.float64)))
        self._phi_hi = float(_ndtr(torch.tensor(hi, dtype=torch.float64)))
        if not self._phi_hi - self._phi_lo > 1e-12:
            raise ValueError(
                "the log-normal (p_mean, p_std) puts no mass on [sigma_min, sigma_max]; "
                "move p_mean into the range or widen p_std"
            )

    # -- mass <-> sigma (mass from the top: u=0 at sigma_max) -----------------------------------
    def mass_above(self, sigma: torch.Tensor) -> torch.Tensor:
        """Probability mass of the truncated density above ``sigma`` (0 at sigma_max, 1 at sigma_min)."""
        sigma = torch.as_tensor(sigma, dtype=torch.float64)
        z = (sigma.log() - self.p_mean) / self.p_std
        cdf = (_ndtr(z) - self._phi_lo) / (self._phi_hi - self._phi_lo)
        return (1.0 - cdf).clamp(0.0, 1.0)

    def sigma_at_mass(self, u: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`mass_above`."""
        u = torch.as_tensor(u, dtype=torch.float64).clamp(0.0, 1.0)
        p = self._phi_lo + (1.0 - u) * (self._phi_hi - self._phi_lo)
        p = p.clamp(1e-15, 1 - 1e-15)
        z = torch.special.ndtri(p)
        return (self.p_mean + self.p_std * z).exp().clamp(self.sigma_min, self.sigma_max)

    # -- partition -----------------------------------------------------------------------------
    def boundaries(self) -> torch.Tensor:
        """B+1 sigmas, descending: [sigma_max, ..., sigma_min]. Block b steps from [b] to [b+1]."""
        u = torch.linspace(0.0, 1.0, self.n_blocks + 1, dtype=torch.float64)
        s = self.sigma_at_mass(u)
        s[0], s[-1] = self.sigma_max, self.sigma_min
        return s

    def mass_range(self, b: int) -> tuple[float, float]:
        if not 0 <= b < self.n_blocks:
            raise IndexError(f"block index {b} out of range [0, {self.n_blocks})")
        w = 1.0 / self.n_blocks
        lo = max(0.0, b * w - self.overlap * w)
        hi = min(1.0, (b + 1) * w + self.overlap * w)
        return lo, hi

    def block_range(self, b: int) -> tuple[float, float]:
        """(sigma_low, sigma_high) that block b is trained on (overlap included)."""
        lo_u, hi_u = self.mass_range(b)
        return float(self.sigma_at_mass(torch.tensor(hi_u))), float(self.sigma_at_mass(torch.tensor(lo_u)))

    def sample(self, b: int, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """n noise levels for block b, drawn from the truncated log-normal restricted to its range."""
        lo_u, hi_u = self.mass_range(b)
        u = lo_u + (hi_u - lo_u) * torch.rand(n, generator=generator, dtype=torch.float64)
        return self.sigma_at_mass(u).float()
