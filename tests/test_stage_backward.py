"""``chain_train.stage_backward``: a stage's backward from the output gradient downstream sent back.

* the same gradients as ``output.backward(grad)``, bit for bit (block parameters and dL/dinput);
* a pipeline worker's engine (forward, then backward on a gradient from downstream, graph kept or
  recomputed) never imports sympy: ``output.backward(grad)`` does in this torch (its shape check goes
  through ``torch.fx.experimental.symbolic_shapes``), ~35 MB a worker would hold for life. Checked in
  a fresh interpreter, since this test process may have imported sympy through other tests;
* a gradient of the wrong shape is refused.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from blocktrain.blocks.chain_train import stage_backward
from blocktrain.blocks.objectives import get_objective

from test_utils.configs import tiny_config

TESTS = Path(__file__).resolve().parent


def _grads(block: int, explicit: bool):
    cfg = tiny_config(objective="pipeline", n_blocks=4, dropout=0.0)
    obj = get_objective(cfg)
    torch.manual_seed(cfg.init_seed + block)
    m = obj.build_block(block)
    gen = torch.Generator().manual_seed(3)
    n, t, d = 2, cfg.seq_len, obj.state_dim()
    x = torch.randn(n, t, d, generator=gen).requires_grad_(True)
    g = torch.randn(n, t, d, generator=gen)
    h = obj.stage_forward(m, block, x, None)
    if explicit:
        h.backward(g)
    else:
        stage_backward(h, g)
    return x.grad, {k: p.grad for k, p in m.named_parameters()}


@pytest.mark.parametrize("block", [1, 2])
def test_stage_backward_equals_backward_with_a_gradient_bit_for_bit(block):
    xg0, pg0 = _grads(block, explicit=True)
    xg1, pg1 = _grads(block, explicit=False)
    assert torch.equal(xg0, xg1)
    assert pg0.keys() == pg1.keys() and all(torch.equal(pg0[k], pg1[k]) for k in pg0)
    assert any(v.abs().sum() > 0 for v in pg1.values())


def test_stage_backward_refuses_a_gradient_of_another_shape():
    h = torch.randn(2, 3, requires_grad=True) * 2
    with pytest.raises(ValueError, match="shape"):
        stage_backward(h, torch.randn(2, 4))


_PROBE = textwrap.dedent("""
    import sys
    import numpy as np, torch
    from blocktrain.node.pipeline.engine import PipelineEngine
    from blocktrain.node.pipeline.settings import PipelineSettings
    from blocktrain.node.trainer import BlockTrainer
    from test_utils.configs import tiny_config

    class NoRoute:
        async def send(self, *a, **k):
            raise AssertionError("not used")

    data = np.frombuffer(b"the cat sat on the mat. " * 80, dtype=np.uint8)
    cfg = tiny_config(objective="pipeline", n_blocks=4, batch_size=2)
    for recompute in (False, True):
        for block in (0, 1):
            t = BlockTrainer(cfg, block, data, data, seed=0, worker_id=1)
            e = PipelineEngine(t, n_blocks=4, loop=None, next_stage=NoRoute(),
                               settings=PipelineSettings(accumulate=64, recompute=recompute))
            n, T, D = 2, cfg.seq_len, t.objective.state_dim()
            x = None if block == 0 else torch.randn(n, T, D)
            ctx = torch.randint(0, 256, (n, T)) if block == 0 else None
            work = e._forward(x, ctx, torch.randint(0, 256, (n, T)))
            e._backward(work, torch.randn(n, T, D), 1.0)
            assert any(p.grad is not None for p in t.module.parameters())
            e.close()
    engine = "sympy" in sys.modules
    h = torch.randn(2, 3, requires_grad=True) * 2
    h.backward(torch.ones(2, 3))     # the call stage_backward replaces
    print(engine, "sympy" in sys.modules)
""")


def test_a_pipeline_workers_backward_does_not_import_sympy():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd=TESTS)
    assert out.returncode == 0, out.stderr[-2000:]
    engine, plain = out.stdout.split()
    if plain != "True":
        pytest.skip(f"torch {torch.__version__}'s backward(grad) does not import sympy: nothing to avoid")
    assert engine == "False", "the engine's backward imported sympy (output.backward(grad) is back?)"
