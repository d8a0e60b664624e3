"""How long a real block takes to reach a new holder: a late joiner's download (the node's own path: the
block RPC, each offer judged, ``StateFetcher.fetch_best``; until 2026-12-06 hivemind's state download
first) and the block RPC a rebalancing move uses
(``StateFetcher.fetch``, timed in a separate client process), for blocks larger than the tests' tiny
ones (default d_model 512 x 4 layers, ~12.6M parameters, ~50 MB fp32), on 127.0.0.1 and between two
network namespaces whose links are limited to 20 Mbit/s (``tc tbf``, :mod:`test_utils.netns`).

A measurement, not a target: it runs only when asked (``BT_MOVE_TIME=1``; ``BT_MOVE_TIME_SIZES=512x4,768x4``
for more sizes; ``BT_MOVE_TIME_NETNS=0`` for loopback only) and asserts only that every download
arrived whole; seconds and MB/s go to the output and to $BT_RELIABILITY_LOG (BENCHMARKS.md
"Move time for a real block"), from which the simulator's move and download times are derived.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_utils.configs import TEST_CORPUS
from test_utils.netns import NetLab, skip_without_namespaces
from test_utils.ns_nodes import NODE_ARGS, start_join, start_seed
from test_utils.reliability import RelSwarm, report, stop_swarm

ASKED = os.environ.get("BT_MOVE_TIME", "") not in ("", "0")
SIZES = [tuple(int(x) for x in s.split("x")) for s in os.environ.get("BT_MOVE_TIME_SIZES", "512x4").split(",")]
NETNS = os.environ.get("BT_MOVE_TIME_NETNS", "1") != "0"
RATE_MBIT = 20
FETCHES = 2

pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not ASKED, reason="a measurement, run only when asked: BT_MOVE_TIME=1 "
                                 "pytest -n 0 -s tests/test_move_time.py")]

# the block RPC of a move (StateFetcher.fetch, as Rebalancer._download calls it), timed in its own process
FETCH = """
import json, sys, time
from blocktrain.node.client import NetworkClient
peer, run, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = NetworkClient([peer], run)
try:
    holders = [h for h in c.holders().get(0, []) if h.state == "online"]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        f = c.fetcher.fetch(0, holders, timeout=600)
        dt = time.perf_counter() - t0
        if f is None:
            out.append({"error": "no holder delivered"})
            continue
        mb = sum(t.numel() * t.element_size() for t in f.tensors.values()) / 1e6
        out.append({"s": round(dt, 2), "mb": round(mb, 2), "mb_per_s": round(mb / dt, 2)})
    print("FETCHED " + json.dumps(out), flush=True)
finally:
    c.close()
"""


def block_config(d_model: int, layers: int) -> list[str]:
    return [f"d_model={d_model}", "n_heads=8", f"layers_per_block={layers}", "n_blocks=1", "seq_len=32",
            "target_dim=16", "batch_size=2", "warmup_steps=0"]


def fetch_in(prefix: list[str], maddr: str, run: str) -> list[dict]:
    r = subprocess.run([*prefix, sys.executable, "-c", FETCH, maddr, run, str(FETCHES)], capture_output=True,
                       text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((x for x in r.stdout.splitlines() if x.startswith("FETCHED ")), None)
    assert r.returncode == 0 and line, f"the fetch client failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(line[len("FETCHED "):])


def _check(late: dict | None, fetched: list[dict], mb: float) -> None:
    assert late and late["via"] is not None, f"the late joiner downloaded nothing: {late}"
    assert all("error" not in f and abs(f["mb"] - mb) < 0.01 for f in fetched), (fetched, mb)


@pytest.mark.parametrize("size", SIZES, ids=[f"{d}x{n}" for d, n in SIZES])
def test_move_time_loopback(tmp_path, size):
    d, layers = size
    run = f"move{d}x{layers}"
    sw = RelSwarm(tmp_path, run_id=run, overrides=block_config(d, layers), data=str(TEST_CORPUS),
                  extra_args=NODE_ARGS)
    try:
        sw.start_seed(block=0)
        joiner = sw.join(0, name="late")
        joiner.wait_ready(timeout=600)
        late = joiner.info["late_join"]
        fetched = fetch_in([], sw.seed_maddr, run)
        report("move_time", link="127.0.0.1", d_model=d, layers=layers, block_mb=late["mb"], late_join=late,
               late_join_mb_per_s=round(late["mb"] / late["s"], 2), move_fetch=fetched)
        _check(late, fetched, late["mb"])
    finally:
        stop_swarm(sw, grace=20)


@pytest.mark.parametrize("size", SIZES, ids=[f"{d}x{n}" for d, n in SIZES])
def test_move_time_namespaces_20mbit(tmp_path, size):
    if not NETNS:
        pytest.skip("BT_MOVE_TIME_NETNS=0")
    skip_without_namespaces()
    d, layers = size
    run = f"nsmove{d}x{layers}"
    nodes = []
    with NetLab(rate_mbit=RATE_MBIT) as lab:
        try:
            a, b, c = lab.host("a"), lab.host("b"), lab.host("c")
            nodes.append(start_seed(a, tmp_path, run, block_config(d, layers)))
            nodes.append(start_join(b, tmp_path, nodes[0], run, block=0))
            nodes[1].wait_ready(timeout=900)
            late = nodes[1].info["late_join"]
            fetched = fetch_in(c.cmd(), nodes[0].maddr, run)   # host c: its own link, seed's uplink shared
            report("move_time", link=f"netns {RATE_MBIT} Mbit/s tbf", d_model=d, layers=layers, block_mb=late["mb"],
                   late_join=late, late_join_mb_per_s=round(late["mb"] / late["s"], 2), move_fetch=fetched)
            _check(late, fetched, late["mb"])
        finally:
            for n in nodes:
                n.stop(timeout=10)
