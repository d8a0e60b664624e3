"""Who may ask a node for operator actions (an averaging round now, a held-out evaluation now:
whatever changes the node or costs a lot).

By default only a client on the node's own machine: the TCP peer address is exactly 127.0.0.1 or
::1 (a proxy on 127.0.0.1 that sets X-Forwarded-For is believed, so the client behind it counts as
remote; see ``server.py``). A node started with ``--operator-token-file FILE`` also accepts any
client that sends ``Authorization: Bearer <token>`` (compared in constant time). Others get 401
(no credentials where a token would do) or 403 (wrong token, or no token configured).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

from ..auth import load_secret

LOCAL_CLIENTS = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
TOKEN_HEADER_HELP = "Authorization: Bearer <token>"


def load_operator_token(path: str | Path) -> bytes:
    """Read the operator token once at start; errors name the file and the problem."""
    token = load_secret(path, what="operator token file")
    if not all(33 <= b <= 126 for b in token):
        raise ValueError(f"operator token file {path}: must hold printable ASCII without spaces (it is sent in "
                         "an HTTP header); make one with: head -c 32 /dev/urandom | base64")
    return token


@dataclass(frozen=True)
class Refusal:
    status: int
    detail: str
    headers: dict = field(default_factory=dict)


def operator_refusal(client_host: str | None, authorization: str | None, token: bytes | None) -> Refusal | None:
    """None when this client may run operator actions, else why not (an HTTP status and a detail)."""
    if client_host in LOCAL_CLIENTS:
        return None
    if token is None:
        return Refusal(403, f"operator actions are local-only on this node (this client is {client_host}): call "
                            "from 127.0.0.1 on the node's machine, or start the node with --operator-token-file "
                            f"and send {TOKEN_HEADER_HELP}")
    if not authorization:
        return Refusal(401, f"operator action: send {TOKEN_HEADER_HELP} (this client is not local)",
                       {"WWW-Authenticate": 'Bearer realm="blocktrain-operator"'})
    scheme, _, credentials = authorization.strip().partition(" ")
    given = credentials.strip().encode("latin-1", errors="replace")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, token):
        return Refusal(403, "operator action: wrong operator token")
    return None
