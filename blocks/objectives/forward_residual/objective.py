"""Issue 8, candidate (d): ``forward-residual``, forward-chained blocks that refine one shared readout.

Where it comes from. Run G (BENCHMARKS.md) showed forward-chained's later blocks buying nothing:
each trains a head of its own and spends its steps relearning a readout of a stream that keeps
moving under it. Two known remedies, combined here:

* one shared readout. Block 0 is a complete small language model with its own final norm and head.
  Blocks b > 0 have no head: they read the stream through block 0's (a copy taken from the snapshot
  of block 0 they already hold for training, refreshed with it; kept as buffers, so it is never
  trained by block b, travels with block b's state and serves its hop). An improvement block b-1
  makes to the stream reaches block b's prediction directly, and no block relearns a readout;
* residual branches that start at zero. Blocks b > 0 zero-initialise the output projections of their
  attention and MLP, so block b starts as the identity on the stream: at step 0 the chain of blocks
  0..b predicts exactly what blocks 0..b-1 predict, and training moves it only where block b's own
  loss improves. This is boosting over blocks (BoostResNet, Huang et al., ICML 2018) with the
  zero-init residual branches of Goyal et al. (2017) and Fixup (Zhang et al., ICLR 2019).

Everything else is forward-chained's: block b reads read-only snapshots of blocks < b (``no_grad``;
gradients reach block b's layers through the copied readout, never block 0), the chain CE is exact,
one traversal emits one byte, ``prefix_ce`` shows what each block adds.

A first version read every block, block 0 included, through a fixed random readout (256 x d_model
from ``target_seed``, in the spirit of the paper objective's fixed target table); block 0 learned
far slower through it (3.35 nats/byte after 300 S2 steps, against about 2.6 with a learned head) and
later blocks still added nothing, so the readout is now block 0's learned one.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from ..forward_chained import ForwardChainedObjective
from .net import ForwardResidualBlock


class ForwardResidualObjective(ForwardChainedObjective):
    name = "forward-residual"
    block_class = ForwardResidualBlock

    def local_loss(self, block, b, windows, generator=None, upstream: Sequence[nn.Module] | None = None):
        if b > 0:
            block.adopt_readout(self._check_upstream(b, upstream)[0])
        return super().local_loss(block, b, windows, generator, upstream)
