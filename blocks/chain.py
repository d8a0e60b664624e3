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


def ask_logits(hop: Hop, req: HopRequest, b: int) -> HopResult:
    """Call hop b with ``want_logits`` set; a hop that answers no logits is an error."""
    out = hop(HopRequest(req.state, req.context, req.sigma, req.sigma_next, want_logits=True))
    if out.logits is None:
        raise RuntimeError(f"hop {b} returned no logits although they were requested")
    return out


def hop_levels(levels: torch.Tensor, b: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma, sigma_next) of hop b, one per sample of ``like`` (N, ...), on its device and dtype."""
    n = like.shape[0]
    return tuple(levels[i].to(like.device, like.dtype).expand(n).contiguous() for i in (b, b + 1))


def traverse(hops: Sequence[Hop], levels: torch.Tensor, state: torch.Tensor, context: torch.Tensor,
             *, logits_from: str = "last",
             update_context: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run one traversal of the block stack.

    ``levels`` holds B+1 descending noise levels; hop b steps from levels[b] to levels[b+1].
    ``logits_from``: "last" asks only the final hop for logits, "all" every hop, "none" no hop.
    One-sweep generation re-reads its running byte estimate after each hop through
    ``update_context(b, logits, context) -> context``. Returns (final state, the logits of the
    hops asked for them, in order).
    """
    if logits_from not in ("last", "all", "none"):
        raise ValueError(f"logits_from must be last, all or none, got {logits_from!r}")
    if len(hops) + 1 != len(levels):
        raise ValueError(f"{len(hops)} hops need {len(hops) + 1} noise levels, got {len(levels)}")
    logits = []
    for b, hop in enumerate(hops):
        want = logits_from == "all" or (logits_from == "last" and b == len(hops) - 1)
        req = HopRequest(state, context, *hop_levels(levels, b, state))
        out = ask_logits(hop, req, b) if want else hop(req)
        state = out.state
        if want:
            logits.append(out.logits)
            if update_context is not None:
                context = update_context(b, out.logits, context)
    return state, logits
