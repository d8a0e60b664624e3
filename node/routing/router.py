"""Client routing: run a chain of hops through live block holders, failing over when one fails.

Any node answers a generation request (so does a client without a block): the router gives the
objective one *hop* callable per block. A hop asks the block's holders in the order of this
node's own measurements (``ranking.py``); a holder that errs, times out, or answers with a
malformed or non-finite state is recorded as failed, banned for a while (``bans.py``), and the
call moves on to the next one (bounded retries with backoff, one fresh DHT read when the known
holders are exhausted). Blocks this node holds run in-process without a network call.
Which block a *server* holds is decided elsewhere (``selection.py``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from blocktrain.blocks.chain import Hop, HopRequest, HopResult
from blocktrain.node.routing.bans import PeerBans
from blocktrain.node.routing.hops import call_remote
from blocktrain.node.routing.ranking import HolderRanking
from blocktrain.p2p.errors import HopError

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


class Router:
    def __init__(self, discovery, client, run_id: str, n_blocks: int, *,
                 local_hops: dict[int, Hop] | None = None, self_peer: str = "",
                 hop_timeout: float = 20.0, max_attempts: int = 4, backoff: float = 0.2,
                 bans: PeerBans | None = None, ranking: HolderRanking | None = None):
        self.discovery, self.client, self.run_id, self.n_blocks = discovery, client, run_id, n_blocks
        self.local_hops = dict(local_hops or {})
        self.self_peer = self_peer
        self.hop_timeout, self.max_attempts, self.backoff = hop_timeout, max_attempts, backoff
        self.bans = bans or PeerBans()
        self.ranking = ranking or HolderRanking()

    def candidates(self, b: int, exclude: set[str]) -> list[str]:
        """Serving holders of block b (as announced), best first by this node's measurements."""
        holders = self.discovery.list_holders(self.run_id).get(b, [])
        usable = [a.peer_id for a in holders if a.state == "online" and a.serving and a.peer_id not in exclude]
        return self.ranking.order(usable)

    def hops(self, route: RouteLog) -> list[Callable[[HopRequest], HopResult]]:
        """One hop per block; each discovers its holders lazily and fails over on its own."""
        return [self._hop_for(b, route) for b in range(self.n_blocks)]

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
                    cache.extend(self.candidates(b, self.bans.banned() | tried))
                    refreshed = True
                if not cache:
                    break
                peer = cache[0]
                t0 = time.perf_counter()
                try:
                    out, sent, got = call_remote(self.client, peer, b, req, self.hop_timeout)
                except (HopError, ValueError, OSError) as e:
                    tried.add(peer)
                    cache.pop(0)
                    self.ranking.record_failure(peer, str(e))
                    self.bans.ban(peer, f"block {b}: {e}")
                    route.failovers += 1
                    time.sleep(min(self.backoff * (2 ** attempt), 2.0))
                    if not cache and refreshed and attempt >= 1:
                        cache.extend(self.candidates(b, self.bans.banned() | tried))
                    continue
                self.ranking.record_success(peer, time.perf_counter() - t0)
                route.hops[b] = peer
                route.calls += 1
                route.bytes_out += sent
                route.bytes_in += got
                return out
            raise NoLiveHolderError(f"block {b} has no live holder" +
                                    (f" (tried {len(tried)} that failed)" if tried else ""))
        return call
