"""Private runs: which peers may call this node's RPCs and average with it.

Two optional mechanisms, usable together (``--allow-peer PEERID`` repeatable, ``--run-secret-file``):

* **Allowlist of peer ids.** Every hop, streamed hop and block-state download is checked against
  the caller's libp2p peer id (``context.remote_id``: authenticated by the TLS/Noise handshake, so
  it cannot be spoofed without the peer's private key); others get the typed RPC error
  ``unauthorized``. The averager refuses join requests, all-reduce groups and state downloads
  involving peers not on the list, and the node rejects any averaging round whose gathered group
  holds a peer not on the list. This node's own peer id is always allowed.
* **Run secret.** A shared secret file is folded into the averaging prefix
  (``{run}_block{b}_{HMAC(secret, run/block)}``), so peers without the secret never find (nor can
  join, nor download state through) this node's averaging group: the prefix also names the
  averager's RPC handlers and DHT matchmaking keys.

What is NOT protected (see RELIABILITY.md): the DHT stays public (run manifest, block
announcements, peer ids and addresses are readable by anyone who reaches one node); a run secret
alone does not authenticate RPC callers (hops and state downloads need the allowlist); traffic is
encrypted by libp2p's secure channel whether or not the run is private; a peer on the allowlist
is trusted to call, but its averaged weights are still checked by ``acceptance.judge``.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096

__all__ = ["RunAuth", "load_secret", "validate_peer_id", "MIN_SECRET_BYTES"]


def validate_peer_id(peer_id: str, *, what: str = "--allow-peer") -> str:
    """A base58 libp2p peer id, or ValueError naming the flag and the value."""
    import base58
    import multihash
    s = str(peer_id).strip()
    try:
        mh = multihash.decode(base58.b58decode(s))
        ok = mh.code in (0x00, 0x12) and 32 <= mh.length <= 128 and base58.b58encode(base58.b58decode(s)).decode() == s
    except Exception:
        ok = False
    if not ok:
        raise ValueError(f"{what} {peer_id!r} is not a libp2p peer id (base58 multihash, like Qm... or 12D3KooW...)")
    return s


def load_secret(path: str | Path, what: str = "run secret file") -> bytes:
    """Read a secret file (surrounding whitespace ignored); errors name the file and the problem."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{what} {p}: not found") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {p}: is a directory, expected a file") from None
    except OSError as e:
        raise ValueError(f"{what} {p}: cannot read it ({e.strerror or e})") from None
    secret = raw.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{what} {p}: holds {len(secret)} bytes, need at least {MIN_SECRET_BYTES} "
                         f"(make one with: head -c 32 /dev/urandom | base64 > {p.name})")
    if len(secret) > MAX_SECRET_BYTES:
        raise ValueError(f"{what} {p}: holds {len(secret)} bytes, at most {MAX_SECRET_BYTES} allowed")
    return secret


@dataclass(frozen=True)
class RunAuth:
    """Who may talk to this node. With neither an allowlist nor a secret, everything is open."""

    allowed_peers: frozenset[str] | None = None
    secret: bytes | None = None
    self_peer: str = ""

    @classmethod
    def build(cls, allowed_peers: Iterable[str] | None, secret_file: str | Path | None,
              self_peer: str = "") -> "RunAuth":
        allowed = None if allowed_peers is None else frozenset(validate_peer_id(p) for p in allowed_peers)
        secret = load_secret(secret_file) if secret_file is not None else None
        return cls(allowed, secret, self_peer)

    @property
    def restricted(self) -> bool:
        return self.allowed_peers is not None

    @property
    def private(self) -> bool:
        return self.allowed_peers is not None or self.secret is not None

    def authorize(self, peer_id: str) -> bool:
        """May ``peer_id`` call this node's RPCs / average with it?"""
        if self.allowed_peers is None:
            return True
        p = str(peer_id)
        return p == self.self_peer or p in self.allowed_peers

    def averaging_prefix(self, run_id: str, block_index: int) -> str:
        base = f"{run_id}_block{int(block_index)}"
        if self.secret is None:
            return base
        tag = hmac.new(self.secret, f"blocktrain-averaging/{run_id}/{int(block_index)}".encode(),
                       hashlib.sha256).hexdigest()[:32]
        return f"{base}_{tag}"

    def describe(self) -> str:
        parts = []
        if self.allowed_peers is not None:
            parts.append(f"allowlist of {len(self.allowed_peers)} peer(s)")
        if self.secret is not None:
            parts.append("run secret (private averaging group)")
        return ", ".join(parts) or "open run"
