"""Validate user-given multiaddrs with py-multiaddr and hand them on to hivemind as plain ``str``.

Accepted shape: ``/<host>/tcp/<port>[/p2p/<peer id>]`` where ``<host>`` is one of ``ip4``, ``ip6``,
``dns``, ``dns4``, ``dns6``. Peers to bootstrap from (``initial_peers``) must name their peer id;
addresses to listen on (``host_maddrs``) may use port 0 and carry no peer id.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrLibError

from blocktrain.p2p.errors import AddressError

__all__ = ["AddressError", "parse_multiaddr", "parse_initial_peers", "host_maddr", "peer_id_of"]

HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")
_EXAMPLE = "/ip4/1.2.3.4/tcp/31337/p2p/<peer id>"


def parse_multiaddr(s: str, *, require_peer_id: bool = False, allow_port_zero: bool = True) -> str:
    """Return the canonical form of multiaddr ``s`` or raise :class:`AddressError` saying what is wrong."""
    if not isinstance(s, str):
        raise AddressError(f"multiaddr must be a string, got {type(s).__name__}")
    text = s.strip()
    if not text:
        raise AddressError(f"empty multiaddr; expected something like {_EXAMPLE}")
    if not text.startswith("/"):
        raise AddressError(f"{s!r} is not a multiaddr (must start with '/'); expected something like {_EXAMPLE}")
    try:
        maddr = Multiaddr(text)
    except (MultiaddrLibError, ValueError, TypeError) as e:
        raise AddressError(f"{s!r} is not a valid multiaddr: {e}") from None

    names = [p.name for p in maddr.protocols()]
    if names[0] not in HOST_PROTOCOLS:
        raise AddressError(
            f"{s!r} must start with a host part ({', '.join('/' + h for h in HOST_PROTOCOLS)}), "
            f"got /{names[0]}"
        )
    if len(names) < 2 or names[1] != "tcp":
        raise AddressError(f"{s!r} must give a TCP port right after the host (/tcp/<port>); e.g. {_EXAMPLE}")
    rest = names[2:]
    if rest not in ([], ["p2p"]):
        extra = "/" + "/".join(rest)
        raise AddressError(f"{s!r} has unsupported trailing parts {extra}; only /p2p/<peer id> may follow the port")
    port = int(maddr.value_for_protocol("tcp"))
    if port == 0 and not allow_port_zero:
        raise AddressError(f"{s!r} uses port 0, which only makes sense for an address to listen on")
    if require_peer_id and "p2p" not in rest:
        raise AddressError(f"{s!r} lacks the peer id: a peer to connect to must end with /p2p/<peer id>")
    return str(maddr)


def parse_initial_peers(peers: Iterable[str]) -> list[str]:
    """Validate the bootstrap peers (each must end with /p2p/<peer id>); duplicates are dropped, order kept."""
    if isinstance(peers, str):
        raise AddressError("initial peers must be a list of multiaddrs, got a single string")
    out: list[str] = []
    for i, s in enumerate(peers):
        try:
            canon = parse_multiaddr(s, require_peer_id=True, allow_port_zero=False)
        except AddressError as e:
            raise AddressError(f"initial peer #{i}: {e}") from None
        if canon not in out:
            out.append(canon)
    return out


def host_maddr(host: str, port: int) -> str:
    """Build a listen multiaddr from a host (IPv4/IPv6 literal or DNS name) and a TCP port."""
    if not (isinstance(port, int) and 0 <= port < 65536):
        raise AddressError(f"port must be an integer in [0, 65535], got {port!r}")
    try:
        ip = ipaddress.ip_address(host)
        proto = "ip4" if ip.version == 4 else "ip6"
    except ValueError:
        proto = "dns"
    return parse_multiaddr(f"/{proto}/{host}/tcp/{port}")


def peer_id_of(maddr: str) -> str | None:
    """The peer id carried by a multiaddr, or None if it has none."""
    m = Multiaddr(parse_multiaddr(maddr))
    names = [p.name for p in m.protocols()]
    return m.value_for_protocol("p2p") if "p2p" in names else None
