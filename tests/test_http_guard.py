"""Slowloris and greedy clients against a node's HTTP server (``node/http/guard.py``).

Before the guard, 64 sockets that had each sent half a request line made uvicorn answer 503 to every
other client, for as long as they stayed open (measured: 200 such sockets, every legitimate request
503 at 1 s, 10 s and 30 s, all 200 still open at 30 s).

In process: uvicorn serving a small app through ``guarded`` with short limits (a request head must
arrive within 0.6 s, 3 connections per address), raw sockets as the attacker. Live: a real
``bt-node seed`` with the defaults and 70 half-open sockets from one address.

And the API's heavy slots (generate, score): one address runs at most half of them at once; before,
one client within its rate limit could keep all of them busy and every other client got 503.
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

from blocktrain.blocks.config import ModelConfig
from blocktrain.node.http.api import create_app
from blocktrain.node.http.guard import PER_CLIENT_CONNECTIONS, guarded
from blocktrain.node.swarm.launcher import NodeProc
from blocktrain.node.swarm.run import SWARM_DEFAULTS

from test_utils.configs import TEST_CORPUS
from test_utils.local_backend import LocalBackend

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


def _serve(app, http=None):
    """uvicorn serving ``app`` on a free port of 127.0.0.1 in a thread; returns (server, thread, port)."""
    cfg = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                         limit_concurrency=64, **({"http": http} if http is not None else {}))
    server = uvicorn.Server(cfg)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not server.started:
        assert time.monotonic() - t0 < 15 and th.is_alive(), "server did not start"
        time.sleep(0.02)
    return server, th, server.servers[0].sockets[0].getsockname()[1]


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

    server, th, port = _serve(app, guarded(AutoHTTPProtocol, counters, head_timeout_s=0.6, per_client=3))
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


class GatedBackend(LocalBackend):
    """Real blocks; each generation waits at a gate first (so the test decides how long requests run)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def generate(self, *a):
        self.entered.release()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().generate(*a)


def test_one_address_runs_at_most_half_the_heavy_slots(tmp_path):
    cfg = ModelConfig(objective="paper", seq_len=16, n_blocks=2, d_model=32, n_heads=2, layers_per_block=1,
                      target_dim=16, chunk_len=16)
    backend = GatedBackend(cfg)
    server, th, port = _serve(create_app(backend, max_concurrent=4, rate_per_s=1e9, burst=10 ** 9))
    url = f"http://127.0.0.1:{port}/v1/generate"
    body = {"prompt": "The ", "max_bytes": 4}
    results: dict = {}

    def post(key, src):
        with httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=src)) as c:
            results[key] = c.post(url, json=body)

    greedy = [threading.Thread(target=post, args=(f"a{i}", "127.0.0.1")) for i in range(2)]
    try:
        for t in greedy:
            t.start()
        for _ in greedy:   # both of the first address's requests are running
            assert backend.entered.acquire(timeout=30)
        post("a-third", "127.0.0.1")   # its share is taken: refused at once, with the reason
        assert results["a-third"].status_code == 503 and "its share" in results["a-third"].json()["detail"]
        other = threading.Thread(target=post, args=("b", "127.0.0.2"))
        other.start()
        assert backend.entered.acquire(timeout=30), "another address was not let in"
        backend.gate.set()
        for t in [*greedy, other]:
            t.join(60)
        assert [results[k].status_code for k in ("a0", "a1", "b")] == [200, 200, 200]
        post("a-later", "127.0.0.1")   # its requests done: served again
        assert results["a-later"].status_code == 200
    finally:
        backend.gate.set()
        server.should_exit = True
        th.join(10)
