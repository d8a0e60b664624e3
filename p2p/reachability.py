"""Can other peers dial this node? A dial-back check, and the libp2p options that follow from it.

A member behind NAT (or listening on loopback only) can open connections but nobody can open one
to it. Such a node must not be a DHT server or an averaging leader (both need incoming
connections), and it can serve hops only through a libp2p circuit relay (v2) on a reachable peer.

**Why a check of our own.** libp2p's AutoNAT (p2pd runs with ``-autonat``) would answer the
question, but the daemon's control API does not report its verdict, and AutoNAT servers refuse to
dial private (RFC 1918) addresses, so on a LAN, or in the network namespaces of our tests, it never
decides. Like Petals (``check_direct_reachability``), a node instead asks peers it reaches to dial
it back: :class:`DialBackService` (``bt_reach::DialBackService.rpc_dial_back``) dials the *caller's*
peer id (never another one) at the addresses the caller lists (at most :data:`MAX_ADDRS`, plain
``/ip4|ip6|dns*/HOST/tcp/PORT`` or a circuit ``.../p2p/RELAY/p2p-circuit``) from a fresh probe
daemon that listens nowhere and has no connection to anyone, so an existing connection cannot answer
for the dial; the secure handshake proves the peer id. One probe at a time per server, each dial
bounded by :data:`DIAL_TIMEOUT`.

**What follows** (``Discovery.start(reachability="auto")``): before its DHT starts, a joining node
runs :func:`probe_reachability` from a throw-away daemon on the addresses it will listen on. If
every initial peer that answered failed to dial it, the node is *private*: its DHT and averager run
in hivemind's client mode, and its p2pd runs autorelay with the initial peers that answered the
dial-back as *static* relays (:func:`private_dht_options`): libp2p's autorelay then reserves a slot
on those peers' relay service (circuit relay v2; every public node's p2pd runs one: hivemind's
default ``use_relay=True``) within seconds of the daemon's start.

**Why static relays** (issue 15). With ``-trustedRelays`` alone, p2pd (go-libp2p-daemon
v0.5.0.hivemind1, go-libp2p v0.32) keeps ``-relayDiscovery`` on: it feeds the trusted relays and its
DHT's closest peers to autorelay as a peer source, with go-libp2p's defaults ``WithMinCandidates(4)``
and ``WithBootDelay(3 min)``: autorelay reserves nothing while it knows fewer than 4 relay
candidates and less than 3 minutes have passed. A small network has fewer, so a member behind NAT
was "training only" for ~3.5 minutes after every start. With ``-relayDiscovery=0`` the daemon uses
``EnableAutoRelayWithStaticRelays``, which sets the minimum number of candidates to the number of
static relays, so there is no boot delay once they answer. The price: autorelay then never looks
beyond those relays; if none of them can relay (or all leave) the node says "training only" until it
restarts. A relay that fails among several only brings back the old wait (autorelay goes ahead with
what it has after the boot delay). hivemind passes no ``-relayDiscovery`` flag (its
``use_relay_discovery`` is a deprecated no-op), so :data:`STATIC_RELAYS` is registered as a
``force_reachability`` mode of hivemind's ``P2P``, whose flags are exactly those of "private" plus
``-relayDiscovery=0``; public nodes pass no such mode and are unchanged.

libp2p advertises relay addresses only for relays
on public IPs, so the node announces its circuit addresses itself (:func:`circuit_addrs`), readers
hand them to their daemon (:func:`learn_relayed`), and :func:`ask_relayed` finds which relays
really carry a dial to the node (autorelay may pick any relay-capable peer it meets) before the node
says it serves.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from multiaddr import Multiaddr

from blocktrain.p2p.addresses import parse_multiaddr, peer_id_of
from blocktrain.p2p.errors import AddressError, HopRequestError
from blocktrain.p2p.hops import WIRE_VERSION, decode_meta, encode_meta, error_response

__all__ = [
    "DIALBACK_NAMESPACE", "DialBackService", "serve_dial_back", "request_dial_back", "probe_reachability",
    "private_dht_options", "circuit_addrs", "ask_relayed", "learn_relayed", "validate_dial_addr",
    "all_loopback", "STATIC_RELAYS",
]

logger = logging.getLogger(__name__)

DIALBACK_NAMESPACE = "bt_reach"
MAX_ADDRS = 8
DIAL_TIMEOUT = 8.0          # one dial-back, all addresses together
ASK_TIMEOUT = DIAL_TIMEOUT + 12.0   # the caller's wait: the probe daemon's start plus the dial
#: a ``force_reachability`` mode registered in hivemind's ``P2P.FORCE_REACHABILITY_MAPPING`` (which
#: maps the mode to extra p2pd flags): "private" with autorelay on the trusted relays only
STATIC_RELAYS = "private-static-relays"
STATIC_RELAYS_FLAGS = {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
PROBE_ARGS = dict(dht_mode="client", use_relay=True, auto_nat=False, nat_port_map=False, no_listen=True,
                  startup_timeout=20)


def validate_dial_addr(s: str) -> str:
    """A plain ``/HOST/tcp/PORT`` (port > 0) or a circuit ``/HOST/tcp/PORT/p2p/RELAY/p2p-circuit``."""
    if not isinstance(s, str):
        raise AddressError("an address to dial must be a string")
    base, sep, tail = s.partition("/p2p-circuit")
    if sep:
        if tail:
            raise AddressError(f"{s!r}: nothing may follow /p2p-circuit (the peer dialled is the caller)")
        relay = parse_multiaddr(base, require_peer_id=True, allow_port_zero=False)
        return relay + "/p2p-circuit"
    if peer_id_of(s) is not None:
        raise AddressError(f"{s!r}: give the address without /p2p/ (the peer dialled is the caller)")
    return parse_multiaddr(s, allow_port_zero=False)


def all_loopback(maddrs: Iterable[str]) -> bool:
    """True if every address is a loopback IP (a node and peers that all live on this machine)."""
    for m in maddrs:
        try:
            proto = Multiaddr(m).protocols()[0].name
            if proto not in ("ip4", "ip6") or not ipaddress.ip_address(Multiaddr(m).value_for_protocol(proto)).is_loopback:
                return False
        except Exception:
            return False
    return True


class DialBackService(ServicerBase):
    """Answers ``{"v", "ok": true, "reachable": bool}`` to ``{"v", "maddrs": [...]}``: whether a
    fresh daemon could open a connection to the *caller* at those addresses."""

    def __init__(self, dial_timeout: float = DIAL_TIMEOUT):
        self.dial_timeout = dial_timeout
        self._lock = asyncio.Lock()   # one probe daemon at a time

    async def rpc_dial_back(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                            ) -> runtime_pb2.ExpertResponse:
        try:
            meta = decode_meta(request.metadata, "dial-back request")
            raw = meta.get("maddrs")
            if meta.get("v") != WIRE_VERSION or not isinstance(raw, list) or not 0 < len(raw) <= MAX_ADDRS:
                raise HopRequestError("malformed", f"need v={WIRE_VERSION} and 1..{MAX_ADDRS} addresses")
            try:
                maddrs = [validate_dial_addr(a) for a in raw]
            except AddressError as e:
                raise HopRequestError("malformed", str(e)) from None
        except HopRequestError as e:
            return error_response(e.code, str(e))
        reachable = await self._dial(context.remote_id, maddrs)
        return runtime_pb2.ExpertResponse(metadata=encode_meta({"v": WIRE_VERSION, "ok": True,
                                                                "reachable": reachable}))

    async def _dial(self, peer: PeerID, maddrs: list[str]) -> bool:
        async with self._lock:
            probe = None
            try:
                probe = await P2P.create(**PROBE_ARGS)
                await asyncio.wait_for(probe._client.connect(peer, [Multiaddr(m) for m in maddrs]),
                                       self.dial_timeout)
                return True
            except Exception as e:   # refused, unreachable, wrong peer id, timeout: not dialable there
                logger.debug("dial-back to %s at %s failed: %s", peer, maddrs, e)
                return False
            finally:
                if probe is not None:
                    await probe.shutdown()


async def serve_dial_back(_dht: Any, node: Any) -> None:
    """Run inside a DHT process (``dht.run_coroutine(serve_dial_back)``): answer dial-back requests."""
    await DialBackService().add_p2p_handlers(node.p2p, namespace=DIALBACK_NAMESPACE)


async def request_dial_back(p2p: P2P, peer: str | PeerID, maddrs: Sequence[str],
                            timeout: float = ASK_TIMEOUT) -> bool | None:
    """Ask ``peer`` to dial us at ``maddrs``: True/False, or None if it did not answer (no such
    service, timeout, broken connection)."""
    pid = peer if isinstance(peer, PeerID) else PeerID.from_base58(peer)
    req = runtime_pb2.ExpertRequest(metadata=encode_meta({"v": WIRE_VERSION, "maddrs": list(maddrs)[:MAX_ADDRS]}))
    try:
        stub = DialBackService.get_stub(p2p, pid, namespace=DIALBACK_NAMESPACE)
        resp = await asyncio.wait_for(stub.rpc_dial_back(req), timeout)
        meta = decode_meta(resp.metadata, "dial-back answer")
    except Exception as e:
        logger.info("peer %s did not answer a dial-back request: %s", pid, e)
        return None
    if meta.get("ok") is not True or not isinstance(meta.get("reachable"), bool):
        logger.info("peer %s refused a dial-back request: %s", pid, meta.get("reason", meta))
        return None
    return meta["reachable"]


def _verdict(answers: Sequence[bool | None]) -> bool | None:
    """Reachable if any peer dialled us; unreachable if peers answered and none could; else unknown."""
    if any(a is True for a in answers):
        return True
    if any(a is False for a in answers):
        return False
    return None


async def probe_reachability(initial_peers: Sequence[str], host_maddrs: Sequence[str],
                             announce_maddrs: Sequence[str] | None = None, *, max_peers: int = 3
                             ) -> tuple[bool | None, list[str], list[str]]:
    """From a throw-away daemon listening on ``host_maddrs``: may the initial peers dial us there?

    Returns (True / False / None if nobody answered, the listen addresses with the port the daemon
    got, so the real node listens on the port that was checked, the initial peers' multiaddrs whose
    peer answered: live public peers, the relays a private node reserves a slot with)."""
    p2p = None
    try:
        p2p = await P2P.create(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs),
                               announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
                               dht_mode="client", use_relay=False, auto_nat=False, nat_port_map=False,
                               startup_timeout=30)
        seen = [str(m).split("/p2p/")[0] for m in await p2p.get_visible_maddrs()]
        listened = _with_ports(host_maddrs, seen)
        mine = list(dict.fromkeys([*(announce_maddrs or []), *seen]))[:MAX_ADDRS]
        peers = list(dict.fromkeys(p for p in (peer_id_of(m) for m in initial_peers) if p))[:max_peers]
        answers = await asyncio.gather(*(request_dial_back(p2p, p, mine) for p in peers))
        logger.info("dial-back from %d initial peer(s) at %s: %s", len(peers), mine, answers)
        answered = {p for p, a in zip(peers, answers) if a is not None}
        return _verdict(answers), listened, [m for m in initial_peers if peer_id_of(m) in answered]
    except Exception as e:   # the real DHT start reports unreachable initial peers with its own error
        logger.info("reachability probe failed: %s", e)
        return None, list(host_maddrs), []
    finally:
        if p2p is not None:
            await p2p.shutdown()


def _with_ports(host_maddrs: Sequence[str], seen: Sequence[str]) -> list[str]:
    """``host_maddrs`` with port 0 replaced by the port the probe daemon got."""
    port = next((Multiaddr(m).value_for_protocol("tcp") for m in seen if "/tcp/" in m), None)
    if port is None:
        return list(host_maddrs)
    return [m[:-1] + str(port) if m.endswith("/tcp/0") else m for m in host_maddrs]


def private_dht_options(relays: Sequence[str]) -> dict[str, Any]:
    """hivemind ``DHT``/``P2P.create`` options for a node nobody can dial: client mode (no DHT
    requests or averaging groups to serve), circuit relay on, autorelay reserving slots on
    ``relays`` (the initial peers that answered its dial-back, with /p2p/) as static relays, without
    waiting for AutoNAT (which cannot judge private IPs) or autorelay's boot delay (module docstring).
    Without relays: autorelay with p2pd's relay discovery, as before (static mode needs relays).
    One address per relay: autorelay waits (boot delay) until it has as many candidates as static
    relays, and two addresses of one peer would count twice but make one candidate."""
    first: dict[str, str] = {}
    for r in relays:
        pid = peer_id_of(r)
        if pid:
            first.setdefault(pid, r)
    relays = list(first.values())
    if not relays:
        return dict(client_mode=True, use_relay=True, use_auto_relay=True, force_reachability="private")
    register_static_relays_mode()
    return dict(client_mode=True, use_relay=True, use_auto_relay=True, force_reachability=STATIC_RELAYS,
                trusted_relays=list(relays))


def register_static_relays_mode() -> None:
    """Teach hivemind's ``P2P.create`` the :data:`STATIC_RELAYS` reachability mode (idempotent; call it
    before the DHT's process or thread starts, so a forked DHT process inherits it)."""
    mapping = P2P.FORCE_REACHABILITY_MAPPING
    if mapping.get(STATIC_RELAYS) != STATIC_RELAYS_FLAGS:
        if "private" not in mapping:   # hivemind changed how it maps reachability modes to flags
            raise RuntimeError("hivemind's P2P has no 'private' reachability mode; cannot add static relays")
        P2P.FORCE_REACHABILITY_MAPPING = {**mapping, STATIC_RELAYS: dict(STATIC_RELAYS_FLAGS)}


register_static_relays_mode()   # also at import: a DHT process that is spawned, not forked, imports this module


def circuit_addrs(relays: Sequence[str], peer_id: str) -> list[str]:
    """The addresses others dial this node at through each relay (relays name their peer id)."""
    return [f"{r}/p2p-circuit/p2p/{peer_id}" for r in relays if peer_id_of(r)]


async def ask_relayed(_dht: Any, node: Any, relays: Sequence[str], want: int = 2) -> list[str]:
    """Inside the DHT process: which of ``relays`` carry a fresh dial to us (hold our reservation)?
    Each is asked to dial our circuit address through itself; stops after ``want`` that do.
    (Autorelay picks its relays among every relay-capable peer it meets, not only the trusted ones.)"""
    carried: list[str] = []
    for r in relays:
        pid = peer_id_of(r)
        if pid is None or pid == str(node.peer_id):
            continue
        if await request_dial_back(node.p2p, pid, [f"{r}/p2p-circuit"]):
            carried.append(r)
            if len(carried) >= want:
                break
    return carried


_learned: dict[str, float] = {}   # per DHT process: peer id -> when its circuit addresses were last handed on
LEARN_EVERY_S = 20.0
LEARN_WAIT_S = 3.0


async def learn_relayed(_dht: Any, node: Any, peers: dict[str, list[str]]) -> None:
    """Inside the DHT process: hand announced circuit addresses to our daemon (``connect``), so a
    call to the peer by id right after finds it. At most every LEARN_EVERY_S per peer; waits at
    most LEARN_WAIT_S (a slow relay finishes in the background)."""
    now = time.monotonic()
    if len(_learned) > 10_000:
        _learned.clear()
    tasks = []
    for pid, addrs in peers.items():
        if now - _learned.get(pid, -1e9) < LEARN_EVERY_S:
            continue
        _learned[pid] = now
        circuits = [a for a in addrs if "/p2p-circuit/p2p/" in a and a.endswith("/p2p/" + pid)][:2]
        if circuits:
            tasks.append(asyncio.create_task(_connect(node.p2p, pid, circuits)))
    if tasks:
        await asyncio.wait(tasks, timeout=LEARN_WAIT_S)


async def _connect(p2p: P2P, pid: str, addrs: list[str]) -> None:
    try:
        relays = [Multiaddr(a[: -len("/p2p/" + pid)]) for a in addrs]
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(pid), relays), DIAL_TIMEOUT)
    except Exception as e:
        logger.debug("could not reach relayed peer %s: %s", pid, e)
