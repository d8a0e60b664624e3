"""Server-side block selection: which block a node takes when it joins, and when it should move.

Apart from client routing (``router.py``), as in Petals (``server/block_selection.py``).

**Joining** (:func:`choose_block`): a node that joins without ``--block`` takes the block with the
fewest live holders; ties go to the block whose holders report the least total throughput, then
to the lowest index.

**Rebalancing** (:func:`choose_rebalance`), evaluated by a serving node once per announcement
period (TTL/3). Let ``n[b]`` be the live holders of block b as announced (see :func:`block_load`;
this node counted in its own block) and ``t`` the block :func:`choose_block` would pick (the
neediest).
The node moves from its block ``m`` to ``t`` only if all of these hold:

1. it has held ``m`` for at least ``min_dwell_s`` (a node that just arrived or moved stays put);
2. ``n[m] - n[t] >= min_surplus`` (default 2: a move then strictly lowers the spread, so the
   move cannot be undone by the same rule: with a surplus of 1 two nodes would swap forever);
3. ``n[m] - 1 >= min_keep`` and ``r[m] - 1 >= min_keep`` (default 2: the block it leaves keeps at
   least two live holders and two *ready* ones, ``r`` from :func:`ready_load`: online, not still
   downloading; so the rule never leaves a block without a holder, nor with only one);
4. ``draw < p`` where ``draw`` is the caller's uniform random number in [0, 1) and
   ``p = min(1, eagerness * deficit / donors)``: ``deficit = max(1, floor(mean n) - n[t])`` is
   how many holders ``t`` lacks, ``donors`` the holders of every block that passes 2 and 3
   against ``t``. Every donor checks once per period, so one period moves ``eagerness * deficit``
   nodes in expectation (default half the deficit), not every surplus holder at once (Petals
   staggers its servers' checks for the same reason).

5. **Short blocks** (checked first, no dwell), in two tiers. A block with ``r`` ready holders and
   ``k = n - r`` holders on their way wants ``RebalancePolicy.wanted(r, k)`` more movers:
   *urgent* below ``urgent_below`` ready holders (default 2: one ready holder, or none), up to
   ``urgent_inflight`` (default 3) on their way; *reserve* below ``reserve_below`` ready holders
   (``reserve_below``: 0 turns the tier off), up to ``reserve_inflight`` (default 1) on their way, so a
   block at 2 ready holders has a rescuer downloading before its next departure leaves it at one.
   Let ``u`` be the block with the fewest ready holders among those that want movers (a block that
   already has enough on their way does not hide a second one in danger). A node whose block keeps
   two live and two ready holders (rule 3) and has at least ``min_surplus`` more ready holders than
   ``u`` moves to ``u`` with probability ``eagerness * wanted / donors`` (``donors`` the ready
   holders of every such block), or if rules 1-4 pick ``u`` anyway; while a block wants movers its
   rescuers make no ordinary move elsewhere. A block at one ready holder empties if that holder
   leaves before a rescuer has finished downloading; the simulator found those to be most of the
   remaining empty episodes (``bench/sim``: ``episodes`` says, per episode, how the last holder
   went, how long it had been alone and how many were downloading). The rule cannot flap: it only
   takes from blocks that keep two ready holders and have ``min_surplus`` more than ``u``, so a
   donor never becomes needier than ``u`` was. On one stale view shared by every node it overshoots
   more than rules 1-4 (``tests/test_selection.py``).

Nodes that check one after another, each seeing the moves announced before it, converge without
any node moving back to a block it left (``tests/test_selection.py``). Nodes deciding on one stale
snapshot can overshoot (the draws are independent); then a few extra moves follow, and rarely a
node returns to a block it left; the default eagerness of 0.5 keeps that rare.

The policy is a pure function of its inputs (the caller supplies the random draw), so a node and
the simulator (``bench/sim``) run the same code. Moving is *make before break*, the node's job:
announce the new block as ``joining`` and download it while still serving the old one, then
withdraw the old announcement. Meanwhile :func:`block_load` counts the mover in the block it is
joining and not in the one it is leaving: the others neither rush to fill the same hole nor leave
the old block believing the mover will stay (with a consistent view, rule 3 then holds for the
block as it will be once every move in flight has finished). The view can still be inconsistent: two
donors that check within one period, before either's ``joining`` record is stored, both pass rule 3 on
a view without the other. So just before the switch the node reads the view again and switches only if
:func:`may_switch` on :func:`switch_counts` says so: the old block keeps ``min_keep`` ready holders, or
more than the new one will have; movers out of one block are told apart by peer id (the smaller goes).
Before this check (CI 83, 2026-12-06) two such donors both switched and one moved back.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "HolderRecord", "Holder", "RebalancePolicy", "block_load", "ready_load", "least_held", "choose_block",
    "rebalance_target", "choose_rebalance", "switch_counts", "may_switch",
]


class HolderRecord(Protocol):
    """What selection reads of one announcement (``p2p.records.BlockAnnouncement`` has all of it)."""

    @property
    def block_index(self) -> int: ...
    @property
    def peer_id(self) -> str: ...
    @property
    def state(self) -> str: ...          # "joining" | "online" | "leaving"
    @property
    def is_live(self) -> bool: ...       # joining or online
    @property
    def throughput(self) -> float: ...


@dataclass(frozen=True)
class Holder:
    """A light :class:`HolderRecord`, for the simulator and tests."""

    block_index: int
    peer_id: str
    state: str = "online"
    throughput: float = 0.0

    @property
    def is_live(self) -> bool:
        return self.state in ("joining", "online")


@dataclass(frozen=True)
class RebalancePolicy:
    """The rebalancing rule's knobs (see the module docstring)."""

    min_surplus: int = 2        # my block must have this many more live holders than the neediest one
    min_keep: int = 2           # holders my block keeps after I leave
    min_dwell_s: float = 600.0  # seconds I hold a block before I may leave it
    eagerness: float = 0.5      # expected fraction of the neediest block's deficit filled per period
    urgent_below: int = 2       # a block with fewer ready holders than this is urgent (0: no urgent rule)
    urgent_inflight: int = 3    # ... while fewer than this many holders are on their way to it
    reserve_below: int = 0      # a block with fewer ready holders than this (and >= urgent_below) is short (0: off)
    reserve_inflight: int = 1   # ... while fewer than this many holders are on their way to it

    def __post_init__(self) -> None:
        if self.min_surplus < 2:
            raise ValueError(f"min_surplus must be >= 2 (1 lets two nodes swap forever), got {self.min_surplus}")
        if self.min_keep < 1:
            raise ValueError(f"min_keep must be >= 1 (0 would let a node empty its block), got {self.min_keep}")
        if not self.min_dwell_s >= 0:
            raise ValueError(f"min_dwell_s must be >= 0, got {self.min_dwell_s}")
        if self.urgent_below < 0 or self.urgent_inflight < 1:
            raise ValueError(f"urgent_below must be >= 0 and urgent_inflight >= 1, got {self.urgent_below}, "
                             f"{self.urgent_inflight}")
        if self.reserve_below < 0 or self.reserve_inflight < 1:
            raise ValueError(f"reserve_below must be >= 0 and reserve_inflight >= 1, got {self.reserve_below}, "
                             f"{self.reserve_inflight}")
        if not 0 < self.eagerness <= 1:
            raise ValueError(f"eagerness must be in (0, 1], got {self.eagerness}")

    def wanted(self, ready: int, inflight: int) -> int:
        """Holders a block with ``ready`` ready holders and ``inflight`` on their way still wants moved to
        it without the dwell (rule 5): the urgent tier below ``urgent_below`` ready holders, the reserve
        tier below ``reserve_below``; 0 for a block that is safe enough."""
        if ready < self.urgent_below:
            return max(0, self.urgent_inflight - inflight)
        if ready < self.reserve_below:
            return max(0, self.reserve_inflight - inflight)
        return 0


def _counted(holders: Mapping[int, Sequence[HolderRecord]], n_blocks: int):
    """(block, record) for every live record that counts: a peer with live announcements for several
    blocks, one of them ``joining``, is moving (or came back on another block while its old record
    lives out its TTL): it counts only where it is joining."""
    live: dict[str, list[tuple[int, HolderRecord]]] = {}
    for b, anns in holders.items():
        if 0 <= b < n_blocks:
            for a in anns:
                if a.is_live:
                    live.setdefault(a.peer_id, []).append((b, a))
    for recs in live.values():
        if len(recs) > 1 and any(a.state == "joining" for _, a in recs):
            recs = [(b, a) for b, a in recs if a.state == "joining"]
        yield from recs


def block_load(holders: Mapping[int, Sequence[HolderRecord]], n_blocks: int) -> tuple[list[int], list[float]]:
    """Live holders (joining or online) and their total throughput per block 0..n_blocks-1 (other
    blocks are ignored); a mover counts only in the block it is joining (see :func:`_counted`)."""
    counts, tputs = [0] * n_blocks, [0.0] * n_blocks
    for b, a in _counted(holders, n_blocks):
        counts[b] += 1
        tputs[b] += a.throughput
    return counts, tputs


def ready_load(holders: Mapping[int, Sequence[HolderRecord]], n_blocks: int) -> list[int]:
    """Ready holders per block: the live holders of :func:`block_load` that are ``online`` (serving
    it, not still downloading it). A mover is ready nowhere: it is joining its new block and about to
    withdraw its old one."""
    ready = [0] * n_blocks
    for b, a in _counted(holders, n_blocks):
        ready[b] += a.state == "online"
    return ready


def least_held(counts: Sequence[int], throughputs: Sequence[float]) -> int:
    """The block with the fewest live holders; ties broken by least total throughput, then index."""
    return min(range(len(counts)), key=lambda b: (counts[b], throughputs[b], b))


def choose_block(holders: Mapping[int, Sequence[HolderRecord]], n_blocks: int) -> int:
    """The block a joining node takes: the fewest live holders; ties by least total throughput, then index."""
    return least_held(*block_load(holders, n_blocks))


def rebalance_target(counts: Sequence[int], throughputs: Sequence[float], my_block: int, *,
                     held_for_s: float, draw: float, policy: RebalancePolicy = RebalancePolicy(),
                     ready: Sequence[int] | None = None) -> int | None:
    """The rebalancing rule on per-block live counts (``counts[my_block]`` includes this node) and
    ready counts (``ready``, :func:`ready_load`; None: every live holder is ready).

    Returns the block to move to, or None to stay. Pure: the same inputs give the same answer.
    """
    n = len(counts)
    if not 0 <= my_block < n:
        raise ValueError(f"my_block {my_block} is out of range for {n} blocks")
    ready = counts if ready is None else ready
    if len(ready) != n:
        raise ValueError(f"ready has {len(ready)} blocks, counts {n}")

    def keeps(c: int) -> bool:     # block c keeps min_keep live and min_keep ready holders without one of them
        return counts[c] - 1 >= policy.min_keep and ready[c] - 1 >= policy.min_keep

    ordinary = _ordinary_target(counts, throughputs, my_block, held_for_s, draw, policy, keeps)
    short = [b for b in range(n) if policy.wanted(ready[b], counts[b] - ready[b]) > 0]
    if short:   # rule 5: the neediest short block (fewest ready holders) first
        u = min(short, key=lambda b: (ready[b], counts[b], throughputs[b], b))

        def rescuer(c: int) -> bool:
            return c != u and keeps(c) and ready[c] - ready[u] >= policy.min_surplus

        if rescuer(my_block):   # a block in danger first: no ordinary move elsewhere meanwhile
            donors = sum(ready[c] for c in range(n) if rescuer(c))
            wanted = policy.wanted(ready[u], counts[u] - ready[u])
            return u if ordinary == u or draw < min(1.0, policy.eagerness * wanted / donors) else None
    return ordinary


def _ordinary_target(counts: Sequence[int], throughputs: Sequence[float], my_block: int, held_for_s: float,
                     draw: float, policy: RebalancePolicy, keeps) -> int | None:
    """Rules 1-4 (the module docstring)."""
    n = len(counts)
    if held_for_s < policy.min_dwell_s:
        return None
    t = least_held(counts, throughputs)
    if t == my_block:
        return None

    def donor(c: int) -> bool:
        return c != t and counts[c] - counts[t] >= policy.min_surplus and keeps(c)

    if not donor(my_block):
        return None
    donors = sum(counts[c] for c in range(n) if donor(c))
    deficit = max(1, math.floor(sum(counts) / n) - counts[t])
    return t if draw < min(1.0, policy.eagerness * deficit / donors) else None


def choose_rebalance(holders: Mapping[int, Sequence[HolderRecord]], n_blocks: int, my_block: int,
                     my_peer_id: str, *, held_for_s: float, draw: float,
                     policy: RebalancePolicy = RebalancePolicy()) -> int | None:
    """Should this node (``my_peer_id``, holding ``my_block`` for ``held_for_s`` seconds) move, and where?

    ``holders``: block -> announcements, as ``Discovery.list_holders`` returns them (possibly stale:
    records of nodes that left stay until their TTL expires). ``draw``: a uniform random number in
    [0, 1) from the caller's own generator, fresh at every check (once per announcement period).
    Returns the block to move to, or None to stay. If this node's own live announcement is not in
    the view yet, it is counted anyway.
    """
    counts, tputs = block_load(holders, n_blocks)
    ready = ready_load(holders, n_blocks)
    if not any(a.peer_id == my_peer_id and a.is_live for a in holders.get(my_block, [])):
        counts[my_block] += 1
        ready[my_block] += 1
    return rebalance_target(counts, tputs, my_block, held_for_s=held_for_s, draw=draw, policy=policy, ready=ready)


def switch_counts(holders: Mapping[int, Sequence[HolderRecord]], n_blocks: int, leaving: int, joining: int,
                  my_peer_id: str) -> tuple[int, int]:
    """At a move's switch (make before break, its last step): the ready holders block ``leaving`` keeps
    once this node has gone, and the holders block ``joining`` will have besides this node, as the
    announced view says now. Movers whose decisions did not see each other (two donors that checked
    within one announcement period) are told apart by peer id, the same order for every node: a holder
    of ``leaving`` moving elsewhere (online there, ``joining`` another block) with a smaller id than this
    node's goes first (it has left); one with a larger id defers to this node (it stays, and counts).
    When unsure, count so that this node stays: a holder of ``leaving`` live in another block too (it
    switched; its old record lives out the tombstone's way) has left; every other live holder of
    ``joining`` counts there, joiners still downloading included, except movers from ``leaving`` that
    defer to this node."""
    live: dict[str, dict[int, str]] = {}
    for b, anns in holders.items():
        if 0 <= b < n_blocks:
            for a in anns:
                if a.is_live and a.peer_id != my_peer_id:
                    live.setdefault(a.peer_id, {})[b] = a.state
    keep = come = 0
    for peer, recs in live.items():
        moving = any(st == "joining" for c, st in recs.items() if c != leaving)
        was_mine = recs.get(leaving) == "online"
        defers = was_mine and moving and peer > my_peer_id
        if was_mine and (len(recs) == 1 or defers):
            keep += 1
        if joining in recs and not (defers and recs[joining] == "joining"):
            come += 1
    return keep, come


def may_switch(keep: int, come: int, policy: RebalancePolicy = RebalancePolicy()) -> bool:
    """Should a move switch, given :func:`switch_counts`? Yes if the old block keeps ``min_keep`` ready
    holders (rule 3, as the rule decided), or if it keeps more than the new block will have: the move
    still raises the lower of the two. Otherwise it only trades one short block for another (or two
    movers that did not see each other would both leave): the move is abandoned."""
    return keep >= policy.min_keep or keep > come
