"""Every non-default objective on real node processes (the default, ``paper``, runs through the
``bt-node swarm`` contract in test_node_cli.py): block 0 and two replicas of block 1 train, the
replicas average (acceptance judges a round with the objective's own held-out check loss), the
chain is scored and generates through hops between processes. chunked-masked passes an (N, T, 2)
state between hops and emits one chunk per traversal, chunked-continuous an (N, T, target_dim) noisy
chunk, also one chunk per traversal; forward-chained (and forward-residual) passes a hidden state
(N, T, d_model), emits one byte per traversal, and its block-1 workers train on snapshots of block 0
that they download from block 0's holder and refresh."""
from __future__ import annotations

import math

import pytest

from blocktrain.node.http.jobs import run_job
from blocktrain.node.swarm.launcher import LocalSwarm

from test_utils.configs import TEST_CORPUS
from test_utils.reliability import average_until_accepted, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow]

SMALL = ["n_blocks=2", "d_model=64", "n_heads=2", "layers_per_block=1", "seq_len=64", "target_dim=16",
         "batch_size=8", "chunk_len=4"]
MANUAL_AVG = ["--average-every", "1000000", "--average-period", "1e9", "--average-clock", "0"]
# 15 steps are reached in seconds at 0.3 of wall time; flat-out training of 3 nodes on 2 cores only
# slowed the eval and the generation the test waits for
DUTY = ["--train-duty", "0.3"]


@pytest.mark.parametrize("objective,ce_kind,per_traversal", [("chunked-masked", "bound", 4),
                                                            ("chunked-continuous", "bound", 4),
                                                            ("forward-chained", "exact", 1),
                                                            ("forward-residual", "exact", 1)])
def test_objective_trains_averages_scores_and_generates_across_processes(tmp_path, objective, ce_kind,
                                                                       per_traversal):
    data = TEST_CORPUS
    sw = LocalSwarm(tmp_path, run_id="objnet", data=str(data), overrides=[f"objective={objective}", *SMALL],
                    extra_args=["--device", "cpu", *MANUAL_AVG, *DUTY])
    try:
        seed = sw.start_seed(block=0)
        refresh = ["--upstream-refresh", "2"]
        r1 = sw.start_join(block=1, args=refresh, wait=False, name="r1")
        r2 = sw.start_join(block=1, args=refresh, wait=False, name="r2")
        for n in (r1, r2):
            n.wait_ready()
        # 30 steps each: the bound CE of chunked-continuous is still near log(256) at 15 (5.57 in a loaded
        # CI run that evaluated right after the 15th; 5.07 at 46-82 steps)
        wait_for(lambda: all(n.get("/v1/status")["self"]["step"] >= 30 for n in (seed, r1, r2)), 120,
                 "every node training")
        v = average_until_accepted([r1, r2])
        assert all(x.get("accepted") is True for x in v.values()), v
        ev = run_job(seed.url, "/v1/eval", timeout=120)   # an operator job: 202, then poll it
        assert ev["status"] == "done", ev
        res = ev["result"]
        print(f"\n{objective}: chain CE {res['chain_ce']:.4f} at steps "
              f"{[n.get('/v1/status')['self']['step'] for n in (seed, r1, r2)]}")
        assert res["ce_kind"] == ce_kind and res["chain_ce"] < math.log(256), res
        g = r1.post("/v1/generate", {"prompt": "The ", "max_bytes": 8, "mode": "one_sweep"}, timeout=120)
        assert g.status_code == 200, g.text
        g = g.json()
        assert g["bytes_generated"] == 8 and g["traversals"] == 8 // per_traversal, g
        assert [h["block"] for h in g["route"]] == [0, 1]
        up = r1.get("/v1/status")["self"]["upstream"]
        if not objective.startswith("forward-"):
            assert up is None
            return
        # block 1 trains on block 0 as its holder has it, and follows it as it trains
        snap = up["snapshots"][0]
        assert up["ready"] and snap["peer"] == seed.info["peer_id"] and up["bytes"] > 0, up
        later = wait_for(lambda: (u := r1.get("/v1/status")["self"]["upstream"])["snapshots"][0]["step"]
                         > snap["step"] and u, 60, "a refreshed snapshot of block 0")
        assert later["refreshes"] > up["refreshes"] and later["bytes"] > up["bytes"]
        up0 = seed.get("/v1/status")["self"]["upstream"]
        assert up0["ready"] and up0["snapshots"] == [] and up0["bytes"] == 0   # block 0 keeps none
    finally:
        sw.stop_all()
