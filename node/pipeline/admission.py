"""Who may send a stage training traffic: the announced holders of the block before it.

A stage trains on whatever micro-batches it is sent: their activations go into its forward, and the last
block's loss is computed on the targets the sender chose. Before this gate any peer that could dial a
holder could train it: a plain hivemind peer with no record in the run sent block 1 of a 2-block
``pipeline`` run 100 micro-batches whose targets were all ``x`` in 4.6 s, and the chain's held-out CE
went from 2.55 to 11.09 nats/byte, every generation ``xxxx...`` (docs/records/s35/train_poison_probe.py).
Now a stage of block b (b >= 1) serves only peers announced ``online`` as holders of block b-1 (signed DHT
records, read through the node's router), so an outsider must at least announce itself in the run (a
Sybil can: see RELIABILITY.md "Training traffic"). A caller not in the last read is refused with the typed
``not_upstream`` after one fresh read, at most one every ``refresh_s`` (a new holder of block b-1 is served
as soon as its record is visible; a flood of strangers costs the node one DHT read per ``refresh_s``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

log = logging.getLogger(__name__)

__all__ = ["UpstreamGate"]


class UpstreamGate:
    """``await gate.admit(peer)``: may ``peer`` send block ``block`` training traffic? ``holders(fresh)`` is the
    router's view, {block: [announcements]} (a blocking DHT read when ``fresh``: run off the loop)."""

    def __init__(self, block: int, holders: Callable[[bool], dict], *, refresh_s: float = 2.0,
                 max_age_s: float = 30.0, on_refused: Callable[[], None] | None = None):
        if block < 1:
            raise ValueError("block 0 has no upstream: nobody sends it training traffic")
        self.block, self.holders, self.refresh_s, self.max_age_s = block, holders, refresh_s, max_age_s
        self.on_refused = on_refused or (lambda: None)
        self._allowed: frozenset[str] = frozenset()
        self._read_at = float("-inf")
        self._lock: asyncio.Lock | None = None

    async def admit(self, peer: str) -> bool:
        if peer in self._allowed and time.monotonic() - self._read_at < self.max_age_s:
            return True
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:   # one read at a time; callers waiting meanwhile use its result
            if time.monotonic() - self._read_at >= self.refresh_s:
                await self._read()
        if peer in self._allowed:
            return True
        self.on_refused()
        return False

    async def _read(self) -> None:
        try:
            hs = await asyncio.get_running_loop().run_in_executor(None, self.holders, True)
            self._allowed = frozenset(a.peer_id for a in hs.get(self.block - 1, []) if a.state == "online")
        except Exception as e:   # keep the last view; the read is tried again after refresh_s
            log.warning("reading the holders of block %d for the pipeline gate: %s", self.block - 1, e)
        self._read_at = time.monotonic()
