"""Transformer building blocks shared by the block denoiser and the end-to-end reference."""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .modulated_norm import modulated_layer_norm
from .rng import rng_restored, rng_state


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(n, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(d_model, ratio * d_model)
        self.out = nn.Linear(ratio * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))


class TransformerLayer(nn.Module):
    """Pre-norm layer. ``modulated=True`` makes it an adaLN layer conditioned on the noise level
    in the adaLN-single form (PixArt-alpha): the block computes ONE shift/scale/gate vector per
    sequence from the noise embedding and each layer adds its own learned offset, so conditioning
    costs 6d parameters per layer instead of a 6d x d projection per layer."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float = 0.0,
                 modulated: bool = False):
        super().__init__()
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.mlp = MLP(d_model, mlp_ratio, dropout)
        self.norm1 = nn.LayerNorm(d_model, elementwise_affine=not modulated)
        self.norm2 = nn.LayerNorm(d_model, elementwise_affine=not modulated)
        self.mod_offset = nn.Parameter(torch.zeros(6 * d_model)) if modulated else None

    def forward(self, x: torch.Tensor, modulation: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``modulation``: (N, 6d) or (N, T, 6d) from the block's shared adaLN projection."""
        if self.mod_offset is None:
            x = x + self.attn(self.norm1(x), attn_mask)
            return x + self.mlp(self.norm2(x))
        m = modulation + self.mod_offset
        if m.dim() == 2:
            m = m.unsqueeze(1)
        s1, b1, g1, s2, b2, g2 = m.chunk(6, dim=-1)
        # fused norm+modulation keeps one (N, T, d) activation fewer per norm; addcmul gates keep one
        # activation per gate instead of two (the memory of a block step)
        x = torch.addcmul(x, self.attn(modulated_layer_norm(x, s1, b1, self.norm1.eps), attn_mask), 1 + g1)
        return torch.addcmul(x, self.mlp(modulated_layer_norm(x, s2, b2, self.norm2.eps)), 1 + g2)


class NoiseEmbedding(nn.Module):
    """Fourier features of c_noise followed by an MLP (as in EDM/DiT)."""

    def __init__(self, d_model: int, n_freqs: int = 64):
        super().__init__()
        self.register_buffer("freqs", torch.exp(torch.linspace(0, math.log(1000.0), n_freqs)), persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2 * n_freqs, d_model), nn.SiLU(), nn.Linear(d_model, d_model))

    def forward(self, c_noise: torch.Tensor) -> torch.Tensor:
        a = c_noise.float().unsqueeze(-1) * self.freqs
        return self.mlp(torch.cat([a.sin(), a.cos()], dim=-1))


def backward_with(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` without the memory that call costs: given an explicit gradient, torch's
    ``backward`` checks its shape through ``torch.fx.experimental.symbolic_shapes``, whose first import
    pulls in sympy and mpmath (~35 MB of RSS a worker would hold for life; BENCHMARKS.md "Memory of a
    pipeline block"). Instead the scalar ``output.sum()`` is backpropagated with a hook on ``output`` that
    hands on ``grad`` in place of the sum's: every gradient below is the same, bit for bit."""
    g = grad.detach().to(output.dtype)
    hook = output.register_hook(lambda _ones: g)
    try:
        output.sum().backward()
    finally:
        hook.remove()


class _CheckpointedLayer(torch.autograd.Function):
    """One layer run without a graph; its backward runs it again from its saved input (the same random
    state, the same autocast) and backpropagates through that at once, adding to the layer's parameter
    gradients. Our own rather than ``torch.utils.checkpoint``: the non-reentrant one imports torch._dynamo
    at its first call and the reentrant one backpropagates with an explicit gradient (sympy): +35-72 MB
    of RSS for the life of every process that uses it (measured 2026-12-03, torch 2.13)."""

    @staticmethod
    def forward(ctx, layer: nn.Module, h: torch.Tensor, *args):
        ctx.layer, ctx.args, ctx.rng = layer, args, rng_state(h.device)
        kind = h.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(h)
        return layer(h, *args)      # autograd.Function runs its forward without a graph

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (h,) = ctx.saved_tensors
        h = h.detach().requires_grad_(True)
        kind, enabled, dtype = ctx.autocast
        with rng_restored(ctx.rng, h.device):
            with torch.enable_grad():
                with torch.autocast(kind, dtype=dtype, enabled=enabled):
                    out = ctx.layer(h, *ctx.args)
                backward_with(out, grad)
        return (None, h.grad, *(None for _ in ctx.args))


_LAYER_CHECKPOINT = contextvars.ContextVar("layer_checkpoint", default=False)


@contextlib.contextmanager
def layer_checkpointing(on: bool = True) -> Iterator[None]:
    """Activation checkpointing per layer for the forwards run inside (in this thread): :func:`run_layers`
    keeps only each layer's input for the backward and runs the layer again during the backward (the
    random state and autocast replayed: :class:`_CheckpointedLayer`), so a forward+backward holds one
    layer's activations at a time instead of all of them, for one more forward of the layers. The
    gradients are those of the plain forward (float tolerance). Used by the pipeline engine's
    ``--pipeline-layer-checkpoint`` (node/pipeline/engine.py) and by ``bench memory``."""
    token = _LAYER_CHECKPOINT.set(bool(on))
    try:
        yield
    finally:
        _LAYER_CHECKPOINT.reset(token)


def run_layers(layers: Iterable[nn.Module], h: torch.Tensor, *args) -> torch.Tensor:
    """``h`` through ``layers`` in order (each called as ``layer(h, *args)``), checkpointed per layer inside
    :func:`layer_checkpointing` when gradients are being recorded."""
    ckpt = _LAYER_CHECKPOINT.get() and torch.is_grad_enabled()
    for layer in layers:
        # an input without a gradient (nothing upstream trains) would hide the layer's own parameters
        # from a checkpointed backward: such a layer runs plainly
        h = _CheckpointedLayer.apply(layer, h, *args) if ckpt and h.requires_grad else layer(h, *args)
    return h


def residual_stream(m: nn.Module, h: torch.Tensor | None, context: torch.Tensor | None, embed: bool) -> torch.Tensor:
    """A slice of the byte-level Transformer on its residual stream: with ``embed`` (the slice that starts
    the model, holding ``byte_emb`` and ``pos_emb``) the stream starts from the bytes ``context``, else it
    is ``h``; then ``m.layers`` in order. ReferenceLM, a pipeline block and a forward-chained block."""
    if embed:
        pos = torch.arange(context.shape[1], device=context.device)
        h = m.byte_emb(context) + m.pos_emb(pos)
    return run_layers(m.layers, h)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
