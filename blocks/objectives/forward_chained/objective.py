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

from ...chain import Hop, HopRequest, HopResult
from ...device import autocast
from ...hop import LocalHop, inference
from ..base import Objective, ScoreResult, sample_bytes
from ..common import prepare_prompt
from .net import ForwardChainedBlock


def forward_chained_step(block: ForwardChainedBlock, req: HopRequest) -> HopResult:
    """Hop math: h_b from h_{b-1} (block 0 reads only the bytes); the logits through block b's head."""
    h = block.stream(None if block.first else req.state.float(), req.context)
    return HopResult(h.float(), block.logits(h).float() if req.want_logits else None)


class ForwardChainedObjective(Objective):
    name = "forward-chained"
    ce_kind = "exact"
    needs_upstream = True

    def build_block(self, b: int) -> nn.Module:
        if not 0 <= b < self.cfg.n_blocks:
            raise IndexError(f"block index {b} out of range [0, {self.cfg.n_blocks})")
        return ForwardChainedBlock(self.cfg, b)

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

    def _run(self, hops, ctx: torch.Tensor, logits_from: str = "last") -> list[torch.Tensor]:
        """One traversal; the logits of every hop when ``logits_from`` is "all"."""
        n, t = ctx.shape
        state = torch.zeros(n, t, self.state_dim(), device=ctx.device)
        sigma = torch.zeros(n, device=ctx.device)   # unused: the state is not a noisy target
        out = []
        for b, hop in enumerate(hops):
            want = logits_from == "all" or b == len(hops) - 1
            res = hop(HopRequest(state, ctx, sigma, sigma, want_logits=want))
            if want and res.logits is None:
                raise RuntimeError(f"hop {b} returned no logits although they were requested")
            state = res.state
            if want:
                out.append(res.logits)
        return out

    @torch.no_grad()
    def score(self, hops, windows, k=4, generator=None) -> ScoreResult:
        """Exact held-out CE of the stack (deterministic: K plays no role). ``extra.prefix_ce[b]`` is
        the CE of blocks 0..b read through block b's own head: what each added block buys."""
        ctx, y = windows[:, :-1], windows[:, 1:]
        all_logits = self._run(hops, ctx, logits_from="all")
        prefix = [float(F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), y.reshape(-1))) for lg in all_logits]
        n, t = ctx.shape
        return ScoreResult(ce=prefix[-1], ce_k1=prefix[-1], k=k, tokens=n * t, ce_kind=self.ce_kind,
                           extra={"prefix_ce": prefix})

    @torch.no_grad()
    def block_alone_ce(self, block, b, windows, generator=None) -> float:
        """Block b with an uninformative input: block 0 is a complete small LM; a later block gets a
        zero state, so it only has its head's bias and layers to go on."""
        ctx, y = windows[:, :-1], windows[:, 1:]
        dev = next(block.parameters()).device
        ctx, y = ctx.to(dev), y.to(dev)
        h = None if b == 0 else torch.zeros(*ctx.shape, self.cfg.d_model, device=dev)
        with autocast(dev):
            _, logits = block(h, ctx)
        return float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)))

    @torch.no_grad()
    def generate_one_sweep(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        """The stack is autoregressive: one traversal emits one byte (a "chunk" of length 1), so this is
        the same as ``generate_autoregressive``."""
        return self.generate_autoregressive(hops, prompt, n_bytes, temperature=temperature, generator=generator)

    @torch.no_grad()
    def generate_autoregressive(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        seq = list(prepare_prompt(prompt, n_bytes, self.cfg.seq_len, one_sweep=False))
        out: list[int] = []
        for _ in range(n_bytes):
            ctx = torch.tensor(seq[-self.cfg.seq_len:], dtype=torch.long).unsqueeze(0)
            logits = self._run(hops, ctx)[-1]
            nxt = int(sample_bytes(logits[:, -1], temperature, generator)[0])
            seq.append(nxt)
            out.append(nxt)
        return bytes(out)
