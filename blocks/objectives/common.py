"""Small helpers shared by objectives."""
from __future__ import annotations

import torch


def prepare_prompt(prompt: bytes, n_bytes: int, seq_len: int, *, one_sweep: bool) -> bytes:
    """Validate a generation request and cut the prompt to what the context window can hold."""
    if not isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be bytes")
    if n_bytes < 1:
        raise ValueError(f"n_bytes must be >= 1, got {n_bytes}")
    p = bytes(prompt) or b"\n"
    if one_sweep:
        if n_bytes > seq_len - 1:
            raise ValueError(f"one-sweep generation emits at most seq_len-1 = {seq_len - 1} bytes, "
                             f"asked for {n_bytes}")
        keep = seq_len - n_bytes + 1
        return p[-keep:]
    return p[-seq_len:]


def stratified_uniform(m: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """m float64 draws in [0, 1), one in each interval [i/m, (i+1)/m) shifted by one common offset,
    in random order: uniform marginals with low discrepancy over a batch."""
    u = (torch.rand(1, generator=generator, dtype=torch.float64) + torch.arange(m, dtype=torch.float64) / m) % 1.0
    return u[torch.randperm(m, generator=generator)]
