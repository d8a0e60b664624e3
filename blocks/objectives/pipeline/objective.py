"""Issue 13's ``pipeline`` objective: the whole-size model, cut into blocks, trained end to end
through the chain of holders (backprop across blocks).

Stacked, the blocks ARE ``reference.ReferenceLM`` with ``n_blocks * layers_per_block`` layers: the
same modules and, for the same ``init_seed``, the same initial weights (``net.py``). So "the
whole-size model trained end to end" and a pipeline run train the same model; what differs is
only where the work runs (one process, or one block per worker with activations and their
gradients crossing the network) and that each worker clips and steps its own block's optimizer.

The state between hops is the residual stream h_b (N, T, d_model); the last block's head scores the
next byte exactly (``ce_kind`` "exact"); generation is autoregressive (one traversal per byte).
A block has no loss of its own (``local_loss`` refuses, but for a one-block model): block b < B-1
trains on the gradient that block b+1 sends back (``stage_forward`` / ``stage_loss``, run by the
network's pipeline engine or by ``chain_train.chain_step`` in one process).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...chain import Hop, HopRequest, HopResult, traverse
from ...device import autocast
from ...hop import LocalHop
from ...sampling import generate_chunks, mean_ce, next_byte, row_ce
from ..base import NotBlockLocalError, Objective, ScoreResult
from .net import PipelineBlock, build_pipeline_block


def pipeline_step(block: PipelineBlock, req: HopRequest) -> HopResult:
    """Hop math: h_b from h_{b-1} (block 0 from the bytes); logits only from the last block."""
    h = block.stream(None if block.first else req.state.float(), req.context)
    logits = block.logits(h).float() if req.want_logits and block.last else None
    return HopResult(h.float(), logits)


def next_byte_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class PipelineObjective(Objective):
    name = "pipeline"
    ce_kind = "exact"
    chain_training = "backprop"

    def build_block(self, b: int) -> nn.Module:
        self.check_block(b)
        return build_pipeline_block(self.cfg, b)

    def state_dim(self) -> int:
        return self.cfg.d_model

    # -- training along the chain ------------------------------------------------------------------
    def stage_forward(self, block, b, h_in, context):
        with autocast((h_in if h_in is not None else context).device):
            h = block.stream(None if b == 0 else h_in, context)
        return h.float()

    def stage_has_loss(self, b: int) -> bool:
        return b == self.cfg.n_blocks - 1

    def stage_loss(self, block, b, h_out, targets):
        if not self.stage_has_loss(b):
            raise ValueError(f"pipeline block {b} has no loss: only the last block ({self.cfg.n_blocks - 1}) does")
        with autocast(h_out.device):
            logits = block.logits(h_out)
        ce = next_byte_ce(logits, targets)
        return ce, {"ce": float(ce.detach())}

    def local_loss(self, block, b, windows, generator=None, upstream=None):
        """Only a one-block model trains alone; a pipeline block b of several has no loss of its own."""
        if self.cfg.n_blocks != 1:
            raise NotBlockLocalError(
                f"a pipeline block cannot train alone: block {b}'s loss is the whole chain's next-byte CE, "
                "reached through the blocks after it (train it with the pipeline engine of a network run, "
                "or in one process with blocks.chain_train.chain_step)")
        ctx, y = windows[:, :-1], windows[:, 1:]
        return self.stage_loss(block, 0, self.stage_forward(block, 0, None, ctx), y)

    # -- the chain --------------------------------------------------------------------------------
    def make_hop(self, block, b) -> Hop:
        return LocalHop(block, pipeline_step)

    def _last_logits(self, hops, ctx: torch.Tensor) -> torch.Tensor:
        state = torch.zeros(*ctx.shape, self.state_dim(), device=ctx.device)
        return traverse(hops, torch.zeros(len(hops) + 1), state, ctx, logits_from="last")[1][-1]

    @torch.no_grad()
    def score(self, hops, windows, k=4, generator=None) -> ScoreResult:
        """Exact held-out CE of the stack (deterministic: K plays no role)."""
        self.check_hops(hops)
        ctx, y = windows[:, :-1], windows[:, 1:]
        ce = mean_ce(self._last_logits(hops, ctx), y)
        return ScoreResult(ce=ce, ce_k1=ce, k=k, tokens=y.numel(), ce_kind=self.ce_kind)

    @torch.no_grad()
    def score_per_window(self, hops, windows, k=4, seed=0, batch: int = 64):
        """:meth:`score` window by window, ``batch`` windows per traversal (the score draws nothing)."""
        self.check_hops(hops)
        ces = []
        for s in range(0, windows.shape[0], batch):
            w = windows[s:s + batch]
            ces.extend(row_ce(self._last_logits(hops, w[:, :-1]), w[:, 1:]).tolist())
        return ces, [{} for _ in ces]

    @torch.no_grad()
    def block_alone_ce(self, block, b, windows, generator=None) -> float:
        """Only a one-block model is a model alone: a block of several has no head (b < B-1) or no
        embedding (b > 0), so its CE alone is not defined (NaN)."""
        if self.cfg.n_blocks != 1:
            return math.nan
        ctx, y = windows[:, :-1], windows[:, 1:]
        return mean_ce(block.logits(block.stream(None, ctx)), y)

    @torch.no_grad()
    def generate_one_sweep(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        """The stack is autoregressive: one traversal emits one byte, as ``generate_autoregressive``."""
        return self.generate_autoregressive(hops, prompt, n_bytes, temperature=temperature, generator=generator)

    @torch.no_grad()
    def generate_autoregressive(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        self.check_hops(hops)
        emit = next_byte(lambda ctx: self._last_logits(hops, ctx), temperature, generator)
        return generate_chunks(prompt, n_bytes, chunk_len=1, seq_len=self.cfg.seq_len, emit=emit)
