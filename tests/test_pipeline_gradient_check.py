"""Gradient checks (node/pipeline/verify.py): a stage recomputes sampled answers of the next block's holders.

Live: a 2-block `pipeline` run of real node processes; a Sybil (tests/test_utils/sybil_stage.py: its own daemon
and key, a signed record stored through a plain hivemind DHT peer) announces itself as a holder of block 1 and
answers every micro-batch with the true gradient negated, serving the honest weights for state downloads. Before
the checks one such Sybil took 79-96 % of block 0's micro-batches and the chain's held-out CE from 2.52 to 17.7 in
two minutes (docs/records/s36/sybil_gradient_probe.py); now its first answer fails the check, it is banned, and the
chain trains on through the honest holder. The checks are opt-in (``--pipeline-check-rate``, given here); with 0
(the default) this test fails (nothing is checked).
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from blocktrain.node.swarm.launcher import LocalSwarm

from test_utils.configs import TEST_CORPUS
from test_utils.reliability import MANUAL_AVG, report, stop_swarm, wait_for

RUN = "gradcheck"
D, T = 32, 32
PIPE = ["objective=pipeline", "n_blocks=2", f"d_model={D}", "n_heads=2", "layers_per_block=1", f"seq_len={T}",
        "target_dim=16", "batch_size=4", "warmup_steps=0", "lr=0.003"]


def _objective():
    from blocktrain.blocks.config import ModelConfig
    from blocktrain.blocks.objectives import get_objective
    return get_objective(ModelConfig(objective="pipeline", n_blocks=3, d_model=D, n_heads=2, layers_per_block=1,
                                     seq_len=T, batch_size=4))


def test_the_check_passes_honest_gradients_and_catches_negated_ones_and_cannot_be_dodged():
    from blocktrain.node.pipeline.verify import CheckInconclusive, GradientCheck
    obj = _objective()
    torch.manual_seed(0)
    blocks = {1: obj.build_block(1), 2: obj.build_block(2)}
    states = {("QmB", 1): blocks[1].state_dict(), ("QmC", 2): blocks[2].state_dict()}
    fetched = []

    async def fetch(peer, b):
        fetched.append((peer, b))
        if (peer, b) not in states:
            raise TimeoutError("no answer")
        return states[(peer, b)]

    h = torch.randn(4, T, D)
    y = torch.randint(0, 256, (4, T))
    x = h.clone().requires_grad_(True)
    loss, _ = obj.stage_loss(blocks[2], 2, obj.stage_forward(blocks[2], 2, obj.stage_forward(blocks[1], 1, x, None),
                                                               None), y)
    loss.backward()
    true = x.grad.detach()
    check = GradientCheck(obj, 0, 3, fetch, rate=0.0)
    assert not check.on            # rate 0: off
    check = GradientCheck(obj, 0, 3, fetch, rate=0.05, after_steps=200)
    assert not check.due("QmB", 199) and check.due("QmB", 200)   # from step 200, a holder's first answer is checked
    drifted = 1.05 * true + 0.3 * true.abs().mean() * torch.randn_like(true)   # an honest answer, weights moved since
    assert asyncio.run(check.check(h, y, drifted, ["QmB", "QmC"])) == (None, False)
    assert fetched == [("QmB", 1), ("QmC", 2)]   # the route's holders, one block each
    assert sum(check.due("QmB", 500) for _ in range(2000)) < 200   # then about the sampled rate
    why, convicted = asyncio.run(check.check(h, y, -true, ["QmB", "QmC"]))
    assert "cosine -1.0" in why and not convicted and check.due("QmB", 500)   # its next answer is checked too
    why, convicted = asyncio.run(check.check(h, y, -true, ["QmB", "QmC"]))
    assert "second time in a row" in why and convicted                        # twice in a row: convicted
    for route in (["QmB"], ["QmB", "QmX"]):     # a route of the wrong length, a holder that serves no state
        with pytest.raises(CheckInconclusive):
            asyncio.run(check.check(h, y, -true, route))
    assert check.due("QmX", 500) and GradientCheck(obj, 2, 3, fetch).on is False   # the last block answers to nobody


@pytest.mark.network
@pytest.mark.reliability
@pytest.mark.timeout(300)
def test_a_sybil_answering_negated_gradients_is_caught_banned_and_the_chain_trains_on(tmp_path):
    from blocktrain.node.client import NetworkClient
    from test_utils.sybil_stage import SybilStage
    sw = LocalSwarm(tmp_path, run_id=RUN, overrides=PIPE, data=str(TEST_CORPUS),
                    extra_args=["--device", "cpu", *MANUAL_AVG, "--train-duty", "0.5", "--no-rebalance",
                                "--pipeline-check-rate", "0.05"])
    sybil, client = None, None
    try:
        b0 = sw.start_seed(block=0)
        b1 = sw.start_join(block=1)
        sybil = SybilStage(RUN, 1, b1.info["maddrs"])   # its daemon before this process's client DHT
        client = NetworkClient([sw.seed_maddr], RUN)
        pipe = lambda: b0.get("/v1/status")["self"]["pipeline"]   # noqa: E731
        wait_for(lambda: b0.get("/v1/status")["self"]["step"] >= 210 and pipe()["gradient_checks"] >= 1, 180,
                 "block 0 past the checks' first 200 steps, the honest holder's first answer checked")
        honest = pipe()
        assert honest["gradient_checks"] >= 1 and honest["gradient_checks_failed"] == 0, honest   # the honest holder passed
        block1 = client.objective.build_block(1)
        block1.load_state_dict(sybil.download(b1.info["peer_id"]))
        sybil.serve(client.objective, block1, sign=-1.0, serve_state=True, d_model=D, max_seq=T, n_blocks=2,
                    config_hash=b0.get("/v1/status")["run"]["config_hash"], initial_peer=sw.seed_maddr)
        wait_for(lambda: pipe()["gradient_checks_failed"] >= 2, 90, "the Sybil's first two answers caught")
        caught, answered = pipe(), sybil.answered
        time.sleep(15)   # convicted: banned for 60 s, asked no more meanwhile; the chain trains on through the honest holder
        end = pipe()
        assert sybil.answered == answered <= 3, (answered, sybil.answered)
        assert end["completed"] >= caught["completed"] + 5 and end["gradient_checks_failed"] == caught["gradient_checks_failed"]
        assert end["lost_by_reason"].get("bad_gradient", 0) == end["gradient_checks_failed"], end
        report("pipeline_gradient_check", sybil_answered=sybil.answered, checks=end["gradient_checks"],
               failed=end["gradient_checks_failed"], completed_after=end["completed"] - caught["completed"])
    finally:
        if client is not None:
            client.close()
        if sybil is not None:
            sybil.close()
        stop_swarm(sw)
