"""``--pipeline-recompute`` in the pipeline engine (node/pipeline/engine.py), on its compute alone: a
stage that holds a micro-batch keeps its input, not its graph, and its backward runs the forward
again first (GPipe's re-materialisation). In-process and network-free like test_pipeline_stash.py;
the flag on real processes, against the single-process reference: test_pipeline_grads.py.

* the answer dL/dh_{b-1} and the block's parameter gradients equal those of an engine that kept the
  graph (same weights, input, dL/dh_b), with dropout on: the recompute replays the forward's random
  state, whatever the process drew in between (and without the replay they differ: the test can fail);
* a held micro-batch keeps no graph (its output needs no gradient), and its weights changing before
  the backward still counts a stale recompute, on the forward's weights with weight stashing;
* a micro-batch released without its backward (dropped, or its caller cancelled) lets go of its
  tensors at once, and a late backward on it does nothing;
* the output is given to the wire, not kept, and a retry recomputes it bit for bit.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from blocktrain.node.pipeline.engine import PipelineEngine
from blocktrain.node.pipeline.settings import PipelineSettings
from blocktrain.node.routing.pipeline_route import DownstreamFailed
from blocktrain.node.trainer import BlockTrainer

from test_utils.configs import tiny_config

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


class _NoRoute:   # engines before the last block need a route object; these tests never send
    async def send(self, *a, **k):
        raise AssertionError("not used")


def _engine(block: int, recompute: bool, weight_stash: bool = False,
            dropout: float = 0.2) -> tuple[PipelineEngine, BlockTrainer]:
    cfg = tiny_config(objective="pipeline", n_blocks=4, batch_size=2, dropout=dropout)
    t = BlockTrainer(cfg, block, DATA, DATA, seed=0, worker_id=1)
    e = PipelineEngine(t, n_blocks=4, loop=None, next_stage=_NoRoute(),
                       settings=PipelineSettings(accumulate=64, recompute=recompute, weight_stash=weight_stash))
    return e, t


def _inputs(t: BlockTrainer, block: int):
    gen = torch.Generator().manual_seed(7)
    n, T, D = 2, t.cfg.seq_len, t.objective.state_dim()
    x = None if block == 0 else torch.randn(n, T, D, generator=gen)
    ctx = torch.randint(0, 256, (n, T), generator=gen) if block == 0 else None
    y = torch.randint(0, 256, (n, T), generator=gen)
    g = torch.randn(n, T, D, generator=gen)
    return x, ctx, y, g


def _run(block: int, recompute: bool, replay: bool = True):
    """One micro-batch's forward, then 1,000 unrelated random draws, then its backward."""
    e, t = _engine(block, recompute)
    try:
        x, ctx, y, g = _inputs(t, block)
        torch.manual_seed(1234)
        work = e._forward(None if x is None else x.clone(), ctx, y)
        out = work.out.clone()
        if recompute:
            assert work.h is None and not work.out.requires_grad   # no graph held, only the input
            if not replay:
                work.rng = None                                    # what the replay protects against
        torch.rand(1000)                                           # the process's stream moves on meanwhile
        grad_in = e._backward(work, g, 1.0)
        grads = {n: p.grad.clone() for n, p in t.module.named_parameters()}
        return out, grad_in, grads, e.stats.snapshot()
    finally:
        e.close()


@pytest.mark.parametrize("block", [0, 1])
def test_recompute_gives_the_kept_graphs_gradients_dropout_included(block):
    out0, in0, p0, _ = _run(block, recompute=False)
    out1, in1, p1, st = _run(block, recompute=True)
    torch.testing.assert_close(out1, out0)                         # what the stage sends is the same
    if block:
        torch.testing.assert_close(in1, in0, rtol=1e-5, atol=1e-7)
    else:
        assert in0 is None and in1 is None                         # block 0 answers no one
    assert p0.keys() == p1.keys()
    for name in p0:
        torch.testing.assert_close(p1[name], p0[name], rtol=1e-5, atol=1e-7, msg=name)
    assert st["recomputed"] == 0                                   # the weights did not move: not stale
    _, _, p2, _ = _run(block, recompute=True, replay=False)        # new dropout masks: other gradients
    assert max(float((p2[n] - p0[n]).norm()) for n in p0) > 1e-4


def test_a_stale_recompute_runs_on_the_stashed_weights():
    e, t = _engine(1, recompute=True, weight_stash=True, dropout=0.0)
    try:
        x, _, y, g = _inputs(t, 1)
        before = {k: v.clone() for k, v in t.module.state_dict().items()}
        work = e._forward(x, None, y)
        gen = torch.Generator().manual_seed(3)
        moved = [p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for p in t.module.parameters()]
        t.adopt_parameters(moved, step=t.step, samples_seen=t.samples_seen)   # the weights change meanwhile
        grad_in = e._backward(work, g, 1.0)
        ref = t.objective.build_block(1)               # the forward's weights, in a fresh block
        ref.load_state_dict(before)
        ref.train()
        xr = x.clone().requires_grad_(True)
        t.objective.stage_forward(ref, 1, xr, None).backward(g)
        torch.testing.assert_close(grad_in, xr.grad, rtol=1e-4, atol=1e-6)
        for name, p in t.module.named_parameters():
            torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=name)
        st = e.stats.snapshot()
        assert st["recomputed"] == 1 and st["recomputed_stashed"] == 1
    finally:
        e.close()


@pytest.mark.parametrize("recompute", [False, True])
def test_a_released_microbatch_lets_go_and_a_late_backward_does_nothing(recompute):
    e, t = _engine(1, recompute)
    try:
        x, _, y, g = _inputs(t, 1)
        work = e._forward(x, None, y)
        assert e._open == 1 and work.x is not None
        e._release(work)                                   # dropped: its caller gave up
        assert e._open == 0 and work.x is None and work.h is None and work.context is None
        assert e._backward(work, g, 1.0) is None           # too late: nothing backpropagated, nothing counted
        assert all(p.grad is None for p in t.module.parameters())
        assert e.stats.snapshot()["microbatches_accumulated"] == 0
    finally:
        e.close()


@pytest.mark.parametrize("block", [0, 1])
def test_a_recomputing_stage_gives_its_output_up_and_a_retry_recomputes_the_same_bits(block):
    """With recompute the output goes to the wire (the engine keeps only the input while the chain below
    runs); a retry after a failed call runs the forward again from the input and the replayed random
    state (dropout on): the same bits. The backward is unchanged, and a released micro-batch has no
    output left to give (its retry fails instead of sending something)."""
    e, t = _engine(block, recompute=True)
    try:
        x, ctx, y, g = _inputs(t, block)
        torch.manual_seed(1234)
        work = e._forward(x, ctx, y)
        sent = work.out.clone()
        source = e._outgoing(work)
        assert callable(source)

        async def send_twice():
            first = await source()
            assert work.out is None                                   # given up: not held by the engine
            torch.rand(1000)                                          # the process's stream moves on
            return first, await source()                              # a retry: recomputed

        first, again = asyncio.run(send_twice())
        assert torch.equal(first, sent) and torch.equal(again, sent)
        assert e.stats.snapshot()["resent_recomputed"] == 1
        checked = e._forward_again(work, resend=False)   # a gradient check's recompute (engine._checked): no resend
        assert torch.equal(checked, sent) and e.stats.snapshot()["resent_recomputed"] == 1
        _, in0, p0, _ = _run(block, recompute=False)                  # the backward still matches a kept graph
        grad_in = e._backward(work, g, 1.0)
        if block:
            torch.testing.assert_close(grad_in, in0, rtol=1e-5, atol=1e-7)
        for name, p in t.module.named_parameters():
            torch.testing.assert_close(p.grad, p0[name], rtol=1e-5, atol=1e-7, msg=name)
        with pytest.raises(DownstreamFailed):                         # released: nothing to resend
            asyncio.run(source())
    finally:
        e.close()
    kept, tk = _engine(block, recompute=False)                        # a kept graph: the output is sent as is
    try:
        work = kept._forward(*_inputs(tk, block)[:3])
        assert kept._outgoing(work) is work.out
    finally:
        kept.close()
