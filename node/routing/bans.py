"""One ban list for the node: peers that failed us, keyed by peer id, for a while.

Routing bans a holder whose hop failed (an error, a timeout, a malformed or non-finite answer);
averaging bans the members blamed for a rejected round (see ``node/averaging/acceptance.py`` for
why a poisoned mean can be pinned on one member only in a group of two). A strike bans for
``ban_seconds`` (``collateral_seconds`` when the blame may be shared), doubling for every strike
a peer collects; a peer seen in an accepted round or a successful hop is forgiven its strikes
(not its running ban). Each concern keeps its own instance, so a collateral averaging ban never
takes an honest holder out of routing.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

log = logging.getLogger(__name__)


class PeerBans:
    """Bans keyed by peer id, with strikes that double a repeat offender's ban."""

    def __init__(self, ban_seconds: float = 60.0, collateral_seconds: float = 15.0, max_seconds: float = 3600.0):
        self.ban_seconds, self.collateral_seconds, self.max_seconds = ban_seconds, collateral_seconds, max_seconds
        self._until: dict[str, float] = {}
        self._strikes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.total = 0                      # bans issued (a peer banned twice counts twice)
        self.log: list[tuple[float, str, float, str]] = []   # (time, peer, seconds, reason), last 100

    def strike(self, peers: Sequence[str], reason: str, *, attributable: bool) -> None:
        now = time.monotonic()
        with self._lock:
            for p in peers:
                n = self._strikes.get(p, 0) + 1
                self._strikes[p] = n
                base = self.ban_seconds if attributable else self.collateral_seconds
                secs = min(self.max_seconds, base * 2 ** (n - 1))
                self._until[p] = max(self._until.get(p, 0.0), now + secs)
                self.total += 1
                self.log.append((time.time(), p, secs, reason))
            del self.log[:-100]

    def ban(self, peer: str, reason: str) -> None:
        """One attributable strike (a peer that failed a call of ours)."""
        log.warning("banning peer %s: %s", peer, reason)
        self.strike([peer], reason, attributable=True)

    def ban_for(self, peer: str, seconds: float, reason: str) -> None:
        """Banned for ``seconds`` (at most ``max_seconds``) whatever its strikes: for a caller that keeps its own
        count of what a peer was caught at (strikes are forgiven by the next call that merely succeeds)."""
        log.warning("banning peer %s for %.0f s: %s", peer, seconds, reason)
        with self._lock:
            self._until[peer] = max(self._until.get(peer, 0.0), time.monotonic() + min(self.max_seconds, seconds))
            self.total += 1
            self.log.append((time.time(), peer, seconds, reason))
            del self.log[:-100]

    def forgive(self, peers: Sequence[str]) -> None:
        """Peers that just served us well lose their strikes (not a running ban)."""
        with self._lock:
            for p in peers:
                self._strikes.pop(p, None)

    def is_banned(self, peer: str) -> bool:
        with self._lock:
            t = self._until.get(peer)
            if t is None:
                return False
            if t <= time.monotonic():
                del self._until[peer]
                return False
            return True

    def banned(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            for p in [p for p, t in self._until.items() if t <= now]:
                del self._until[p]
            return set(self._until)
