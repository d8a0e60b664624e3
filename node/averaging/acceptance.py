"""Robust acceptance of an averaged block before it replaces the local weights.

hivemind can return a silently partial average when a peer dies mid-round, and a hostile peer
can push NaN, huge or random weights. A round's result lands only if (1) every value is finite,
(2) the change is not huge relative to the local weights (``hard_relative_change``: 1000x-scaled
weights are far beyond it), (3) a change larger than ``max_relative_change`` (a
replica that drifted, or restarted from an old checkpoint, catching up with its group) at least
does not raise the block's loss on a few fixed held-out windows (``large_change_loss_slack``),
and (4) any change raises that check loss by at most ``max_loss_increase``.

Why two tiers: early in training, or after a restart from an old checkpoint, an honest replica's
weights can differ from its group's by many times their own norm (measured: 15x for a replica
restarted after ~1 minute of its group's training), so a change-size limit alone would either
lock stale replicas out for good or let large poison through; the held-out check loss tells a
catch-up (loss falls) from poison (loss rises). Limitation: poison that keeps the check loss
within these margins on the fixed check windows (which a determined attacker can learn) is not
detected; the margins bound how much each accepted round can move the weights.

Before that, ``check_group`` vets who was in the group (every member's gathered metadata agrees
on config and tensor layout and names the member's own peer id, no member is banned, and in a
private run every member is allowed). Bans themselves live in ``node/routing/bans.py``.

Attribution limit: an all-reduce result is the weighted mean of every member's tensors, and a
member only sees the mean, so a poisoned round cannot be pinned on one member of a group of 3+
without extra verification (e.g. each member re-sending its contribution for a spot check). So a
rejected round is blamed on every non-self member: in a group of two the blame is exact and the
ban long (``ban_seconds``, doubling for repeat offenders); in a larger group each member gets a
short collateral ban (``collateral_seconds``), also doubling with strikes, and an honest member
clears its strikes the next time it is in an accepted round, while a repeat offender's bans grow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch


@dataclass(frozen=True)
class AcceptancePolicy:
    max_relative_change: float = 1.0     # ||avg - local|| above this * ||local|| must not raise the check loss
    max_loss_increase: float = 0.5       # nats: check loss(avg) <= check loss(local) + this
    hard_relative_change: float = 100.0  # above this * ||local||: rejected outright (e.g. 1000x-scaled weights)
    large_change_loss_slack: float = 0.1  # nats a large (but not huge) change may cost


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str
    relative_change: float | None = None   # None where not measured (or not finite): stays JSON-safe
    loss_local: float | None = None
    loss_averaged: float | None = None
    offenders: tuple[str, ...] = ()      # group members blamed for a rejection (banned for a while)

    def __post_init__(self) -> None:
        for name in ("relative_change", "loss_local", "loss_averaged"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                object.__setattr__(self, name, None)


_PIECE = 1 << 18   # elements summed at a time: a float64 copy of 2 MiB at most


def _pieces(tensors: Sequence[torch.Tensor]):
    for t in tensors:
        yield from t.detach().reshape(-1).split(_PIECE)


def tensors_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of a list of tensors, summed in float64 a piece at a time (no copy of the block)."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2 for x in _pieces(tensors)))


def judge(change: Sequence[torch.Tensor], policy: AcceptancePolicy, *, local_norm: float,
          check_losses: Callable[[], tuple[float, float]] | None = None) -> Verdict:
    """Judge a round by the change it makes: ``change`` is the group's mean minus the weights we
    sent, tensor by tensor; ``local_norm`` the norm of those weights. ``check_losses`` (for blocks
    that have a loss alone) returns the held-out check loss of the weights sent and of the average."""
    if not all(bool(torch.isfinite(x).all()) for x in _pieces(change)):
        return Verdict(False, "non-finite values in the averaged weights")
    rel = tensors_norm(change) / (local_norm + 1e-12)
    if rel > policy.hard_relative_change or (check_losses is None and rel > policy.max_relative_change):
        limit = policy.hard_relative_change if check_losses is not None else policy.max_relative_change
        return Verdict(False, f"change too large: {rel:.3g} x the local weights (limit {limit})", rel)
    if check_losses is None:
        return Verdict(True, "ok", rel)
    l_local, l_avg = check_losses()
    if rel > policy.max_relative_change and not l_avg <= l_local + policy.large_change_loss_slack:
        return Verdict(False, f"large change ({rel:.3g} x the local weights, over {policy.max_relative_change}) "
                              f"that does not keep the held-out check loss ({l_local:.3f} -> {l_avg:.3f})",
                       rel, l_local, l_avg)
    if not math.isfinite(l_avg) or l_avg > l_local + policy.max_loss_increase:
        return Verdict(False, f"held-out check loss rose from {l_local:.3f} to {l_avg:.3f}", rel, l_local, l_avg)
    return Verdict(True, "ok", rel, l_local, l_avg)


def check_group(gathered: Mapping[str, Any], *, self_peer: str, config_hash: str, n_tensors: int,
                authorize: Callable[[str], bool] | None = None,
                banned: Callable[[str], bool] | None = None) -> Verdict | None:
    """Membership checks on a round's gathered metadata ({peer id: metadata}); None if all good.

    Peer ids are the all-reduce group's libp2p ids (authenticated by the transport), not what a
    member claims about itself; a member whose metadata names another peer is a forger.
    """
    others = [p for p in gathered if p != self_peer]
    if not others:
        return Verdict(False, "the group holds no other peer")
    if authorize is not None:
        outsiders = tuple(sorted(p for p in others if not authorize(p)))
        if outsiders:
            return Verdict(False, f"group holds peer(s) not allowed in this private run: {', '.join(outsiders)}",
                           offenders=outsiders)
    if banned is not None:
        bad = tuple(sorted(p for p in others if banned(p)))
        if bad:
            return Verdict(False, f"group holds banned peer(s): {', '.join(bad)}", offenders=bad)
    wrong = []
    for p in others:
        g = gathered[p]
        if (not isinstance(g, dict) or g.get("config_hash") != config_hash or g.get("n_tensors") != n_tensors
                or ("peer" in g and g.get("peer") != p)):
            wrong.append(p)
    if wrong:
        return Verdict(False, "group members disagree on config or tensor layout, or forge their peer id: "
                              + ", ".join(sorted(wrong)), offenders=tuple(sorted(wrong)))
    return None


# -- did the all-reduce average everything? ------------------------------------------------------
SKETCH_SIZE = 8


def weight_sketch(tensors: Sequence[torch.Tensor]) -> list[float]:
    """A linear fingerprint of a block's weights: sums over SKETCH_SIZE interleaved slices of the
    flattened tensors (element k of the concatenation goes to slice k mod SKETCH_SIZE). Linear, so
    the sketch of a weighted mean is the weighted mean of sketches, and every slice draws on every
    tensor part the all-reduce moves. Summed in float64 a piece of a tensor at a time (a float64
    concatenation of the block was 2-4x its weights)."""
    sums = [0.0] * SKETCH_SIZE
    offset = 0
    for flat in _pieces(tensors):
        for j in range(SKETCH_SIZE):
            start = (j - offset) % SKETCH_SIZE
            if start < flat.numel():
                sums[j] += float(flat[start::SKETCH_SIZE].sum(dtype=torch.float64))
        offset += flat.numel()
    return sums


def round_completeness(own: Sequence[float], result: Sequence[float],
                       members: Sequence[tuple[float, Sequence[float]]], min_move: float = 1e-4) -> float | None:
    """How much of the way from our weights to the group's weighted mean the round moved us, read
    off the sketches: 1.0 for a complete average, about the averaged fraction for a partial one
    (hivemind leaves the parts of a failed reducer unchanged), None when the members' weights were
    too close to tell (then a partial round changes nothing anyway).

    ``members``: (weight, sketch) of every group member, ourselves included, as gathered."""
    total = sum(w for w, _ in members)
    if total <= 0 or not members:
        return None
    mean = [sum(w * s[j] for w, s in members) / total for j in range(len(own))]
    want = [m - o for m, o in zip(mean, own)]
    got = [r - o for r, o in zip(result, own)]
    scale = math.sqrt(sum(m * m for m in mean)) + 1.0
    want2 = sum(x * x for x in want)
    if math.sqrt(want2) < min_move * scale:
        return None
    return sum(a * b for a, b in zip(got, want)) / want2   # projection of the move onto the wanted move
