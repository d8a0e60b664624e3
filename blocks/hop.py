"""A block module run as one hop of the chain (``chain.py``): the one local-hop wrapper.

An objective writes only its hop *math*, ``step(block, request) -> HopResult``, as if nothing else
existed (k-diffusion style: a wrapper around any model, the math a plain function). ``LocalHop``
does the rest once for every objective: it moves the request to the block's device, turns
gradients off, puts the block in eval mode (restoring its mode afterwards, so a hop may be served
between training steps), runs the step under the device's autocast (bf16 on CUDA, none on CPU),
and hands the result back on the device the request came from.

Steps that need fp32 inside (a matmul against the target table, say) disable autocast there, as
the block modules already do for their own fp32 parts.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from .chain import HopRequest, HopResult
from .device import autocast, module_device

HopStep = Callable[[nn.Module, HopRequest], HopResult]


@contextlib.contextmanager
def inference(block: nn.Module) -> Iterator[None]:
    """No gradients, eval mode (the previous mode restored afterwards), the device's autocast."""
    was = block.training
    block.eval()
    try:
        with torch.no_grad(), autocast(module_device(block)):
            yield
    finally:
        block.train(was)


class LocalHop:
    """``LocalHop(block, step)`` is a hop: ``hop(request) -> HopResult``."""

    def __init__(self, block: nn.Module, step: HopStep):
        self.block, self.step = block, step

    def __call__(self, req: HopRequest) -> HopResult:
        with inference(self.block):
            out = self.step(self.block, req.to(module_device(self.block)))
        return out.to(req.state.device)
