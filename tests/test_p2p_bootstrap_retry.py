"""A node whose initial peer does not answer yet (still starting, or a busy machine) tries again
with a fresh DHT while its start-up time lasts, instead of failing the whole join at once."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from blocktrain.p2p.discovery import Discovery
from blocktrain.p2p.errors import DiscoveryError
from blocktrain.p2p.identity import NodeIdentity

pytestmark = [pytest.mark.network, pytest.mark.timeout(180)]


def _unused_port() -> int:
    with socket.socket() as s:   # the test's own pick for the peer it starts below
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_join_retries_until_its_initial_peer_answers(tmp_path):
    ident = NodeIdentity.load_or_create(tmp_path / "seed")
    port = _unused_port()
    peer = f"/ip4/127.0.0.1/tcp/{port}/p2p/{ident.peer_id}"
    got: dict = {}

    def join():
        try:
            got["d"] = Discovery.start(initial_peers=[peer], startup_timeout=90)
        except Exception as e:   # noqa: BLE001  (reported below)
            got["error"] = e

    th = threading.Thread(target=join)
    th.start()
    seed = None
    try:
        time.sleep(3.0)   # nobody listens on the peer's address yet: the first attempt fails
        seed = Discovery.start(identity=ident, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"])
        th.join(120)
        assert "error" not in got, got.get("error")
        assert "d" in got
        assert got["d"].bootstrap_attempts >= 2   # the first start found nobody there
    finally:
        th.join(120)
        if "d" in got:
            got["d"].shutdown(withdraw=False)
        if seed is not None:
            seed.shutdown(withdraw=False)
        ident.close()


def test_join_through_a_peer_that_never_answers_still_fails_clearly():
    ghost = NodeIdentity.ephemeral()
    try:
        peer = f"/ip4/127.0.0.1/tcp/{_unused_port()}/p2p/{ghost.peer_id}"
        t0 = time.monotonic()
        with pytest.raises(DiscoveryError, match="could not start a DHT node through initial peers"):
            Discovery.start(initial_peers=[peer], startup_timeout=30)
        assert time.monotonic() - t0 < 90
    finally:
        ghost.close()
