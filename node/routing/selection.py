"""Server-side block selection: which block a joining node holds.

Apart from client routing (``router.py``), as in Petals (``server/block_selection.py``): a node
that joins without ``--block`` takes the block with the fewest live holders; ties go to the block
whose holders report the least total throughput, then to the lowest index.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from blocktrain.p2p.records import BlockAnnouncement


def choose_block(holders: Mapping[int, Sequence[BlockAnnouncement]], n_blocks: int) -> int:
    """The block with the fewest live holders; ties broken by least total throughput, then index."""
    def key(b: int):
        live = [a for a in holders.get(b, []) if a.is_live]
        return (len(live), sum(a.throughput for a in live), b)
    return min(range(n_blocks), key=key)
