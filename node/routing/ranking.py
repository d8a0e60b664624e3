"""One holder ranking, on figures this node measured itself.

A holder's announcement says what it claims (steps, throughput); anyone can claim anything, so
ranking never reads claims. Per peer this node keeps an exponentially weighted latency of its
successful calls and an exponentially weighted success rate of all calls (hops, state downloads).
The expected cost of asking a peer is ``latency / success``: a peer never measured costs
``unknown_latency_s / prior_success``, so a peer that answered well comes first, strangers next
(in random order, so that no announcement order decides who is tried), and peers that just
failed last. The router, the state fetcher and export all order holders with this one rule.
Pipeline training (``pipeline_route.py``) draws the next stage's holder at random with probability
proportional to 1 / cost (:meth:`pick`: SWARM's stochastic wiring), from its own instance, since a
training call's latency (the rest of the chain, forward and back) is not a hop's.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass


@dataclass
class PeerRecord:
    successes: int = 0
    failures: int = 0
    latency_s: float | None = None     # EWMA over successful calls
    success_rate: float = 0.5          # EWMA over all calls, from a neutral prior
    last_failure: str = ""
    last_seen: float = 0.0


class HolderRanking:
    def __init__(self, *, alpha: float = 0.3, unknown_latency_s: float = 0.5, min_success: float = 0.02,
                 seed: int | None = None):
        self.alpha, self.unknown_latency_s, self.min_success = alpha, unknown_latency_s, min_success
        self._peers: dict[str, PeerRecord] = {}
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    def record_success(self, peer: str, latency_s: float) -> None:
        with self._lock:
            r = self._peers.setdefault(peer, PeerRecord())
            r.successes += 1
            r.latency_s = latency_s if r.latency_s is None else (1 - self.alpha) * r.latency_s + self.alpha * latency_s
            r.success_rate = (1 - self.alpha) * r.success_rate + self.alpha
            r.last_seen = time.time()

    def record_failure(self, peer: str, why: str = "") -> None:
        with self._lock:
            r = self._peers.setdefault(peer, PeerRecord())
            r.failures += 1
            r.success_rate = (1 - self.alpha) * r.success_rate
            r.last_failure = why[:200]
            r.last_seen = time.time()

    def cost(self, peer: str) -> float:
        with self._lock:
            r = self._peers.get(peer)
        if r is None:
            return self.unknown_latency_s / PeerRecord.success_rate
        lat = r.latency_s if r.latency_s is not None else self.unknown_latency_s
        return lat / max(r.success_rate, self.min_success)

    def order(self, peers: list[str]) -> list[str]:
        """``peers`` cheapest first; equal costs (strangers) in random order."""
        keyed = [(self.cost(p), self._rng.random(), p) for p in dict.fromkeys(peers)]
        return [p for _, _, p in sorted(keyed)]

    def pick(self, peers: list[str]) -> str:
        """One of ``peers`` at random, with probability proportional to 1 / cost (stochastic wiring,
        Ryabinin et al., SWARM parallelism, 2023): fast, reliable holders get more of the traffic,
        strangers and slow ones still some, so new measurements keep coming."""
        if not peers:
            raise ValueError("no peer to pick from")
        peers = list(dict.fromkeys(peers))
        weights = [1.0 / max(self.cost(p), 1e-6) for p in peers]
        with self._lock:
            return self._rng.choices(peers, weights=weights)[0]

    def known(self, peer: str) -> PeerRecord | None:
        with self._lock:
            r = self._peers.get(peer)
            return None if r is None else PeerRecord(**vars(r))

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {p: {"successes": r.successes, "failures": r.failures, "latency_s": r.latency_s,
                        "success_rate": round(r.success_rate, 4)} for p, r in self._peers.items()}
