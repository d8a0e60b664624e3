"""Exact FLOP counts of the plain pre-LN Transformer pieces, written out by hand, to check what
``blocks.flops.measure_step_flops`` counts (matmuls 2 x in x out per row; attention over the full
T x T scores, forward 2 bmm and backward 5, as torch counts it)."""
from __future__ import annotations


def layer_weights(d: int, mlp_ratio: int = 4) -> int:
    """Matmul weights of one layer: qkv 3d^2, proj d^2, MLP 2 * ratio * d^2."""
    return (4 + 2 * mlp_ratio) * d * d


def stream_forward(n: int, t: int, d: int, layers: int, mlp_ratio: int = 4) -> int:
    """One forward of ``layers`` layers on (n, t) positions, no head."""
    return layers * (2 * n * t * layer_weights(d, mlp_ratio) + 4 * n * t * t * d)


def ar_train_step(n: int, t: int, d: int, layers: int, vocab: int = 256, mlp_ratio: int = 4) -> int:
    """Forward + backward of layers + head (every matmul input needs its gradient): 6 x weights x rows
    for the matmuls, 14 n t^2 d per layer for attention."""
    return 6 * n * t * (layers * layer_weights(d, mlp_ratio) + d * vocab) + 14 * layers * n * t * t * d
