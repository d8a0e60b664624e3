"""Candidate (c) of issue 8: ``forward-chained`` (greedy block-wise training of one deep stack).

Block b continues the residual stream of blocks 0..b-1: it reads their output states (computed
by read-only snapshots, under ``no_grad``: no gradient crosses blocks) and trains its own layers
and its own next-byte head on the same target, next-byte cross entropy. Block 0 embeds the bytes.
The chain is the stack: hop b maps the state h_{b-1} (N, T, d_model) to h_b, and the last block's
head scores the next byte exactly (``ce_kind`` "exact"). The idea is classic greedy layer-wise
training with local heads (Bengio et al. 2007; Belilovsky et al., "Greedy layerwise learning can
scale to ImageNet", ICML 2019; Nøkland & Eidnes, "Training neural networks with local error
signals", ICML 2019), applied here to blocks held by different workers.

What it gives up: strict independence. Training block b needs the current weights of blocks < b
(a worker keeps snapshots, refreshed from their holders), every step runs their forward (block b
pays b extra forwards: ``upstream_blocks``), and block b trains on features that are as stale as
its last refresh. The chain is autoregressive: one traversal of the stack emits one byte.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...chain import Hop, HopRequest, HopResult, ask_logits, traverse
from ...device import autocast
from ...hop import LocalHop, inference
from ...sampling import generate_chunks, mean_ce, next_byte, row_ce
from ..base import Objective, ScoreResult
from .net import ForwardChainedBlock


def forward_chained_step(block: ForwardChainedBlock, req: HopRequest) -> HopResult:
    """Hop math: h_b from h_{b-1} (block 0 reads only the bytes); the logits through block b's head."""
    h = block.stream(None if block.first else req.state.float(), req.context)
    return HopResult(h.float(), block.logits(h).float() if req.want_logits else None)


class ForwardChainedObjective(Objective):
    name = "forward-chained"
    ce_kind = "exact"
    needs_upstream = True
    block_class = ForwardChainedBlock

    def build_block(self, b: int) -> nn.Module:
        self.check_block(b)
        return self.block_class(self.cfg, b)

    def state_dim(self) -> int:
        return self.cfg.d_model

    def upstream_blocks(self, b: int) -> int:
        return b

    def upstream_state(self, upstream: Sequence[nn.Module], context: torch.Tensor) -> torch.Tensor | None:
        """h_{b-1}: the snapshots of blocks 0..b-1 run in order on ``context`` (None for block 0), with no
        gradient, each in eval mode (its mode restored afterwards)."""
        h = None
        for m in upstream:
            with inference(m):
                h = m.stream(h, context)
        return None if h is None else h.float()

    def _check_upstream(self, b: int, upstream) -> Sequence[nn.Module]:
        upstream = list(upstream or [])
        if len(upstream) != b:
            raise ValueError(f"forward-chained block {b} trains on the outputs of blocks 0..{b - 1}: "
                             f"it needs {b} upstream snapshot(s), got {len(upstream)}")
        return upstream

    def local_loss(self, block, b, windows, generator=None, upstream=None):
        ctx, y = windows[:, :-1], windows[:, 1:]
        h = self.upstream_state(self._check_upstream(b, upstream), ctx)
        with autocast(windows.device):
            _, logits = block(h, ctx)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        return ce, {"ce": float(ce.detach())}

    def make_hop(self, block, b) -> Hop:
        return LocalHop(block, forward_chained_step)

    def _traverse(self, hops, ctx: torch.Tensor, logits_from: str = "last") -> list[torch.Tensor]:
        """One traversal of the stack from an empty stream; the logits asked for. The levels are all 0:
        the state is not a noisy target."""
        state = torch.zeros(*ctx.shape, self.state_dim(), device=ctx.device)
        return traverse(hops, torch.zeros(len(hops) + 1), state, ctx, logits_from=logits_from)[1]

    @torch.no_grad()
    def score(self, hops, windows, k=4, generator=None) -> ScoreResult:
        """Exact held-out CE of the stack (deterministic: K plays no role). ``extra.prefix_ce[b]`` is
        the CE of blocks 0..b read through block b's own head: what each added block buys."""
        ctx, y = windows[:, :-1], windows[:, 1:]
        prefix = [mean_ce(logits, y) for logits in self._traverse(hops, ctx, logits_from="all")]
        return ScoreResult(ce=prefix[-1], ce_k1=prefix[-1], k=k, tokens=y.numel(), ce_kind=self.ce_kind,
                           extra={"prefix_ce": prefix})

    @torch.no_grad()
    def score_per_window(self, hops, windows, k=4, seed=0, batch: int = 64):
        """:meth:`score` window by window (``prefix_ce`` too), ``batch`` windows per traversal (it draws nothing)."""
        ces, extras = [], []
        for s in range(0, windows.shape[0], batch):
            w = windows[s:s + batch]
            per = torch.stack([row_ce(lg, w[:, 1:]) for lg in self._traverse(hops, w[:, :-1], logits_from="all")])
            ces.extend(per[-1].tolist())
            extras.extend({"prefix_ce": col.tolist()} for col in per.T)
        return ces, extras

    @torch.no_grad()
    def block_alone_ce(self, block, b, windows, generator=None) -> float:
        """Block b with an uninformative input: block 0 is a complete small LM; a later block gets a
        zero state, so it only has its head's bias and layers to go on."""
        ctx, y = windows[:, :-1], windows[:, 1:]
        state, level = torch.zeros(*ctx.shape, self.state_dim(), device=ctx.device), torch.zeros(ctx.shape[0])
        return mean_ce(ask_logits(self.make_hop(block, b), HopRequest(state, ctx, level, level), b).logits, y)

    @torch.no_grad()
    def generate_one_sweep(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        """The stack is autoregressive: one traversal emits one byte (a "chunk" of length 1), so this is
        the same as ``generate_autoregressive``."""
        return self.generate_autoregressive(hops, prompt, n_bytes, temperature=temperature, generator=generator)

    @torch.no_grad()
    def generate_autoregressive(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        emit = next_byte(lambda ctx: self._traverse(hops, ctx)[-1], temperature, generator)
        return generate_chunks(prompt, n_bytes, chunk_len=1, seq_len=self.cfg.seq_len, emit=emit)
