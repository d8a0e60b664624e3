"""The chain: blocks composed as one Euler denoising pass from sigma_max down to sigma_min.

A block is seen by the chain as a *hop*: a callable taking the noisy state at sigma and
returning the state at sigma_next (plus, on request, next-byte logits). The chain never
touches parameters, so the same code drives local modules and remote peers (the node passes
callables that make RPCs). One traversal calls each of the B hops exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch


@dataclass
class HopRequest:
    state: torch.Tensor        # (N, T, D) noisy state at sigma
    context: torch.Tensor      # (N, T) long: the byte the model conditions on at each position
    sigma: torch.Tensor        # (N,) noise level of ``state``
    sigma_next: torch.Tensor   # (N,) noise level to step to
    want_logits: bool = False

    def to(self, device: torch.device | str) -> "HopRequest":
        """The same request with its tensors on ``device`` (dtypes unchanged)."""
        return HopRequest(self.state.to(device), self.context.to(device), self.sigma.to(device),
                          self.sigma_next.to(device), self.want_logits)


@dataclass
class HopResult:
    state: torch.Tensor                 # (N, T, D) at sigma_next
    logits: torch.Tensor | None = None  # (N, T, V) next-byte logits computed at sigma

    def to(self, device: torch.device | str) -> "HopResult":
        return HopResult(self.state.to(device), None if self.logits is None else self.logits.to(device))


class Hop(Protocol):
    def __call__(self, request: HopRequest) -> HopResult: ...


def euler_step(z: torch.Tensor, denoised: torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor) -> torch.Tensor:
    """One Euler step of the probability-flow ODE dz/dsigma = (z - D) / sigma."""
    ratio = (sigma_next / sigma).to(z.dtype).view(-1, *([1] * (z.dim() - 1)))
    return denoised + ratio * (z - denoised)


class CountingHop:
    """Wraps a hop and counts its calls (tests and benchmarks assert traversal counts)."""

    def __init__(self, hop: Hop):
        self.hop, self.calls = hop, 0

    def __call__(self, request: HopRequest) -> HopResult:
        self.calls += 1
        return self.hop(request)


def traverse(hops: Sequence[Hop], sigmas: torch.Tensor, state: torch.Tensor, context: torch.Tensor,
             *, logits_from: str = "last",
             update_context: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run one traversal of the block stack.

    ``sigmas`` holds B+1 descending levels; hop b steps from sigmas[b] to sigmas[b+1].
    ``logits_from``: "last" asks only the final hop for logits; "all" asks every hop
    (one-sweep generation re-reads its running byte estimate after each hop through
    ``update_context(b, logits, context) -> context``). Returns (final state, last logits).
    """
    if len(hops) + 1 != len(sigmas):
        raise ValueError(f"{len(hops)} hops need {len(hops) + 1} noise levels, got {len(sigmas)}")
    n = state.shape[0]
    logits = None
    for b, hop in enumerate(hops):
        want = logits_from == "all" or b == len(hops) - 1
        s = sigmas[b].to(state.dtype).expand(n).contiguous()
        s_next = sigmas[b + 1].to(state.dtype).expand(n).contiguous()
        out = hop(HopRequest(state, context, s, s_next, want_logits=want))
        state, logits = out.state, out.logits
        if want and logits is None:
            raise RuntimeError(f"hop {b} returned no logits although they were requested")
        if update_context is not None and logits is not None:
            context = update_context(b, logits, context)
    return state, logits
