"""Multiaddr validation: good addresses come back canonical, bad ones say what is wrong."""
from __future__ import annotations

import pytest

from blocktrain.p2p.addresses import AddressError, host_maddr, parse_initial_peers, parse_multiaddr

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER_ED = "12D3KooWFfxzovdPAYomJwKerBK1rzoyzdcJjtJJjaCvQNxz6Fo3"


@pytest.mark.parametrize("addr", [
    f"/ip4/1.2.3.4/tcp/31337/p2p/{PEER}",
    f"/ip4/127.0.0.1/tcp/5000/p2p/{PEER_ED}",
    f"/ip6/::1/tcp/31337/p2p/{PEER}",
    f"/dns/bootstrap.example.org/tcp/443/p2p/{PEER}",
    f"/dns4/example.org/tcp/1/p2p/{PEER}",
    f"/dns6/example.org/tcp/1/p2p/{PEER}",
])
def test_good_peer_addresses(addr):
    assert parse_multiaddr(addr, require_peer_id=True) == addr
    assert parse_initial_peers([addr, "  " + addr + " "]) == [addr]  # stripped and de-duplicated


@pytest.mark.parametrize("addr", ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/31337", "/dns/localhost/tcp/8080"])
def test_good_listen_addresses(addr):
    assert parse_multiaddr(addr) == addr


@pytest.mark.parametrize("addr, fragment", [
    ("", "empty multiaddr"),
    ("1.2.3.4:31337", "must start with '/'"),
    ("/ip4/999.1.1.1/tcp/1", "not a valid multiaddr"),
    ("/ip4/1.2.3.4/tcp/99999", "not a valid multiaddr"),
    ("/garbage/1/tcp/1", "not a valid multiaddr"),
    ("/tcp/31337", "must start with a host part"),
    ("/ip4/1.2.3.4", "must give a TCP port"),
    ("/ip4/1.2.3.4/udp/5/quic", "must give a TCP port"),
    (f"/ip4/1.2.3.4/tcp/5/p2p/{PEER}/p2p-circuit", "unsupported trailing parts"),
    ("/ip4/1.2.3.4/tcp/5/p2p/notapeer", "not a valid multiaddr"),
])
def test_bad_addresses_say_what_is_wrong(addr, fragment):
    with pytest.raises(AddressError, match=fragment):
        parse_multiaddr(addr)
    assert issubclass(AddressError, ValueError)


def test_initial_peers_need_peer_id_and_real_port():
    with pytest.raises(AddressError, match=r"initial peer #1: .*lacks the peer id"):
        parse_initial_peers([f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}", "/ip4/1.2.3.4/tcp/1"])
    with pytest.raises(AddressError, match="port 0"):
        parse_initial_peers([f"/ip4/1.2.3.4/tcp/0/p2p/{PEER}"])
    with pytest.raises(AddressError, match="list of multiaddrs"):
        parse_initial_peers(f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}")  # type: ignore[arg-type]


def test_host_maddr():
    assert host_maddr("0.0.0.0", 31337) == "/ip4/0.0.0.0/tcp/31337"
    assert host_maddr("::", 1) == "/ip6/::/tcp/1"
    assert host_maddr("node.example.org", 2) == "/dns/node.example.org/tcp/2"
    with pytest.raises(AddressError, match="port"):
        host_maddr("1.2.3.4", 70000)
