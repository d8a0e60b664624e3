"""Weight stashing in the pipeline engine (node/pipeline/engine.py), on its compute alone: a middle
stage's forward keeps its graph, the block's weights then change (a downloaded state, as an
averaging round or an optimizer step would), and the backward of that micro-batch arrives.

With weight stashing (``--pipeline-weight-stash``; off by default) the answer dL/dh_{b-1} and the parameter gradients are those
of the weights the forward ran on (a fresh block holding them, same input and dL/dh_b); without
it, those of the current weights. In-process and network-free on purpose: the engine's RPC and
route are tested on real processes in test_pipeline_grads.py / test_pipeline_train.py; this one
checks the arithmetic in a second.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktrain.node.pipeline.engine import PipelineEngine
from blocktrain.node.pipeline.settings import PipelineSettings
from blocktrain.node.trainer import BlockTrainer

from test_utils.configs import tiny_config

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


class _NoRoute:   # block 1's engine needs a route object; these tests never send (compute only)
    async def send(self, *a, **k):
        raise AssertionError("not used")


def _engine(stash: bool) -> tuple[PipelineEngine, BlockTrainer]:
    cfg = tiny_config(objective="pipeline", n_blocks=4, batch_size=2)
    t = BlockTrainer(cfg, 1, DATA, DATA, seed=0, worker_id=1)
    e = PipelineEngine(t, n_blocks=4, loop=None, next_stage=_NoRoute(),
                       settings=PipelineSettings(accumulate=64, weight_stash=stash))
    return e, t


def _reference(t: BlockTrainer, state: dict, x: torch.Tensor, g: torch.Tensor):
    m = t.objective.build_block(1)
    m.load_state_dict(state)
    m.train()
    x = x.detach().clone().requires_grad_(True)
    t.objective.stage_forward(m, 1, x, None).backward(g)
    return x.grad, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("stash", [True, False])
def test_a_backward_after_a_weight_change_uses_the_forwards_weights(stash):
    e, t = _engine(stash)
    try:
        gen = torch.Generator().manual_seed(3)
        n, T, D = 2, t.cfg.seq_len, t.objective.state_dim()
        x = torch.randn(n, T, D, generator=gen)
        y = torch.randint(0, 256, (n, T), generator=gen)
        before = {k: v.clone() for k, v in t.module.state_dict().items()}
        work = e._forward(x, None, y)
        moved = [p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for p in t.module.parameters()]
        t.adopt_parameters(moved, step=t.step, samples_seen=t.samples_seen)   # the weights change meanwhile
        after = {k: v.clone() for k, v in t.module.state_dict().items()}
        g = torch.randn(n, T, D, generator=gen)
        assert e.stash_bytes() > 0 if stash else e.stash_bytes() == 0
        grad_in = e._backward(work, g, 1.0)

        want_in, want_p = _reference(t, before if stash else after, x, g)
        other_in, _ = _reference(t, after if stash else before, x, g)
        torch.testing.assert_close(grad_in, want_in, rtol=1e-4, atol=1e-6)
        assert (grad_in - other_in).norm() > 1e-3 * other_in.norm()   # the two weight versions differ visibly
        for name, p in t.module.named_parameters():
            torch.testing.assert_close(p.grad, want_p[name], rtol=1e-4, atol=1e-6, msg=name)
        st = e.stats.snapshot()
        assert st["recomputed"] == 1 and st["recomputed_stashed"] == (1 if stash else 0)
        one = st["peak_weight_stash_bytes"]
        del work
        e._forward(x, None, y)   # a forward on the new version: the old copy, needed by no one, is freed
        assert e.stash_bytes() == one if stash else e.stash_bytes() == 0
        assert e.stats.snapshot()["peak_weight_stash_bytes"] == one
    finally:
        e.close()
