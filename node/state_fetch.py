"""One way to fetch a block's current state from the network: late join, upstream snapshots, export.

:meth:`StateFetcher.fetch` asks a block's online holders (not those still joining), best first by this node's own
measurements (``routing/ranking.py``; peers never measured in random order: a claim of steps is anyone's to
make, and ordering by it let Sybil holders claiming 10^9 steps be asked before every honest one), downloads
the state over the block RPC (a holder that sends nothing for ``STATE_IDLE_S`` is given up at once), and keeps the first offer that passes
:meth:`build_checked` (every tensor finite, and the state loads strictly into a fresh block: no
missing, extra or misshapen tensor). A holder that fails is recorded as such and the next one is
asked. Callers add their own judgement on top (a late joiner also compares check losses).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from blocktrain.node.routing.ranking import HolderRanking
from blocktrain.p2p.errors import drop_tracebacks
from blocktrain.p2p.records import BlockAnnouncement

log = logging.getLogger(__name__)
#: the slowest link a block's state download is given time for (1 MB/s = 8 Mbit/s): measured, a 58.7 MB
#: block took 25 s over 20 Mbit/s and a 131 MB one could not arrive within the former fixed 30 s at all
#: (BENCHMARKS.md "Move time for a real block")
MIN_STATE_RATE_MB_S = 1.0


def transfer_timeout(n_bytes: int, base_s: float = 30.0) -> float:
    """Seconds to allow one download of ``n_bytes`` of block state: ``base_s`` for small blocks,
    10 s plus the size at :data:`MIN_STATE_RATE_MB_S` for large ones."""
    return max(base_s, 10.0 + n_bytes / 1e6 / MIN_STATE_RATE_MB_S)


def state_bytes(module: torch.nn.Module) -> int:
    """The bytes of a block's state as the block RPC and the averager send it (its parameters)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass
class Fetched:
    peer: str
    meta: dict
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensors.values())


class StateFetcher:
    def __init__(self, client, objective, *, ranking: HolderRanking | None = None, self_peer: str = "",
                 timeout: float = 30.0):
        self.client, self.objective = client, objective
        self.ranking = ranking or HolderRanking()
        self.self_peer, self.timeout = self_peer, timeout

    @staticmethod
    def build_checked(objective, b: int, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A fresh block b holding ``tensors``; ValueError if any is non-finite or does not fit."""
        if not all(bool(torch.isfinite(v).all()) for v in tensors.values()):
            raise ValueError(f"the offered state of block {b} is not finite")
        m = objective.build_block(b)
        try:
            m.load_state_dict(tensors)   # strict: refuses missing, unexpected or misshapen tensors
        except RuntimeError as e:
            raise ValueError(f"the offered state of block {b} does not fit: {e}") from None
        return m

    def order(self, holders: Sequence[BlockAnnouncement]) -> list[str]:
        # online holders only: a ``joining`` one is still downloading and has nothing to give yet
        return self.ranking.order([a.peer_id for a in holders if a.state == "online" and a.peer_id != self.self_peer])

    def fetch(self, b: int, holders: Sequence[BlockAnnouncement], *, errors: list[str] | None = None,
              timeout: float | None = None) -> Fetched | None:
        """The first checked state of block ``b`` its holders deliver, or None (reasons in ``errors``)."""
        for peer in self.order(holders):
            t0 = time.perf_counter()
            try:
                meta, tensors = self.client.get_block_state_sync(peer, b, timeout=timeout or self.timeout)
                self.build_checked(self.objective, b, tensors)
            except Exception as e:  # a holder that left or sent junk: try the next one
                self.ranking.record_failure(peer, str(e))
                if errors is not None:
                    errors.append(f"state of block {b} from {peer}: {type(e).__name__}: {e}")
                    del errors[:-50]
                drop_tracebacks(e)   # a cut stream's frames hold what it delivered: up to a block, freed now
                continue
            self.ranking.record_success(peer, time.perf_counter() - t0)
            return Fetched(peer, meta, tensors)
        return None
