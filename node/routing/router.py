"""Client routing: run a chain of hops through live block holders, failing over when one fails.

Any node answers a generation request (so does a client without a block): the router gives the
objective one *hop* callable per block. A hop asks the block's holders in the order of this
node's own measurements (``ranking.py``), never in the order of what they claim. It asks one
holder; if no answer came within a hedge delay (a few times the holder's measured latency, or
``stranger_hedge_s`` for a holder never measured) it also asks the next one, and takes the first
valid answer (Dean and Barroso's hedged requests). At most ``max_parallel`` requests younger
than their hedge delay run at once, and ``max_inflight`` in all (stalled ones included).
A holder that errs, or answers a malformed or non-finite state, is recorded as failed and banned
for a while (``bans.py``) and the next one is asked at once; a stranger that lost a race is
recorded as slow. So 50 announced holders that fail or stall cost the first request some
parallel tries, and later requests nothing: the holder that answered is first from then on.
Every call is bounded by ``hop_timeout``; the holder list is read once more from the DHT when
the known ones are exhausted. Blocks this node holds run in-process without a network call.
Which block a *server* holds is decided elsewhere (``selection.py``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from blocktrain.blocks.chain import Hop, HopRequest, HopResult
from blocktrain.node.routing.bans import PeerBans
from blocktrain.node.routing.hops import start_remote
from blocktrain.node.routing.ranking import HolderRanking
from blocktrain.p2p.errors import HopError, drop_tracebacks

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


REREAD_S = 1.0   # seconds between DHT reads for a block with no holder left to try (see discovery_grace_s)


class Router:
    def __init__(self, discovery, client, run_id: str, n_blocks: int, *,
                 local_hops: dict[int, Hop] | None = None, self_peer: str = "",
                 hop_timeout: float = 20.0, max_parallel: int = 4, max_inflight: int = 16,
                 stranger_hedge_s: float = 0.5,
                 holders_ttl: float = 3.0, bans: PeerBans | None = None, ranking: HolderRanking | None = None,
                 discovery_grace_s: float = 5.0):
        self.discovery, self.client, self.run_id, self.n_blocks = discovery, client, run_id, n_blocks
        self.local_hops = dict(local_hops or {})
        self.self_peer = self_peer
        self.hop_timeout, self.stranger_hedge_s = hop_timeout, stranger_hedge_s
        self.max_parallel, self.max_inflight = max_parallel, max_inflight
        self.bans = bans or PeerBans()
        self.ranking = ranking or HolderRanking()
        self.holders_ttl = holders_ttl
        # a block with no holder left to try (none seen, or every one failed) is looked up again (every
        # REREAD_S) until this long after the hop started before it fails: a holder that just
        # (re)started or replaced one that left is stored in the DHT but not yet seen by every reader
        # for a moment, and a request should not fail on that (Petals' clients retry likewise)
        self.discovery_grace_s = discovery_grace_s
        self._holders: tuple[float, dict] = (-1e9, {})
        self._holders_lock = threading.Lock()

    def holders(self, fresh: bool = False) -> dict:
        """The announced holders per block, read from the DHT at most every ``holders_ttl`` seconds."""
        with self._holders_lock:
            t, hs = self._holders
            if fresh or time.monotonic() - t > self.holders_ttl:
                hs = self.discovery.list_holders(self.run_id)
                self._holders = (time.monotonic(), hs)
            return hs

    def candidates(self, b: int, exclude: set[str], fresh: bool = False) -> list[str]:
        """Serving holders of block b (as announced), best first by this node's measurements."""
        holders = self.holders(fresh).get(b, [])
        usable = [a.peer_id for a in holders if a.state == "online" and a.serving and a.peer_id not in exclude]
        return self.ranking.order(usable)

    def hops(self, route: RouteLog) -> list[Callable[[HopRequest], HopResult]]:
        """One hop per block; each discovers its holders lazily and fails over on its own."""
        return [self._hop_for(b, route) for b in range(self.n_blocks)]

    def hedge_delay(self, peer: str) -> float:
        known = self.ranking.known(peer)
        if known is None or known.latency_s is None:
            return self.stranger_hedge_s
        return min(self.hop_timeout, max(0.25, 4.0 * known.latency_s))

    def _hop_for(self, b: int, route: RouteLog):
        known: list[str] = []   # this generation's holder list, read from the DHT once

        def call(req: HopRequest) -> HopResult:
            if b in self.local_hops:
                out = self.local_hops[b](req)
                route.hops[b] = self.self_peer or "self"
                route.calls += 1
                return out
            return self._race(b, req, route, known)
        return call

    def _race(self, b: int, req: HopRequest, route: RouteLog, known: list[str]) -> HopResult:
        deadline = time.monotonic() + self.hop_timeout
        grace_end = time.monotonic() + min(self.discovery_grace_s, self.hop_timeout)
        tried: set[str] = set()
        failed = 0
        refreshed = not known
        if not known:
            known.extend(self.candidates(b, self.bans.banned()))
        queue = [p for p in self.ranking.order(known) if not self.bans.is_banned(p)]
        inflight: dict[concurrent.futures.Future, tuple[str, float]] = {}
        next_launch = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    break
                # out of holders: a fresh read of the DHT, and more within the grace (a replacement of a
                # holder that just left or restarted may take a moment to be seen)
                if not queue and not inflight and (not refreshed or now < grace_end):
                    if refreshed:
                        time.sleep(min(REREAD_S, grace_end - now))
                    refreshed = True
                    fresh = self.candidates(b, self.bans.banned() | tried, fresh=True)
                    known[:] = list(dict.fromkeys([*known, *fresh]))
                    queue = fresh
                    continue
                if not queue and not inflight:
                    break
                # a request is young until its hedge delay has passed; only young ones hold back the next
                young = [t0 + self.hedge_delay(p) for p, t0 in inflight.values() if now < t0 + self.hedge_delay(p)]
                if queue and len(inflight) < self.max_inflight and len(young) < self.max_parallel and (
                        not young or now >= next_launch):
                    peer = queue.pop(0)
                    tried.add(peer)
                    inflight[start_remote(self.client, peer, b, req, deadline - now)] = (peer, now)
                    next_launch = now + self.hedge_delay(peer)
                    continue
                wake = [deadline]
                if queue and len(inflight) < self.max_inflight:
                    wake += [next_launch, *young]
                done, _ = concurrent.futures.wait(list(inflight), timeout=max(0.0, min(wake) - now),
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in done:
                    peer, t0 = inflight.pop(fut)
                    try:
                        out, sent, got = fut.result()
                    except (HopError, ValueError, OSError, concurrent.futures.CancelledError) as e:
                        failed += 1
                        route.failovers += 1
                        self.ranking.record_failure(peer, str(e))
                        self.bans.ban(peer, f"block {b}: {e}")
                        next_launch = 0.0   # ask the next holder now
                        drop_tracebacks(e)   # handled: its frames (the hop's tensors) go now, not at a gc pass
                        continue
                    self.ranking.record_success(peer, time.monotonic() - t0)
                    self.bans.forgive([peer])
                    route.hops[b] = peer
                    route.calls += 1
                    route.bytes_out += sent
                    route.bytes_in += got
                    return out
        finally:
            for fut, (peer, _) in inflight.items():   # lost the race or ran out of time
                fut.cancel()
                if self.ranking.known(peer) is None or time.monotonic() >= deadline:
                    self.ranking.record_failure(peer, "no answer in time")
        timed_out = time.monotonic() >= deadline
        raise NoLiveHolderError(f"block {b} has no live holder" +
                                (f" (tried {len(tried)}: {failed} failed" + (
                                    f", no answer within {self.hop_timeout:.0f}s)" if timed_out else ")")
                                 if tried else ""))
