"""Robust acceptance of an averaged block before it replaces the local weights.

hivemind can return a silently partial average when a peer dies mid-round, and a hostile peer
can push NaN, huge or random weights. A round's result lands only if (1) every value is finite,
(2) the change is small relative to the local weights, and (3) the block's loss on a few fixed
held-out windows does not get much worse.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class AcceptancePolicy:
    max_relative_change: float = 1.0     # ||avg - local|| <= this * ||local|| (1000x-scaled weights fail)
    max_loss_increase: float = 0.5       # nats: check loss(avg) <= check loss(local) + this


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str
    relative_change: float = float("nan")
    loss_local: float = float("nan")
    loss_averaged: float = float("nan")


def judge(local: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor], policy: AcceptancePolicy,
          check_loss: Callable[[Sequence[torch.Tensor]], float] | None = None) -> Verdict:
    if len(local) != len(averaged) or any(a.shape != b.shape for a, b in zip(local, averaged)):
        return Verdict(False, "shape mismatch between local and averaged tensors")
    if not all(bool(torch.isfinite(a).all()) for a in averaged):
        return Verdict(False, "non-finite values in the averaged weights")
    num = math.sqrt(sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(averaged, local)))
    den = math.sqrt(sum(float(b.double().pow(2).sum()) for b in local)) + 1e-12
    rel = num / den
    if rel > policy.max_relative_change:
        return Verdict(False, f"change too large: {rel:.3g} x the local weights "
                              f"(limit {policy.max_relative_change})", rel)
    if check_loss is None:
        return Verdict(True, "ok", rel)
    l_local, l_avg = check_loss(local), check_loss(averaged)
    if not math.isfinite(l_avg) or l_avg > l_local + policy.max_loss_increase:
        return Verdict(False, f"held-out check loss rose from {l_local:.3f} to {l_avg:.3f}", rel, l_local, l_avg)
    return Verdict(True, "ok", rel, l_local, l_avg)
