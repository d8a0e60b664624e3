"""Small helpers shared by objectives."""
from __future__ import annotations

import torch


def stratified_uniform(m: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """m float64 draws in [0, 1), one in each interval [i/m, (i+1)/m) shifted by one common offset,
    in random order: uniform marginals with low discrepancy over a batch."""
    u = (torch.rand(1, generator=generator, dtype=torch.float64) + torch.arange(m, dtype=torch.float64) / m) % 1.0
    return u[torch.randperm(m, generator=generator)]
