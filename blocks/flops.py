"""Training FLOPs, for equal-compute comparisons.

Two counts:

* :func:`measured_flops` / :func:`measure_step_flops`: the FLOPs of the operations a step actually
  runs, counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, batched matmuls and
  attention, forward and backward). What a step does not run is not charged (an upstream block's
  head that its ``stream`` never calls), and a buffer used as a weight (the paper objective's fixed
  target table) is charged like any other matmul operand. Attention is counted over the full T x T
  score matrix, as torch counts it on CUDA (the causal half is not subtracted). Embedding lookups,
  norms and element-wise ops are not counted. This is what ``bench quality`` and ``LocalRun``'s
  ``match_flops`` use.
* :func:`train_flops_per_step`: the analytic 6 N T rule plus attention, kept for ``bench memory``
  and ``bench throughput`` (MFU uses the analytic convention).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .layers import TransformerLayer

_aten = torch.ops.aten


def _sdpa_cpu(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


#: torch counts flash/efficient attention on CUDA but not the CPU flash kernel: same formulas here
_CPU_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


def measured_flops(fn: Callable[[], object]) -> int:
    """FLOPs of the operations ``fn()`` runs (forward, and backward if ``fn`` calls it)."""
    with FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as counter:
        fn()
    return int(counter.get_total_flops())


def measure_step_flops(module: nn.Module, loss_fn: Callable[[], tuple[torch.Tensor, dict]]) -> int:
    """FLOPs of one training step's forward + backward (``loss_fn()`` then ``backward``) of ``module``,
    counted on a real run of it; the gradients it leaves are cleared and no optimizer steps."""
    was = module.training
    module.train()

    def step():
        loss, _ = loss_fn()
        loss.backward()

    try:
        return measured_flops(step)
    finally:
        module.zero_grad(set_to_none=True)
        module.train(was)


def train_flops_per_step(module: nn.Module, batch: int, seq_len: int) -> float:
    """Approximate (analytic) FLOPs of one forward+backward step on (batch, seq_len) tokens.

    6 * (non-embedding parameters) * tokens for the matmuls, plus 12 * layers * T^2 * d * batch
    for attention scores and values (forward 4 T^2 d, backward twice that).
    """
    n_params = sum(p.numel() for name, p in module.named_parameters() if "emb" not in name)
    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    d = layers[0].attn.proj.in_features if layers else 0
    tokens = batch * seq_len
    return 6.0 * n_params * tokens + 12.0 * len(layers) * seq_len * seq_len * d * batch
