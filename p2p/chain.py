"""Plan an inference chain: one live holder per block 0..B-1, plus ranked alternates for failover.

Pure function over the holder map that :meth:`Discovery.list_holders` returns; no network here.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from blocktrain.p2p.errors import MissingBlockError
from blocktrain.p2p.records import BlockAnnouncement

__all__ = ["ChainHop", "ChainPlan", "default_rank_key", "plan_chain", "MissingBlockError"]

RankKey = Callable[[BlockAnnouncement], Any]
UNKNOWN_RTT_S = 1.0  # pessimistic RTT assumed for a peer never measured


@dataclass(frozen=True)
class ChainHop:
    block_index: int
    primary: BlockAnnouncement
    alternates: tuple[BlockAnnouncement, ...] = ()

    @property
    def candidates(self) -> tuple[BlockAnnouncement, ...]:
        """Primary first, then alternates: the order to try on failure."""
        return (self.primary, *self.alternates)


@dataclass(frozen=True)
class ChainPlan:
    run_id: str
    hops: tuple[ChainHop, ...] = field(default_factory=tuple)

    @property
    def primary_peers(self) -> list[str]:
        return [h.primary.peer_id for h in self.hops]

    def __len__(self) -> int:
        return len(self.hops)


def default_rank_key(rtt_s: Mapping[str, float] | None = None) -> RankKey:
    """Lower is better: measured RTT (unknown = 1 s), then load, then higher throughput, then peer id."""
    rtts = dict(rtt_s or {})

    def key(a: BlockAnnouncement) -> tuple[float, float, float, str]:
        return (rtts.get(a.peer_id, UNKNOWN_RTT_S), a.load, -a.throughput, a.peer_id)

    return key


def plan_chain(
    run_id: str,
    holders: Mapping[int, list[BlockAnnouncement]],
    n_blocks: int,
    *,
    rank_key: RankKey | None = None,
    rtt_s: Mapping[str, float] | None = None,
    exclude: Collection[str] = (),
    max_alternates: int = 3,
) -> ChainPlan:
    """Pick, for every block, the best serving online holder not in ``exclude``.

    Raises :class:`MissingBlockError` naming the first block without a usable holder.
    """
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    key = rank_key or default_rank_key(rtt_s)
    excluded = set(exclude)
    hops: list[ChainHop] = []
    for b in range(n_blocks):
        usable = [
            a for a in holders.get(b, [])
            if a.state == "online" and a.serving and a.peer_id not in excluded and a.block_index == b
        ]
        if not usable:
            known = len(holders.get(b, []))
            detail = f" ({known} holder(s) known but none online+serving outside the exclude set)" if known else ""
            raise MissingBlockError(f"block {b} has no live holder{detail}")
        usable.sort(key=key)
        hops.append(ChainHop(b, usable[0], tuple(usable[1 : 1 + max_alternates])))
    return ChainPlan(run_id, tuple(hops))
