"""forward-chained in the node: block b's worker keeps read-only snapshots of blocks < b, refreshed
from their holders over the network, and trains on them; without them it neither trains nor
averages. The first tests drive a BlockTrainer directly; the last starts real node processes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktrain.node.averaging import BlockAverager
from blocktrain.node.launcher import LocalSwarm
from blocktrain.node.trainer import BlockTrainer, UpstreamNotReady

from helpers import need_wikitext, tiny_config
from reliability_helpers import wait_for

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


def fc_trainer(b: int) -> BlockTrainer:
    return BlockTrainer(tiny_config(objective="forward-chained"), b, DATA, DATA, seed=0, worker_id=b)


def test_a_downstream_trainer_waits_for_its_snapshots_and_refuses_bad_ones():
    t0, t2 = fc_trainer(0), fc_trainer(2)
    assert t0.upstream_ready() and t0.train_step()["loss"] > 0       # block 0 needs nothing
    assert not t2.upstream_ready()
    with pytest.raises(UpstreamNotReady, match="0, 1"):
        t2.train_step()
    with pytest.raises(UpstreamNotReady):
        t2.check_loss()
    assert t2.step == 0
    good = t0.state_tensors()
    bad = {k: v.clone() for k, v in good.items()}
    next(iter(bad.values())).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        t2.set_upstream(0, bad, {"peer": "x", "step": 1})
    with pytest.raises(RuntimeError):   # the state of a different block: wrong names/shapes
        t2.set_upstream(1, good, {"peer": "x", "step": 1})
    with pytest.raises(ValueError, match="no snapshot of block 2"):
        t2.set_upstream(2, good, {})
    assert t2.upstream == [None, None]
    t2.set_upstream(0, good, {"peer": "p0", "step": 1})
    t2.set_upstream(1, fc_trainer(1).state_tensors(), {"peer": "p1", "step": 0})
    assert t2.upstream_ready() and t2.upstream_meta[0]["peer"] == "p0"
    assert not any(p.requires_grad for m in t2.upstream for p in m.parameters())
    before = [p.detach().clone() for p in t2.upstream[0].parameters()]
    t2.train_step()
    assert t2.step == 1 and all(torch.equal(p, q) for p, q in zip(t2.upstream[0].parameters(), before))
    assert np.isfinite(t2.check_loss())


@pytest.mark.network
def test_averaging_round_is_skipped_while_snapshots_are_missing():
    from blocktrain.p2p.discovery import Discovery

    disc = Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=["fc"])
    try:
        avg = BlockAverager(disc.dht, fc_trainer(1), "fc", peer_id=disc.peer_id, matchmaking_time=1.0)
        try:
            assert avg.round() is None
            assert "upstream" in avg.stats.last_failure and avg.stats.failed == 1
        finally:
            avg.shutdown()
    finally:
        disc.shutdown(withdraw=False)


@pytest.mark.network
@pytest.mark.slow
def test_block1_worker_trains_on_refreshed_snapshots_of_block0(tmp_path):
    data = need_wikitext()
    sw = LocalSwarm(tmp_path, run_id="fcnet", data=str(data),
                    overrides=["objective=forward-chained", "n_blocks=2", "d_model=64", "n_heads=2",
                               "layers_per_block=1", "seq_len=64", "batch_size=8"],
                    extra_args=["--device", "cpu", "--average-every", "1000000", "--average-period", "1e9"])
    try:
        seed = sw.start_seed(block=0)
        n1 = sw.start_join(block=1, args=["--upstream-refresh", "2"])
        peer0 = seed.info["peer_id"]

        def upstream():
            return n1.get("/v1/status")["self"]["upstream"]

        first = wait_for(lambda: (u := upstream())["ready"] and u, 60, "block 1's snapshot of block 0")
        snap = first["snapshots"][0]
        assert snap["block"] == 0 and snap["peer"] == peer0 and first["bytes"] > 0
        # the snapshot follows block 0's training, and block 1 trains on it
        later = wait_for(lambda: (u := upstream())["snapshots"][0]["step"] > snap["step"] + 5 and u, 60,
                         "a refreshed snapshot")
        assert later["refreshes"] > first["refreshes"] and later["bytes"] > first["bytes"]
        wait_for(lambda: n1.get("/v1/status")["self"]["step"] >= 20, 60, "block 1 training")
        up0 = seed.get("/v1/status")["self"]["upstream"]
        assert up0["ready"] and up0["snapshots"] == [] and up0["bytes"] == 0   # block 0 keeps no snapshots
        r = n1.post("/v1/generate", {"prompt": "The ", "max_bytes": 4, "mode": "one_sweep"}, timeout=120)
        assert r.status_code == 200, r.text
        g = r.json()
        assert g["traversals"] == 4 and [h["block"] for h in g["route"]] == [0, 1]
    finally:
        sw.stop_all()
