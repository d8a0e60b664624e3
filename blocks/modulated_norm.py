"""adaLN's ``LayerNorm(x) * (1 + scale) + shift`` as one autograd function that saves less.

Written as ``torch.addcmul(shift, layer_norm(x), 1 + scale)``, autograd keeps THREE activations
of shape (N, T, d) per use: x (for the norm's backward), the normalised x (for the grad of
``scale``) and the output (for the next layer's weights). Here only the normalised x and the
per-position reciprocal std are kept: the norm's backward needs exactly those, and the grad of
``scale`` needs the normalised x too. A transformer layer uses two of these, so a block keeps two
fewer (N, T, d) tensors per layer for its backward (a training-memory cost of adaLN that the
end-to-end reference, whose norms are plain, does not pay). Same values and gradients as the
composed ops (tested with ``gradcheck``).
"""
from __future__ import annotations

import torch


class _ModulatedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float):
        mean = x.mean(-1, keepdim=True)
        xc = x - mean
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        xhat = xc.mul_(rstd)
        ctx.save_for_backward(xhat, rstd, scale)
        ctx.shapes = (scale.shape, shift.shape)
        return torch.addcmul(shift, xhat, 1 + scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xhat, rstd, scale = ctx.saved_tensors
        scale_shape, shift_shape = ctx.shapes
        g_xhat = grad * (1 + scale)
        # d LayerNorm: rstd * (g - mean(g) - xhat * mean(g * xhat)), over the feature axis
        g_x = (g_xhat - g_xhat.mean(-1, keepdim=True)
               - xhat * (g_xhat * xhat).mean(-1, keepdim=True)).mul_(rstd)
        g_scale = _sum_to(grad * xhat, scale_shape) if ctx.needs_input_grad[1] else None
        g_shift = _sum_to(grad, shift_shape) if ctx.needs_input_grad[2] else None
        return g_x, g_scale, g_shift, None


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to ``shape`` (the inverse of broadcasting)."""
    lead = t.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and t.shape[lead + i] != 1]
    return t.sum(dims, keepdim=True).reshape(shape) if dims else t


def modulated_layer_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                         eps: float = 1e-5) -> torch.Tensor:
    """``layer_norm(x) * (1 + scale) + shift`` (no affine norm weights), over the last axis.

    ``scale`` and ``shift`` broadcast against x, e.g. (N, 1, d) per sequence or (N, T, d) per
    position. Under autocast the math runs in x's dtype promoted to at least float32."""
    if torch.is_autocast_enabled(x.device.type):
        x, scale, shift = x.float(), scale.float(), shift.float()
    return _ModulatedLayerNorm.apply(x, scale, shift, eps)
