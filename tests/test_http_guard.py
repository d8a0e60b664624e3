"""Slowloris and greedy clients against a node's HTTP server (``node/http/guard.py``).

Before the guard, 64 sockets that had each sent half a request line made uvicorn answer 503 to every
other client, for as long as they stayed open (measured: 200 such sockets, every legitimate request
503 at 1 s, 10 s and 30 s, all 200 still open at 30 s).

In process: uvicorn serving a small app through ``guarded`` with short limits (a request head must
arrive within 0.6 s, 3 connections per address), raw sockets as the attacker. Live: a real
``bt-node seed`` with the defaults and 70 half-open sockets from one address.
"""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from blocktrain.node.http.guard import PER_CLIENT_CONNECTIONS, guarded
from blocktrain.node.swarm.launcher import NodeProc
from blocktrain.node.swarm.run import SWARM_DEFAULTS

from test_utils.configs import TEST_CORPUS

HALF = b"GET /ping HTTP/1.1\r\nHost: x\r\n"   # a request head that never ends


def _half_open(port: int, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        s.sendall(HALF)
        socks.append(s)
    return socks


def _state(s: socket.socket, wait: float = 0.3) -> str:
    """'open' (nothing to read), 'closed' (EOF or reset, nothing said) or the status line it was sent."""
    s.settimeout(wait)
    try:
        data = s.recv(4096)
    except socket.timeout:
        return "open"
    except OSError:
        return "closed"
    return data.split(b"\r\n", 1)[0].decode() if data else "closed"


@pytest.fixture
def small_server():
    app = FastAPI()
    counters: dict = {}

    @app.get("/ping")
    def ping():
        return {"ok": True}

    @app.get("/slow")
    def slow():
        time.sleep(1.5)   # longer than the head deadline: a request in progress is not cut
        return {"ok": True}

    cfg = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                         http=guarded(AutoHTTPProtocol, counters, head_timeout_s=0.6, per_client=3),
                         limit_concurrency=64)
    server = uvicorn.Server(cfg)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not server.started:
        assert time.monotonic() - t0 < 15 and th.is_alive(), "server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port, counters
    finally:
        server.should_exit = True
        th.join(10)


def test_a_request_head_that_never_ends_is_closed_and_a_request_in_progress_is_not(small_server):
    port, counters = small_server
    socks = _half_open(port, 2)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        slow = c.get("/slow")   # 1.5 s of work after its head: served whole despite the 0.6 s head deadline
    assert slow.status_code == 200
    time.sleep(0.5)
    assert [_state(s) for s in socks] == ["closed", "closed"]
    assert counters["connections_closed_slow"] == 2
    # a keep-alive connection that dribbles its next request is closed too; one that asks in time is served
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _state(s, 2).startswith("HTTP/1.1 200")
    s.sendall(b"GET /ping HTTP/1.1\r\n")
    time.sleep(1.0)
    assert _state(s) == "closed" and counters["connections_closed_slow"] == 3
    for s in socks:
        s.close()


def test_one_address_holds_at_most_its_share_of_connections(small_server):
    port, counters = small_server
    mine = _half_open(port, 5)
    states = [_state(s, 0.05) for s in mine]   # well within the 0.6 s head deadline
    assert states[:3] == ["open"] * 3, states
    assert all(st.startswith("HTTP/1.1 503") for st in states[3:]), states
    assert counters["connections_refused"] == 2
    # another address is served meanwhile; so is this one once its connections are gone
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5,
                      transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
        assert other.get("/ping").status_code == 200
    for s in mine:
        s.close()
    time.sleep(0.2)
    assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5).status_code == 200


@pytest.mark.network
def test_a_node_stays_reachable_under_a_slowloris(tmp_path):
    sets = [x for kv in SWARM_DEFAULTS + ["n_blocks=1", "objective=paper"] for x in ("--set", kv)]
    node = NodeProc("victim", ["seed", "--run-id", "slowloris", "--data", str(TEST_CORPUS), *sets,
                               "--max-steps", "2"], tmp_path / "victim")
    socks = []
    try:
        node.start()
        node.wait_ready()
        port = node.bound_http_port
        socks = _half_open(port, 70)   # more than uvicorn's limit_concurrency (64)
        states = [_state(s, 0.1) for s in socks]
        assert states.count("open") == PER_CLIENT_CONNECTIONS, states
        assert all(st.startswith("HTTP/1.1 503") for st in states if st != "open"), set(states)
        with httpx.Client(timeout=10, transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
            r = other.get(node.url + "/v1/status")
            assert r.status_code == 200 and r.json()["run"]["run_id"] == "slowloris"
            metrics = other.get(node.url + "/metrics").text
        assert f"blocktrain_http_connections_refused_total {float(70 - PER_CLIENT_CONNECTIONS)!r}" in metrics, metrics
        assert node.alive
    finally:
        for s in socks:
            s.close()
        node.stop()
