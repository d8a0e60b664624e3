"""Activation checkpointing per layer (``blocks.layers.layer_checkpointing``, the engine's
``--pipeline-layer-checkpoint``), in process:

* a ``pipeline`` block (first, middle, last), a ``pipeline-chunked`` block and the whole-size ReferenceLM
  give the same output and the same gradients with it as without, dropout on (the random state is
  replayed when a layer runs again);
* it keeps fewer bytes for the backward: autograd's saved tensors outside the layers' own (counted with
  an outer ``saved_tensors_hooks``) drop below half of the plain forward's, and nothing is kept under
  ``no_grad``; outside the context manager nothing changes;
* the pipeline engine with ``layer_checkpoint`` answers the same dL/dh_{b-1} and accumulates the same
  parameter gradients as without, with and without ``recompute``, at a middle block and at the last
  block (which runs its loss and backward at once), and reports the setting in its status.
The same flag on four real processes against the single-process reference: test_pipeline_grads.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.layers import layer_checkpointing
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.reference import ReferenceLM
from blocktrain.node.pipeline.engine import PipelineEngine
from blocktrain.node.pipeline.settings import PipelineSettings
from blocktrain.node.trainer import BlockTrainer

from test_utils.configs import tiny_config

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


def _cfg(objective: str = "pipeline", dropout: float = 0.2) -> ModelConfig:
    return tiny_config(objective=objective, n_blocks=4, layers_per_block=3, batch_size=2, dropout=dropout)


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """Run ``fn`` and count the bytes autograd saves for the backward (outside checkpointed regions)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _forward_backward(module: torch.nn.Module, run, ckpt: bool):
    """``run(module)`` -> output; seeded, its output's sum backpropagated; returns (output, grads, saved bytes)."""
    module.zero_grad(set_to_none=True)
    module.train()
    torch.manual_seed(99)
    with layer_checkpointing(ckpt):
        out, saved = _saved_bytes(lambda: run(module))
    torch.rand(100)                                    # the process's stream moves on before the backward
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}, saved


def _stage(objective: str, b: int):
    cfg = _cfg(objective)
    obj = get_objective(cfg)
    gen = torch.Generator().manual_seed(5)
    x = None if b == 0 else torch.randn(2, cfg.seq_len, obj.state_dim(), generator=gen)
    ctx = torch.randint(0, 256, (2, cfg.seq_len), generator=gen) if b == 0 else None
    return obj.build_block(b), lambda m: obj.stage_forward(m, b, x, ctx)


def _reference():
    cfg = _cfg()
    torch.manual_seed(cfg.init_seed)
    ctx = torch.randint(0, 256, (2, cfg.seq_len), generator=torch.Generator().manual_seed(5))
    return ReferenceLM(cfg), lambda m: m(ctx)


@pytest.mark.parametrize("which", ["pipeline-0", "pipeline-1", "pipeline-3", "pipeline-chunked-1", "reference"])
def test_layer_checkpointing_gives_the_same_gradients_and_keeps_less(which):
    if which == "reference":
        module, run = _reference()
    else:
        objective, b = which.rsplit("-", 1)
        module, run = _stage(objective, int(b))
    out0, g0, saved0 = _forward_backward(module, run, ckpt=False)
    out1, g1, saved1 = _forward_backward(module, run, ckpt=True)
    torch.testing.assert_close(out1, out0)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=name)
    assert saved0 > 0 and saved1 < saved0 / 2, (saved0, saved1)
    with torch.no_grad(), layer_checkpointing(True):
        _, saved_ng = _saved_bytes(lambda: run(module))
    assert saved_ng == 0
    _, _, saved_off = _forward_backward(module, run, ckpt=False)   # the context manager left nothing behind
    assert saved_off == saved0


def _engine(block: int, *, recompute: bool, layer_checkpoint: bool) -> tuple[PipelineEngine, BlockTrainer]:
    cfg = _cfg()
    t = BlockTrainer(cfg, block, DATA, DATA, seed=0, worker_id=1)
    e = PipelineEngine(t, n_blocks=4, loop=None, next_stage=None if block == 3 else object(),
                       settings=PipelineSettings(accumulate=64, recompute=recompute, layer_checkpoint=layer_checkpoint))
    return e, t


def _engine_run(block: int, recompute: bool, layer_checkpoint: bool):
    e, t = _engine(block, recompute=recompute, layer_checkpoint=layer_checkpoint)
    try:
        gen = torch.Generator().manual_seed(7)
        T, D = t.cfg.seq_len, t.objective.state_dim()
        x, y, g = torch.randn(2, T, D, generator=gen), torch.randint(0, 256, (2, T), generator=gen), \
            torch.randn(2, T, D, generator=gen)
        torch.manual_seed(1234)
        work = e._forward(x, None, y)
        torch.rand(1000)
        if block == 3:                                     # the last block: loss and backward already done
            grad_in, loss = work.grad_in, work.loss
        else:
            grad_in, loss = e._backward(work, g, 1.0), None
        assert e.status()["settings"]["layer_checkpoint"] is layer_checkpoint
        return grad_in, loss, {n: p.grad.clone() for n, p in t.module.named_parameters()}
    finally:
        e.close()


@pytest.mark.parametrize("block,recompute", [(1, False), (1, True), (3, False)])
def test_the_engine_with_layer_checkpoint_gives_the_same_gradients(block, recompute):
    in0, loss0, p0 = _engine_run(block, recompute, layer_checkpoint=False)
    in1, loss1, p1 = _engine_run(block, recompute, layer_checkpoint=True)
    torch.testing.assert_close(in1, in0, rtol=1e-5, atol=1e-7)
    assert loss1 == pytest.approx(loss0) if block == 3 else loss0 is loss1 is None
    assert p0.keys() == p1.keys()
    for name in p0:
        torch.testing.assert_close(p1[name], p0[name], rtol=1e-5, atol=1e-7, msg=name)


def test_layer_checkpointing_under_autocast_and_without_an_input_gradient():
    """bf16 autocast (the node's policy on CUDA; CPU autocast here) is replayed when a layer runs again:
    the same gradients as the plain autocast forward. A stream whose input needs no gradient (nothing
    upstream trains) still trains the layers' parameters."""
    module, run = _stage("pipeline", 1)
    x = torch.randn(2, _cfg().seq_len, _cfg().d_model)
    grads = []
    for ckpt in (False, True):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with layer_checkpointing(ckpt), torch.autocast("cpu", dtype=torch.bfloat16):
            out = module.stream(x.clone().requires_grad_(True), None)
        out.float().square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)
    module.zero_grad(set_to_none=True)
    with layer_checkpointing(True):
        module.stream(x, None).square().mean().backward()          # x needs no gradient
    assert all(p.grad is not None for p in module.parameters())


def test_layer_checkpointing_imports_neither_dynamo_nor_sympy():
    """torch.utils.checkpoint would: torch._dynamo (non-reentrant) or sympy (reentrant), 35-72 MB of RSS
    for the life of a worker. Ours imports nothing."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from blocktrain.blocks.layers import layer_checkpointing, run_layers, TransformerLayer\n"
            "layers = torch.nn.ModuleList([TransformerLayer(16, 2, 4, 0.1) for _ in range(2)])\n"
            "x = torch.randn(2, 8, 16, requires_grad=True)\n"
            "run_layers(layers, x).sum().backward()\n"
            "before = set(sys.modules)\n"
            "with layer_checkpointing(True):\n"
            "    y = run_layers(layers, x)\n"
            "y.sum().backward()\n"
            "new = sorted(set(sys.modules) - before)\n"
            "print(len(new), 'torch._dynamo' in sys.modules, 'sympy' in sys.modules, new[:5])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[:3] == ["0", "False", "False"], out.stdout
