"""The network of one ``chunked-masked`` block: a [noisy || clean] Transformer with a block-causal mask.

Byte positions i = 0..T-1 of a window carry the targets y_i = x_{i+1}; ``context[i] = x_i`` is the
clean byte before position i. Positions are cut into chunks of k = ``chunk_len`` bytes
(chunk c = positions [c*k, (c+1)*k), the last one may be shorter).

The input is two streams, concatenated along the sequence (BD3-LM, arXiv 2503.09573):

* noisy stream, T positions: byte id z_i of the noisy chunk (the true byte or MASK = 256), plus an
  embedding of the *legally visible previous byte* (z_{i-1}, itself possibly MASK, inside a chunk;
  the clean byte context[i] = x_i at a chunk's first position). Without that second embedding a
  masked position sees only MASK at its own slot and the network stays near the unigram plateau
  (issue 8's prototype);
* clean stream, the positions of every chunk except the last: the clean byte y_i = context[i+1]
  plus an embedding of its previous byte context[i].

Both streams share the position embedding of i and are told apart by a stream embedding.
Attention (True = may attend):
    noisy chunk c -> noisy chunk c (bidirectional) and clean chunks < c;
    clean chunk c -> clean chunks <= c;
    clean -> noisy never.
So the logits of chunk c depend only on its own noisy ids and on x_0..x_{c*k}; every chunk of a
window is trained (or scored) in one pass. The clean stream of the last chunk is dropped: no noisy
chunk may read it.

No time (masking-rate) input: for absorbing-state diffusion the optimal denoiser of a masked
position does not depend on t given the noisy chunk (Ou et al. 2024, "RADD"; MDLM and BD3-LM
also run without time conditioning), so each block's rate range only shapes which mask patterns it
sees in training.
"""
from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from ...layers import TransformerLayer, init_weights

MASK_ID = 256          # the absorbing state; byte ids are 0..255
N_IDS = 257            # bytes + MASK


def chunk_ids(t: int, k: int, device=None) -> torch.Tensor:
    """Chunk index of each of t positions."""
    return torch.arange(t, device=device) // k


def clean_len(t: int, k: int) -> int:
    """Positions of the clean stream: every chunk but the last."""
    return ((t - 1) // k) * k


def block_causal_mask(t: int, k: int, device=None) -> torch.Tensor:
    """(T + Tc, T + Tc) bool attention mask of the [noisy || clean] layout (True = may attend)."""
    tc = clean_len(t, k)
    cn = chunk_ids(t, k, device)
    cc = cn[:tc]
    nn_ = cn.view(-1, 1) == cn.view(1, -1)              # noisy c -> noisy c
    nc = cc.view(1, -1) < cn.view(-1, 1)                # noisy c -> clean < c
    cl = cc.view(1, -1) <= cc.view(-1, 1)               # clean c -> clean <= c
    top = torch.cat([nn_, nc], dim=1)
    bottom = torch.cat([torch.zeros(tc, t, dtype=torch.bool, device=device), cl], dim=1)
    return torch.cat([top, bottom], dim=0)


def noisy_prev_ids(context: torch.Tensor, noisy: torch.Tensor, k: int) -> torch.Tensor:
    """The legally visible previous byte of each noisy position (N, T): context[i] at a chunk's
    first position, else the noisy id z_{i-1} (MASK when it is masked)."""
    prev = torch.empty_like(noisy)
    prev[:, 1:] = noisy[:, :-1]
    starts = torch.arange(0, noisy.shape[1], k, device=noisy.device)
    prev[:, starts] = context[:, starts]
    return prev


class ChunkedMaskedNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.k = cfg.chunk_len
        self.tok_emb = nn.Embedding(N_IDS, d)
        self.prev_emb = nn.Embedding(N_IDS, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d)
        self.stream_emb = nn.Embedding(2, d)      # 0 = noisy, 1 = clean
        self.layers = nn.ModuleList(
            TransformerLayer(d, cfg.n_heads, cfg.mlp_ratio, cfg.dropout) for _ in range(cfg.layers_per_block)
        )
        self.norm_out = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab_size)
        init_weights(self)
        nn.init.zeros_(self.head.weight)   # starts uniform over bytes: every bound reads ln 256
        nn.init.zeros_(self.head.bias)
        self._mask_cache: dict[tuple[int, str], torch.Tensor] = {}

    def _mask(self, t: int, device: torch.device) -> torch.Tensor:
        key = (t, str(device))
        m = self._mask_cache.get(key)
        if m is None:
            m = self._mask_cache[key] = block_causal_mask(t, self.k, device)
        return m

    def forward(self, context: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        """context (N, T) clean previous bytes x_i, noisy (N, T) ids z_i in 0..256 -> (N, T, 256)
        logits of y_i at every noisy position. Logits of chunk c read only noisy[:, chunk c] and
        context[:, :c*k + 1]."""
        pos = torch.arange(noisy.shape[1], device=noisy.device)
        h_noisy = (self.tok_emb(noisy) + self.prev_emb(noisy_prev_ids(context, noisy, self.k))
                   + self.pos_emb(pos) + self.stream_emb.weight[0])
        return self.run_streams(h_noisy, context)

    def run_streams(self, h_noisy: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Append the clean stream to the embedded noisy stream (N, T, d), run the layers under the
        block-causal mask, return the head's logits at the noisy positions."""
        t = h_noisy.shape[1]
        dev = h_noisy.device
        tc = clean_len(t, self.k)
        pos = torch.arange(t, device=dev)
        if tc:
            h_clean = (self.tok_emb(context[:, 1:tc + 1]) + self.prev_emb(context[:, :tc])
                       + self.pos_emb(pos[:tc]) + self.stream_emb.weight[1])
            h = torch.cat([h_noisy, h_clean], dim=1)
        else:
            h = h_noisy
        mask = self._mask(t, dev)
        for layer in self.layers:
            h = layer(h, None, mask)
        return self.head(self.norm_out(h[:, :t]))
