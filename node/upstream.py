"""Read-only snapshots of the blocks before ours, for objectives that ``needs_upstream``.

A forward-chained (or forward-residual) worker of block b trains on the outputs of blocks < b.
It downloads their current state from their holders when it starts and every
``refresh_s`` seconds (every 2 s while one is still missing), through the node's one state
fetcher, and keeps them here as frozen modules; the trainer reads them. The whole special case
lives in this file: the node only starts :class:`UpstreamSnapshots` when the objective asks.
"""
from __future__ import annotations

import threading
import time

import torch

from blocktrain.node.state_fetch import StateFetcher


class UpstreamSnapshots:
    def __init__(self, objective, block_index: int, device: torch.device, *, refresh_s: float = 30.0):
        self.objective, self.block_index, self.device = objective, block_index, device
        self.refresh_s = refresh_s
        self._mods: list[torch.nn.Module | None] = [None] * block_index
        self.meta: list[dict | None] = [None] * block_index
        self._lock = threading.Lock()
        self.stats = {"refreshes": 0, "failures": 0, "bytes": 0, "seconds": 0.0}

    def ready(self) -> bool:
        return all(m is not None for m in self._mods)

    def missing(self) -> list[int]:
        return [j for j, m in enumerate(self._mods) if m is None]

    def modules(self) -> list[torch.nn.Module] | None:
        with self._lock:
            return None if not self.ready() else list(self._mods)

    def install(self, j: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Install a read-only snapshot of block j < ours; refuses wrong or non-finite state (and then
        keeps the previous snapshot)."""
        if not 0 <= j < len(self._mods):
            raise ValueError(f"block {self.block_index} keeps no snapshot of block {j}")
        m = StateFetcher.build_checked(self.objective, j, tensors)
        m = m.to(self.device).requires_grad_(False).eval()
        with self._lock:
            self._mods[j] = m
            self.meta[j] = {**meta, "fetched_at": time.time()}

    def refresh(self, fetcher: StateFetcher, holders: dict, errors: list[str]) -> bool:
        """Fetch every block < ours from its best live holder; True if every snapshot is now present."""
        t0 = time.perf_counter()
        for j in range(len(self._mods)):
            got = fetcher.fetch(j, holders.get(j, []), errors=errors)
            if got is None:
                self.stats["failures"] += 1
                continue
            self.install(j, got.tensors, {"peer": got.peer, "step": int(got.meta.get("step", 0))})
            self.stats["bytes"] += got.nbytes
        self.stats["refreshes"] += 1
        self.stats["seconds"] += time.perf_counter() - t0
        return self.ready()

    def run(self, stop: threading.Event, refresh) -> None:
        """The refresh loop body: ``refresh()`` every ``refresh_s`` (2 s while incomplete) until ``stop``."""
        while not stop.wait(self.refresh_s if self.ready() else 2.0):
            refresh()

    def status(self) -> dict:
        now = time.time()
        snaps = [None if m is None else {"block": j, "peer": m.get("peer"), "step": m.get("step"),
                                         "age_s": round(now - m["fetched_at"], 1)}
                 for j, m in enumerate(self.meta)]
        return {"ready": self.ready(), "snapshots": snaps, "refresh_s": self.refresh_s, **self.stats}
