"""Routing inference along a discovered chain of block holders, with failover.

Any node answers a generation request: it plans a chain (one live holder per block, ranked,
with alternates), and gives the objective one *hop* callable per block. A hop tries the block's
holders in order; a holder that errs, times out, or answers with a wrong-shape or non-finite
state is banned for a while and the call moves on to the next one (bounded retries with
backoff, one fresh DHT read when the known holders are exhausted). Blocks this node holds are
run in-process without a network call.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from blocktrain.blocks.chain import HopRequest, HopResult
from blocktrain.p2p.errors import HopError, MissingBlockError
from blocktrain.p2p.hops import HopRequest as WireHopRequest

log = logging.getLogger(__name__)


class NoLiveHolderError(RuntimeError):
    pass


@dataclass
class RouteLog:
    hops: dict[int, str] = field(default_factory=dict)      # block -> peer that served it (last call)
    calls: int = 0                                         # successful hop calls (network or local)
    failovers: int = 0
    bytes_out: int = 0
    bytes_in: int = 0

    def route(self) -> list[dict]:
        return [{"block": b, "peer": p} for b, p in sorted(self.hops.items())]


class BanList:
    def __init__(self, seconds: float = 60.0):
        self.seconds = seconds
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()
        self.total = 0

    def ban(self, peer: str, reason: str) -> None:
        with self._lock:
            self._until[peer] = time.monotonic() + self.seconds
            self.total += 1
        log.warning("banning peer %s for %.0fs: %s", peer, self.seconds, reason)

    def banned(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            for p in [p for p, t in self._until.items() if t <= now]:
                del self._until[p]
            return set(self._until)


class Router:
    def __init__(self, discovery, client, run_id: str, n_blocks: int, state_dim: int, *,
                 local_hops: dict[int, Callable[[HopRequest], HopResult]] | None = None,
                 self_peer: str = "", hop_timeout: float = 20.0, max_attempts: int = 4,
                 backoff: float = 0.2, bans: BanList | None = None):
        self.discovery, self.client, self.run_id = discovery, client, run_id
        self.n_blocks, self.state_dim = n_blocks, state_dim
        self.local_hops = dict(local_hops or {})
        self.self_peer = self_peer
        self.hop_timeout, self.max_attempts, self.backoff = hop_timeout, max_attempts, backoff
        self.bans = bans or BanList()

    def candidates(self, b: int, exclude: set[str]) -> list[str]:
        holders = self.discovery.list_holders(self.run_id).get(b, [])
        usable = [a for a in holders if a.state == "online" and a.serving and a.peer_id not in exclude]
        usable.sort(key=lambda a: (a.load, -a.throughput, a.peer_id))
        return [a.peer_id for a in usable]

    def hops(self, log_: RouteLog) -> list[Callable[[HopRequest], HopResult]]:
        """One hop per block; each discovers its holders lazily and fails over on its own."""
        return [self._hop_for(b, log_) for b in range(self.n_blocks)]

    def _hop_for(self, b: int, route: RouteLog):
        cache: list[str] = []

        def call(req: HopRequest) -> HopResult:
            if b in self.local_hops:
                out = self.local_hops[b](req)
                route.hops[b] = self.self_peer or "self"
                route.calls += 1
                return out
            tried: set[str] = set()
            refreshed = False
            for attempt in range(self.max_attempts + 1):
                if not cache:
                    exclude = self.bans.banned() | tried
                    cache.extend(self.candidates(b, exclude))
                    refreshed = True
                if not cache:
                    break
                peer = cache[0]
                try:
                    out = self._remote(peer, b, req, route)
                    route.hops[b] = peer
                    route.calls += 1
                    return out
                except (HopError, ValueError, OSError) as e:
                    tried.add(peer)
                    cache.pop(0)
                    self.bans.ban(peer, f"block {b}: {e}")
                    route.failovers += 1
                    time.sleep(min(self.backoff * (2 ** attempt), 2.0))
                    if not cache and refreshed and attempt >= 1:
                        cache.extend(self.candidates(b, self.bans.banned() | tried))
            raise NoLiveHolderError(f"block {b} has no live holder" +
                                    (f" (tried {len(tried)} that failed)" if tried else ""))
        return call

    def _remote(self, peer: str, b: int, req: HopRequest, route: RouteLog) -> HopResult:
        sigmas = torch.stack([req.sigma, req.sigma_next], dim=-1).float()
        wire = WireHopRequest(block_index=b, state=req.state.float().contiguous(),
                              context=req.context.to(torch.int64).contiguous(), sigmas=sigmas,
                              want_logits=req.want_logits)
        route.bytes_out += wire.payload_bytes
        resp = self.client.forward_sync(peer, wire, timeout=self.hop_timeout)
        state = resp.state
        if state.shape != req.state.shape:
            raise ValueError(f"peer {peer} returned state of shape {tuple(state.shape)}, "
                             f"expected {tuple(req.state.shape)}")
        if not bool(torch.isfinite(state).all()):
            raise ValueError(f"peer {peer} returned non-finite state")
        logits = resp.logits
        if req.want_logits:
            if logits is None or logits.shape[:2] != req.state.shape[:2] or not bool(torch.isfinite(logits).all()):
                raise ValueError(f"peer {peer} returned missing, misshapen or non-finite logits")
            route.bytes_in += logits.numel() * logits.element_size()
        route.bytes_in += state.numel() * state.element_size()
        return HopResult(state.to(req.state.device, req.state.dtype),
                         logits.to(req.state.device) if logits is not None else None)


__all__ = ["Router", "RouteLog", "BanList", "NoLiveHolderError", "MissingBlockError"]
