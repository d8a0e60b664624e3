"""bench inference / bench swarm: the --tiny --json code paths over real node processes.

Only structural facts are asserted (traversal counts, that the injected delay really lands on
the wall clock, that averaging happened with averaging on and not without, that the measured
averaging bytes match the all-reduce's analytic payload), never the issue's quality or speed
goals: the machine running the suite may be busy.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from test_utils.configs import TEST_CORPUS, TEST_CORPUS_PROTOCOL
from test_utils.zygote import run_cli

pytestmark = [pytest.mark.network, pytest.mark.slow]


def bt_json(*args, timeout=420) -> dict:
    p = run_cli(list(args), timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, f"--json must print exactly one line on stdout, got {p.stdout[-2000:]!r}"
    return json.loads(lines[0])


def test_bench_inference_tiny_json():
    r = bt_json("bench", "inference", "--tiny", "--json", "--data", str(TEST_CORPUS))
    assert r["bench"] == "inference" and r["protocol"] == TEST_CORPUS_PROTOCOL
    assert r["hops"] == 2 and r["delay_ms"] == 25.0
    assert r["speedup"] > 1.0
    assert set(r["bytes_out"]) == {"one_sweep", "autoregressive"}
    assert 0 < r["bytes_out"]["one_sweep"] < r["bytes_out"]["autoregressive"]
    (row,) = r["lengths"]
    n = row["n"]
    assert n == r["headline_bytes"] == 8
    one, ar = row["one_sweep"], row["autoregressive"]
    assert one["traversals"] == 1 and ar["traversals"] == n          # one traversal per output vs per byte
    assert one["hop_calls"] == r["hops"] and ar["hop_calls"] == n * r["hops"]
    assert one["failovers"] == 0 and ar["failovers"] == 0
    # the injected delay is on the wall clock: each hop round trip waits 2 x 25 ms
    assert one["wall_s"] >= 0.95 * row["injected_delay_floor_s"]["one_sweep"] == pytest.approx(0.095)
    assert ar["wall_s"] >= 0.95 * row["injected_delay_floor_s"]["autoregressive"]
    assert row["speedup"] == pytest.approx(ar["wall_s"] / one["wall_s"])
    assert row["traversal_ratio"] == n
    q = row["quality"]
    for k in ("ref_ce_one_sweep", "ref_ce_autoregressive", "network_ref_ce_one_sweep"):
        assert 0 < q[k] < 20, (k, q[k])
    # greedy generation is deterministic: the network returns what the blocks produce in-process
    assert q["network_matches_local"] == {"one_sweep": True, "autoregressive": True}
    assert len(row["text"]["one_sweep"]) > 0


def test_bench_swarm_tiny_json():
    r = bt_json("bench", "swarm", "--tiny", "--json", "--data", str(TEST_CORPUS))
    assert r["bench"] == "swarm" and r["protocol"] == TEST_CORPUS_PROTOCOL
    runs = r["runs"]
    assert set(runs) == {"baseline", "avg-fp32"}
    base, avg = runs["baseline"], runs["avg-fp32"]
    steps = r["settings"]["max_steps"]
    # equal per-block step budget: every worker took exactly --max-steps local steps
    for run in (base, avg):
        assert all(w["steps"] == steps for w in run["workers"]), [w["steps"] for w in run["workers"]]
        assert run["chain_ce"] > 0 and len(run["chain_ce_by_replica"]) >= 1
    assert base["workers_n"] == 2 and avg["workers_n"] == 3
    # averaging happened with averaging on, and never without
    assert base["rounds"]["attempted"] == 0 and base["rounds"]["succeeded"] == 0
    assert base["bytes_sent_total"] == 0
    assert avg["rounds"]["succeeded"] > 0 and avg["rounds"]["rejected"] == 0
    rb = avg["rounds_by_block"]["1"]
    assert rb["replicas"] == 2 and rb["mean_group_size"] == 2.0
    # the final explicit round leaves the two replicas identical: both replica chains score the same
    assert avg["chain_ce_by_replica"][0] == pytest.approx(avg["chain_ce_by_replica"][1], abs=1e-5)
    # measured bytes (protobuf messages counted in the averager process) vs the all-reduce's payload:
    # 2 (g-1)/g x params x 4 bytes per formed round, plus a little matchmaking and framing
    assert avg["bytes_sent_total"] > 0
    ratio = avg["bytes_sent_total"] / avg["allreduce_payload_bytes_analytic_total"]
    assert 1.0 <= ratio < 1.3, ratio
    assert avg["gb_moved"] == pytest.approx(avg["bytes_sent_total"] / 1e9)
    assert "averaged_within_0.05" in r["goals"]


def test_bench_p2p_json_runs_its_own_server_and_leaves_nothing_behind():
    r = bt_json("bench", "p2p", "--lookups", "3", "--hops", "3", "--large", "1", "--json", timeout=300)
    assert r["samples"] == {"lookups": 3, "hops": 3, "large": 1}
    assert r["rpc_small_hop_shape"] == [1, 256, 64]
    assert r["rpc_large_hop_MiB_each_way"] == 16.0 and r["state_download_MiB"] == 16.0
    for k in ("dht_lookup_ms_median", "rpc_rtt_ms_median", "rpc_large_hop_s_median", "rpc_large_hop_MBps_both_ways",
              "state_download_MBps"):
        assert r[k] > 0, (k, r[k])
    # a streamed 16 MiB hop moves its state both ways: at least 32 MiB per call
    assert r["rpc_large_hop_MBps_both_ways"] * r["rpc_large_hop_s_median"] >= 2 * 16 * 2**20 / 1e6
    left = subprocess.run(["pgrep", "-f", "blocktrain.bench.p2p --serve"], capture_output=True, text=True).stdout
    assert left.strip() == "", f"benchmark server left running: {left}"
