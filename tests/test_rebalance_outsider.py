"""A chain-trained node's rebalancing move seen by an outsider: a plain hivemind peer sending raw ``rpc_train``
messages to the node's old and new block while the move runs (node/pipeline/compose.py ``PreparedSwitch``).

The node's own parts run for real: its engine and ``rpc_train`` service (``start_pipeline``, ``PreparedSwitch``),
its train loop (``Node._run_pipeline``, in a thread), two libp2p daemons on 127.0.0.1 (the node's and the
outsider's, both in this process). What is not a node here: the DHT and the router (no block-2 holder is
listed to the new block 1, so what it accepts after the commit fails downstream, typed). The window
between preparing and committing lasts ~0.2 s in a live move (tests/test_rebalance_pipeline.py); here the
test holds it open and attacks it:
- before the commit the new block's service answers every message with a typed refusal and computes
  nothing: no gradient reaches the downloaded weights it is about to train;
- the old block keeps training outsiders' micro-batches until the commit, then refuses them (``busy``: its
  senders try another holder) and, once retired, is gone from the wire;
- an abandoned move's prepared service is gone from the wire, the node's block untouched."""
from __future__ import annotations

import time

import pytest
import torch
from hivemind.p2p import P2P

from blocktrain.node.pipeline.compose import PreparedSwitch
from blocktrain.node.trainer import BlockTrainer
from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.hops import decode_meta
from blocktrain.p2p.pipeline_wire import StageRequest, request_message
from blocktrain.p2p.tensors import encode_tensor

from test_utils.configs import tiny_config
from test_utils.pipeline_node import PipelineNode, holder
from test_utils.raw_pipeline import raw_train_call
from test_utils.reliability import wait_for

pytestmark = [pytest.mark.network, pytest.mark.timeout(180)]

RUN = "switch-outsider"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
N, T, D = 2, 32, 32


def _message(block: int, rid: str) -> tuple[dict, list]:
    """A well-formed raw request for ``block``, as metadata and tensors."""
    g = torch.Generator().manual_seed(len(rid))
    req = StageRequest(block, torch.randn(N, T, D, generator=g) * 0.1, torch.randint(0, 256, (N, T), generator=g),
                       "backprop", "fp32", deadline_s=5.0, request_id=rid)
    meta, pbs, _, _ = request_message(req)
    return decode_meta(meta), pbs


def _bad(block: int, state: torch.Tensor) -> tuple[dict, list]:
    """A raw request no client of ours would send (``state`` as is, NaN included)."""
    meta = {"v": 1, "request_id": "bad", "block_index": block, "mode": "backprop", "codec": "fp32", "deadline_s": 5.0}
    return meta, [encode_tensor(state), encode_tensor(torch.randint(0, 256, (N, T), dtype=torch.int64))]


def _weights(trainer: BlockTrainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


def _unchanged(trainer: BlockTrainer, before: dict) -> bool:
    now = trainer.module.state_dict()
    return all(torch.equal(now[k], v) for k, v in before.items()) and \
        all(p.grad is None or not p.grad.any() for p in trainer.module.parameters())


def _gone(call, block: int, within_s: float = 15.0) -> None:
    """The service of ``block`` is gone from the wire: a call fails (no handler). Removing a handler is not
    instant in the daemon (CI 60 saw one more answer on a loaded machine): until then every answer must be a
    refusal, never a trained micro-batch."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            ans = call(block, *_message(block, "after"))
        except Exception:
            return
        assert ans is None or (ans["ok"] is False and ans["code"] == "busy"), ans
        assert time.monotonic() < deadline, f"block {block}'s service still answers {within_s:.0f} s after it stopped"
        time.sleep(0.2)


@pytest.fixture()
def node_and_outsider(tmp_path):
    """A node holding block 2 of a 3-block ``pipeline`` run, its train loop running, and a plain hivemind peer."""
    loop, p2ps = LoopThread(name="bt-test-switch"), []
    try:
        node_p2p = loop.run(P2P.create(host_maddrs=LOCAL), timeout=60)
        p2ps.append(node_p2p)
        maddrs = [str(a) for a in loop.run(node_p2p.get_visible_maddrs(), timeout=10)]
        outsider = loop.run(P2P.create(host_maddrs=LOCAL, initial_peers=maddrs), timeout=60)
        p2ps.append(outsider)
        # the outsider is listed as a holder of blocks 0 and 1 (the router's answer): the upstream gate lets
        # it send blocks 1 and 2 micro-batches (node/pipeline/admission.py); a Sybil that announces itself can
        listed = {b: [holder(str(outsider.peer_id))] for b in (0, 1)}
        with PipelineNode(node_p2p, loop, tiny_config(objective="pipeline", n_blocks=3), 2, RUN, tmp_path,
                          holders=lambda fresh: listed) as pn:
            node = pn.ns

            def call(block: int, meta: dict, tensors: list) -> dict:
                ans, _ = loop.run(raw_train_call(outsider, node.peer_id, RUN, block, meta, tensors), timeout=60)
                return ans

            yield node, call, pn.trainer, pn.stop_event
    finally:
        for p in reversed(p2ps):
            loop.run(p.shutdown(), timeout=10)
        loop.stop()


def test_an_outsider_cannot_train_a_prepared_block_and_the_old_one_refuses_once_moved(node_and_outsider):
    node, call, new_trainer, stop = node_and_outsider
    old = node.pipeline
    assert call(2, *_message(2, "before"))["ok"] is True    # the attack path works: block 2 trains it

    new = new_trainer(1)
    before = _weights(new)
    switch = PreparedSwitch(node, new)          # the window: block 1's rpc_train is up, not yet committed
    try:
        engine = switch.engine
        assert engine.stats is old.stats       # the node's totals carry on across the move
        s0 = old.stats.snapshot()
        refused = [call(1, *_message(1, "early")),
                   call(1, *_bad(1, torch.full((N, T, D), float("nan")))),
                   call(1, *_bad(1, torch.zeros(N, T, D + 1))),
                   call(1, *_bad(2, torch.zeros(N, T, D)))]   # a block-2 message sent to block 1's service
        assert all(a["ok"] is False for a in refused), refused
        assert refused[0]["code"] == "busy" and "not training yet" in refused[0]["reason"], refused[0]
        assert [a["code"] for a in refused[1:]] == ["bad_value", "bad_shape", "unknown_block"], refused
        st = engine.stats.snapshot()
        assert st["received"] == s0["received"] and st["refused_busy"] == s0["refused_busy"] + 1, (s0, st)
        assert _unchanged(new, before) and new.step == 0, "a refused micro-batch reached the prepared block"
        assert call(2, *_message(2, "during"))["ok"] is True   # nothing of the old block changes before the commit
        assert node.pipeline is old and not switch.committed

        switch.commit()                          # what the move's _switch does last
        wait_for(lambda: engine.accepting, 30, "the train loop to move to block 1's engine")
        moved = call(2, *_message(2, "after"))
        assert moved["ok"] is False and moved["code"] == "busy" and "moved to another block" in moved["reason"]
        taken = call(1, *_message(1, "taken"))  # accepted and run; no block-2 holder is listed to send it on
        assert taken["ok"] is False and taken["code"] in ("downstream", "timeout"), taken
        st = engine.stats.snapshot()
        assert st["received"] == s0["received"] + 2 and st["answered"] == s0["answered"] + 1, (s0, st)
    finally:
        switch.retire_old()
    _gone(call, 2)                             # the old block's service is gone from the wire
    assert node.pipeline is engine and not stop.is_set()


def test_an_abandoned_move_leaves_no_service_and_the_node_keeps_its_block(node_and_outsider):
    node, call, new_trainer, _ = node_and_outsider
    old = node.pipeline
    switch = PreparedSwitch(node, new_trainer(1))
    assert call(1, *_message(1, "early"))["code"] == "busy"
    switch.cancel()                            # what _abandon does with a prepared switch
    _gone(call, 1)
    assert node.pipeline is old and not switch.committed
    assert call(2, *_message(2, "still"))["ok"] is True
