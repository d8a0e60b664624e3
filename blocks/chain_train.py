"""Chain training in one process: the reference the network's pipeline engine must match.

For chain-trained objectives (``Objective.chain_training`` "backprop" or "streamed") one step of the
chain runs every block's ``stage_forward`` on one batch, in order, then the losses:

* "backprop": the last block's ``stage_loss``, and its gradient flows back through every block
  (the whole model trained end to end; for ``pipeline`` this is ReferenceLM's step);
* "streamed": every block's own ``stage_loss`` on its output, with block b's input detached.

Then each block clips its own gradient and steps its own optimizer, as a worker of the network
does. :func:`chain_gradients` stops before the step and also returns the gradient w.r.t. each stage
boundary (the activation gradients a network sends back), for tests and benchmarks.
:func:`stage_step_flops` counts what each block's holder runs of such a step (``LocalRun`` charges
chain-trained blocks with it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from .config import ModelConfig
from .flops import measured_flops
from .layers import backward_with
from .objectives.base import Objective
from .train import lr_at


def stage_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` for a stage whose output gradient came from downstream, its shape checked
    here, without the sympy import that call costs (``layers.backward_with``: the scalar ``output.sum()``
    backpropagated with a hook handing on ``grad``; every gradient below the same, bit for bit)."""
    if grad.shape != output.shape:
        raise ValueError(f"gradient of shape {tuple(grad.shape)} for an output of shape {tuple(output.shape)}")
    backward_with(output, grad)


@dataclass
class ChainGradients:
    losses: dict[int, float]                     # block -> its loss (backprop: the last block only)
    boundary_grads: list[torch.Tensor | None] = field(default_factory=list)   # d loss / d h_b, b < B-1
    boundaries: list[torch.Tensor] = field(default_factory=list)             # h_b (detached), b < B


def chain_gradients(objective: Objective, blocks: Sequence[nn.Module], windows: torch.Tensor) -> ChainGradients:
    """Accumulate one batch's gradients into every block's ``.grad`` (not zeroed first) and return
    the losses and the stage boundaries with their gradients ("streamed": no gradient crosses a
    boundary, so ``boundary_grads`` holds None)."""
    mode = objective.chain_training
    if mode not in ("backprop", "streamed"):
        raise ValueError(f"objective {objective.name!r} trains block-locally, not along the chain")
    ctx, y = windows[:, :-1], windows[:, 1:]
    h, hs, total, losses = None, [], None, {}
    for b, m in enumerate(blocks):
        m.train()
        h_in = None if h is None else (h.detach() if mode == "streamed" else h)
        h = objective.stage_forward(m, b, h_in, ctx if b == 0 else None)
        if b < len(blocks) - 1 and mode == "backprop":
            h.retain_grad()
        hs.append(h)
        if objective.stage_has_loss(b):
            loss, _ = objective.stage_loss(m, b, h, y)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {float(loss)} at block {b}")
            losses[b] = float(loss.detach())
            total = loss if total is None else total + loss
    total.backward()
    grads = [hb.grad if mode == "backprop" else None for hb in hs[:-1]]
    return ChainGradients(losses, grads, [hb.detach() for hb in hs])


def chain_step(objective: Objective, blocks: Sequence[nn.Module], opts: Sequence,
               cfg: ModelConfig, step: int, windows: torch.Tensor, *, lr: float | None = None) -> list[dict]:
    """One step of every block on one batch; per block {"loss", "grad_norm"} ("loss": the chain's
    loss for backprop, the block's own for streamed). ``lr``: this step's learning rate (default
    ``lr_at(step, cfg)``, warm-up then constant)."""
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    got = chain_gradients(objective, blocks, windows)
    stats = []
    for b, (m, opt) in enumerate(zip(blocks, opts)):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg) if lr is None else lr
        gnorm = torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.grad_clip)
        opt.step()
        loss = got.losses.get(b, got.losses[max(got.losses)])
        stats.append({"loss": loss, "grad_norm": float(gnorm)})
    return stats


def stage_step_flops(objective: Objective, blocks: Sequence[nn.Module], windows: torch.Tensor) -> list[int]:
    """Measured FLOPs (``flops.measured_flops``) of what the holder of each block runs in one chain
    step on ``windows``: its ``stage_forward`` from the state it *receives* (computed beforehand, not
    counted: a worker does not run the blocks before it), its ``stage_loss`` where it has one, and its
    backward ("backprop": block b < B-1 from an output gradient of its output's shape, and a gradient
    w.r.t. its input for b > 0, which it sends back; "streamed": its own loss, input detached).
    Their sum is the FLOPs of :func:`chain_gradients` on the same windows. Gradients are cleared."""
    mode = objective.chain_training
    if mode not in ("backprop", "streamed"):
        raise ValueError(f"objective {objective.name!r} trains block-locally, not along the chain")
    ctx, y = windows[:, :-1], windows[:, 1:]
    inputs: list[torch.Tensor | None] = [None]
    with torch.no_grad():
        for b, m in enumerate(blocks[:-1]):
            inputs.append(objective.stage_forward(m, b, inputs[-1], ctx if b == 0 else None))
    out = []
    for b, m in enumerate(blocks):
        was = m.training
        m.train()
        h_in = inputs[b]
        if h_in is not None:
            h_in = h_in.detach().requires_grad_(mode == "backprop")

        def step(b=b, m=m, h_in=h_in):
            h = objective.stage_forward(m, b, h_in, ctx if b == 0 else None)
            if objective.stage_has_loss(b):
                objective.stage_loss(m, b, h, y)[0].backward()
            else:
                stage_backward(h, torch.ones_like(h))

        try:
            out.append(measured_flops(step))
        finally:
            m.zero_grad(set_to_none=True)
            m.train(was)
    return out
