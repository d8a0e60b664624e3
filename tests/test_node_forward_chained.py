"""forward-chained in the node: block b's worker keeps read-only snapshots of blocks < b, refreshed
from their holders over the network, and trains on them; without them it neither trains nor
averages. These tests drive a BlockTrainer directly; test_node_objectives.py runs the objective
on real node processes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktrain.blocks.objectives import get_objective
from blocktrain.node.averaging.rounds import BlockAverager
from blocktrain.node.trainer import BlockTrainer, UpstreamNotReady
from blocktrain.node.upstream import UpstreamSnapshots

from test_utils.configs import tiny_config

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


def fc_trainer(b: int) -> BlockTrainer:
    cfg = tiny_config(objective="forward-chained")
    up = UpstreamSnapshots(get_objective(cfg), b, torch.device("cpu")) if b > 0 else None
    return BlockTrainer(cfg, b, DATA, DATA, seed=0, worker_id=b, upstream=up)


def test_a_downstream_trainer_waits_for_its_snapshots_and_refuses_bad_ones():
    t0, t2 = fc_trainer(0), fc_trainer(2)
    assert t0.ready() and t0.train_step()["loss"] > 0       # block 0 needs nothing
    assert not t2.ready()
    with pytest.raises(UpstreamNotReady, match="0, 1"):
        t2.train_step()
    with pytest.raises(UpstreamNotReady):
        t2.check_loss()
    assert t2.step == 0
    good = t0.state_tensors()
    bad = {k: v.clone() for k, v in good.items()}
    next(iter(bad.values())).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        t2.upstream.install(0, bad, {"peer": "x", "step": 1})
    with pytest.raises(ValueError, match="does not fit"):   # the state of a different block: wrong names/shapes
        t2.upstream.install(1, good, {"peer": "x", "step": 1})
    with pytest.raises(ValueError, match="no snapshot of block 2"):
        t2.upstream.install(2, good, {})
    assert t2.upstream.missing() == [0, 1]
    t2.upstream.install(0, good, {"peer": "p0", "step": 1})
    t2.upstream.install(1, fc_trainer(1).state_tensors(), {"peer": "p1", "step": 0})
    assert t2.ready() and t2.upstream.meta[0]["peer"] == "p0"
    snaps = t2.upstream.modules()
    assert not any(p.requires_grad for m in snaps for p in m.parameters())
    before = [p.detach().clone() for p in snaps[0].parameters()]
    t2.train_step()
    assert t2.step == 1 and all(torch.equal(p, q) for p, q in zip(snaps[0].parameters(), before))
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
