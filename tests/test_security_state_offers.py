"""Sybil holders offering a well-formed untrained block to a late joiner (an outsider with a plain hivemind
peer: tests/test_utils/outsider.py, no BlockTrain code).

A real two-block ``pipeline`` run on 127.0.0.1 (the default objective of a new run): the seed holds block 0,
one honest member holds block 1 and trains it. Three Sybil identities announce block 1 with signed records
and serve state downloads over the block RPC, well-formed on the wire: an *untrained* block 1 of the run's
shapes and config hash, claiming 10^9 steps. Before (RELIABILITY.md, 2026-12-05): every check a download
passed (finite, the block's shapes, the config) let that state through, and the late joiner trained from it
whenever a Sybil was asked first. Now a joiner downloads from up to ``--state-sources`` holders and keeps
the state the chain judges best (``node/state_fetch.py`` ``ChainJudge``: held-out CE with the offered block
in place, block 0 through the network). With ``--state-sources 4`` it judges all four and must keep the
honest member's state, whatever order it asked them in (the old first-acceptable rule kept a Sybil's three
times in four)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blocktrain.blocks.objectives import get_objective
from blocktrain.node.swarm.launcher import LocalSwarm

from test_utils.configs import TEST_CORPUS, tiny_config
from test_utils.reliability import MANUAL_AVG, QUIET_TRAINING, TINY, report, wait_for
from test_utils.wire_procs import NodeProc, stop_all

pytestmark = [pytest.mark.network, pytest.mark.reliability, pytest.mark.slow]

RUN = "offers"
OUTSIDER = str(Path(__file__).parent / "test_utils" / "outsider.py")


def _holders_of(node, b: int) -> int:
    return sum(len(x["holders"]) for x in node.get("/v1/status")["blocks"] if x["block"] == b)


def test_a_late_joiner_keeps_the_honest_state_past_sybils_offering_an_untrained_block(tmp_path):
    sw = LocalSwarm(tmp_path, run_id=RUN, overrides=["objective=pipeline", *TINY], data=str(TEST_CORPUS),
                    extra_args=[*MANUAL_AVG, "--device", "cpu", "--no-rebalance"])
    out = None
    try:
        seed = sw.start_seed(block=0)
        honest = sw.start_join(block=1)
        wait_for(lambda: honest.get("/v1/status")["self"]["step"] >= 40, 240, "block 1 trained 40 steps")
        run = seed.get("/v1/status")["run"]
        cfg = tiny_config(objective="pipeline", n_blocks=2, lr=0.002)
        assert cfg.config_hash == run["config_hash"]   # the Sybils' tensors have the run's exact shapes
        offer = tmp_path / "untrained-block1.pt"
        torch.save(get_objective(cfg).build_block(1).state_dict(), offer)   # costs a Sybil no training at all

        out = NodeProc("outsider", ["--initial-peer", sw.seed_maddr], tmp_path, script=OUTSIDER)
        out.wait_ready(timeout=120)
        syb = out.cmd("sybils", run_id=RUN, block=1, config_hash=run["config_hash"], n=3, stall=3,
                      offer_file=str(offer), timeout=300)
        assert syb["stored"] == 3
        wait_for(lambda: _holders_of(seed, 1) >= 4, 90, "the 3 Sybils in the seed's view of block 1")

        joiner = sw.start_join(block=1, args=["--state-sources", "4", "--max-steps", "0", *QUIET_TRAINING])
        me = joiner.get("/v1/status")["self"]
        late = me["late_join"]
        h1 = honest.info["peer_id"]
        assert me["downloaded_state"] and late["from"] == h1, late
        assert late["judged_by"] == "chain ce"
        scores = {c["peer"]: c.get("score") for c in late["compared"]}
        sybils = set(syb["stalling"])
        assert set(scores) == sybils | {h1}, late   # all four judged
        assert all(scores[s] is not None and scores[s] > scores[h1] for s in sybils), late
        assert me["step"] >= 40   # the honest member's step, not the 10^9 a Sybil claims
        report("sybil_state_offers", sybils=3, sources=4, chosen=late["from"] == h1, fresh_ce=late["fresh"],
               honest_ce=scores[h1], sybil_ce=sorted(scores[s] for s in sybils), download_s=late["s"],
               asked=[("honest" if c["peer"] == h1 else "sybil") for c in late["compared"]])
    finally:
        if out is not None:
            stop_all([out])
        sw.stop_all()
