"""A chain slower than ``--pipeline-timeout`` still trains (real processes; issue 13's faults item).

Three node processes, one block each, every hop RPC delayed (``--inject-delay-ms 300``: each hop's
round trip gains 0.6 s, so block 0's round trip through blocks 1 and 2 takes more than 1.2 s) and
``--pipeline-timeout 1``. A fixed 1 s budget would lose every micro-batch (the d_model-768 pipeline
on two cores lost all of its: BENCHMARKS.md). The block-0 holder's budget adapts
(node/pipeline/budget.py): the first micro-batches are lost to the timeout, the budget backs off,
the rest complete and every block trains. The engine's side in process: tests/test_pipeline_budget.py.
"""
from __future__ import annotations

import httpx
import pytest

from blocktrain.node.swarm.launcher import LocalSwarm

from test_utils.configs import TEST_CORPUS
from test_utils.reliability import stop_swarm, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.timeout(300)]

TINY = ["n_blocks=3", "d_model=32", "n_heads=2", "layers_per_block=1", "seq_len=32", "target_dim=16",
        "batch_size=4", "warmup_steps=0", "lr=0.003"]
EXTRA = ["--device", "cpu", "--average-every", "1000000", "--inject-delay-ms", "300",
         "--pipeline-timeout", "1", "--pipeline-timeout-max", "60"]


def pipe(node) -> dict:
    return node.get("/v1/status")["self"]["pipeline"]


def test_a_chain_slower_than_the_timeout_trains_once_the_budget_backs_off(tmp_path):
    sw = LocalSwarm(tmp_path, run_id="slowchain", data=str(TEST_CORPUS), overrides=["objective=pipeline", *TINY],
                    extra_args=EXTRA)
    try:
        b2 = sw.start_seed(block=2)
        b1 = sw.start_join(block=1, name="b1")
        b0 = sw.start_join(block=0, name="b0")
        wait_for(lambda: pipe(b0)["completed"] >= 8, 150, "8 micro-batches completed by block 0's holder")
        p0 = pipe(b0)
        budget = p0["budget"]
        assert p0["settings"]["timeout_s"] == 1.0 and p0["settings"]["timeout_max_s"] == 60.0
        assert p0["lost_by_reason"].get("timeout", 0) >= 1, p0     # the 1 s start was too short ...
        assert budget["backoffs"] >= 1 and budget["samples"] >= 8, budget
        assert budget["srtt_s"] > 1.0 and budget["budget_s"] > 1.0, budget   # ... for every round trip
        assert pipe(b1)["answered"] >= 8 and pipe(b2)["answered"] >= 8
        for n in (b0, b1, b2):
            assert n.get("/v1/status")["self"]["step"] >= 8        # every block trained
        assert pipe(b1)["budget"] is None                          # only block 0 keeps a budget
        metrics = httpx.get(b0.url + "/metrics", timeout=30).text
        gauge = next(ln for ln in metrics.splitlines()
                     if ln.startswith("blocktrain_pipeline_microbatch_budget_seconds"))
        assert float(gauge.split()[1]) > 1.0, gauge
    finally:
        stop_swarm(sw)
