"""One ``pipeline-chunked`` block: a ``pipeline`` block (a slice of ``reference.ReferenceLM``, same
initial weights) that runs two streams under a chunk-causal attention mask.

Positions i = 0..T-1 of a window carry the targets y_i = x_{i+1}; ``context[i] = x_i``. Positions are
cut into chunks of k = ``cfg.chunk_len`` (chunk c = positions [c*k, (c+1)*k), the last may be shorter).

* clean stream (T positions): exactly the ``pipeline`` model's residual stream (byte + position
  embedding of x_i, causal attention among clean positions). It never reads the query stream, so
  its activations are the autoregressive model's on the same weights.
* query stream (T positions): one masked query per target. Query i of chunk c starts from the byte
  embedding of the chunk's last known byte x_{c*k} (= ``context[c*k]``), the position embedding of
  i and an embedding of its offset i - c*k in the chunk (``offset_emb``, zero at init: offset 0 is
  then the clean stream's input at c*k). It attends to clean positions <= c*k and to the queries
  of its own chunk (bidirectional, as block diffusion's masked chunk; BD3-LM, Arriola et al. 2025).

So the logits at query i read only x_0..x_{c*k}: every byte of chunk c is predicted from the prefix
before the chunk, never from another byte of it, and every chunk of a window is trained in one pass.

The state between hops packs both streams on the last axis: (N, T, 2 d_model), clean first. It keeps
the wire's (N, T, D) shape with the targets' T, so the pipeline engine, the RPC limits
(``state_dim``) and hops carry it unchanged. Cost: 2T positions per layer, twice the AR model's.
"""
from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from ...layers import run_layers
from ..pipeline.net import PipelineBlock, build_pipeline_block


def chunk_query_mask(t: int, k: int, device=None) -> torch.Tensor:
    """(2T, 2T) bool attention mask of the [clean || query] layout (True = may attend)."""
    i = torch.arange(t, device=device)
    c = i // k
    clean_clean = i.view(1, -1) <= i.view(-1, 1)                    # causal
    query_clean = i.view(1, -1) <= (c * k).view(-1, 1)              # clean positions <= the chunk's start
    query_query = c.view(1, -1) == c.view(-1, 1)                    # own chunk, both ways
    top = torch.cat([clean_clean, torch.zeros(t, t, dtype=torch.bool, device=device)], dim=1)
    return torch.cat([top, torch.cat([query_clean, query_query], dim=1)], dim=0)


class PipelineChunkedBlock(nn.Module):
    """Wraps a ``PipelineBlock`` (its parameters keep the pipeline names under ``inner.``); block 0
    adds ``offset_emb`` (k x d_model)."""

    def __init__(self, cfg: ModelConfig, b: int, inner: PipelineBlock | None = None):
        super().__init__()
        self.k, self.d = cfg.chunk_len, cfg.d_model
        self.inner = inner if inner is not None else PipelineBlock(cfg, b)
        self.first, self.last = self.inner.first, self.inner.last
        if self.first:
            self.offset_emb = nn.Embedding(self.k, self.d)
            nn.init.zeros_(self.offset_emb.weight)
        self._masks: dict[tuple[int, str], torch.Tensor] = {}

    def _mask(self, t: int, device: torch.device) -> torch.Tensor:
        key = (t, str(device))
        if key not in self._masks:
            self._masks[key] = chunk_query_mask(t, self.k, device)
        return self._masks[key]

    def embed(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block 0: the clean and query streams' inputs (N, T, d) from the bytes (N, T)."""
        m, t = self.inner, context.shape[1]
        i = torch.arange(t, device=context.device)
        start = (i // self.k) * self.k
        pos = m.pos_emb(i)
        clean = m.byte_emb(context) + pos
        query = m.byte_emb(context[:, start]) + pos + self.offset_emb(i - start)
        return clean, query

    def stream(self, h: torch.Tensor | None, context: torch.Tensor | None) -> torch.Tensor:
        """Packed state (N, T, 2d) from the packed state before it (block 0: from the bytes)."""
        if self.first:
            clean, query = self.embed(context)
        else:
            clean, query = h[..., :self.d], h[..., self.d:]
        t = clean.shape[1]
        x = torch.cat([clean, query], dim=1)
        mask = self._mask(t, x.device)
        x = run_layers(self.inner.layers, x, None, mask)
        return torch.cat([x[:, :t], x[:, t:]], dim=-1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The last block's logits at the query positions (N, T, V) from a packed state."""
        return self.inner.logits(h[..., self.d:])


def build_chunked_block(cfg: ModelConfig, b: int) -> PipelineChunkedBlock:
    """The pipeline block's weights (ReferenceLM's init), plus block 0's zero offset embedding."""
    return PipelineChunkedBlock(cfg, b, build_pipeline_block(cfg, b))
