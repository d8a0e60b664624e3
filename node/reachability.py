"""Whether this node serves hops, decided by whether others can reach it (the policy; the wire is
``p2p/reachability.py``).

* ``public``: peers dialled it back when it joined; it serves, and announces its own addresses.
* ``relayed``: nobody can dial it, but a relay (a public peer whose relay service holds its libp2p
  autorelay reservation) carries dials to it; it serves through the relay and announces its
  circuit addresses.
* ``training only (not reachable)``: nobody can dial it and no relay carries dials to it (yet:
  its daemon reserves a slot on its static relays within seconds of starting, p2p/reachability.py,
  and the first check comes ``recheck_s`` after the node starts; or never, when none of its initial
  peers can relay). It trains and averages as a client, announces ``serving: false`` so routers
  never pick it, and checks its relays again every ``recheck_s`` seconds.

A relayed node re-checks every ``relayed_recheck_s`` and falls back to training only when its
relays stop carrying dials (they left).
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

PUBLIC, RELAYED, TRAINING_ONLY = "public", "relayed", "training only (not reachable)"


class Reachability:
    """``holders()``: the run's announced holders; the public ones among them may relay for us and
    are asked after the initial peers."""

    def __init__(self, discovery, holders=dict, *, recheck_s: float = 20.0, relayed_recheck_s: float = 120.0):
        self.discovery, self.holders = discovery, holders
        self.private = discovery.reachability == "private"
        self.state = TRAINING_ONLY if self.private else PUBLIC
        self.recheck_s, self.relayed_recheck_s = recheck_s, relayed_recheck_s
        self.checked_at: float | None = None

    @property
    def serving(self) -> bool:
        return self.state != TRAINING_ONLY

    def addresses(self) -> list[str]:
        """What the node announces: its circuit addresses when relayed, else its own."""
        if self.state == RELAYED:
            return self.discovery.relay_addresses()
        return self.discovery.visible_maddrs()

    def check(self) -> str:
        """Ask the relays to dial us through themselves; update and return the state."""
        try:
            ok = bool(self.discovery.check_relayed(public_addresses(self.holders(), self.discovery.peer_id)))
        except Exception as e:   # a failed check is a failed dial, never a crash of the node
            log.info("relay check failed: %s", e)
            ok = False
        new = RELAYED if ok else TRAINING_ONLY
        if new != self.state:
            log.warning("reachability: %s -> %s", self.state, new)
            self.state = new
        self.checked_at = time.time()
        return self.state

    def run(self, stop: threading.Event) -> None:
        """The node's reachability loop (only for private nodes)."""
        while not stop.wait(self.relayed_recheck_s if self.state == RELAYED else self.recheck_s):
            self.check()


def public_addresses(holders: dict, self_peer: str) -> list[str]:
    """One directly dialled address (no circuit, not loopback) of each serving holder but us."""
    out = []
    for anns in holders.values():
        for a in anns:
            if not a.serving or a.peer_id == self_peer:
                continue
            good = [m for m in a.addresses if "/p2p-circuit" not in m and not m.startswith(("/ip4/127.", "/ip6/::1/"))
                    and m.endswith("/p2p/" + a.peer_id)]
            out += good[:1]
    return list(dict.fromkeys(out))
