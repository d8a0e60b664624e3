"""Issue 13's ``forward-streamed`` objective: forward-chained's blocks and chain, trained greedily on
the activations the chain actually streams (DGL-style: Belilovsky et al., "Decoupled Greedy
Learning of CNNs", ICML 2020).

Block b continues the residual stream and trains its own layers and its own next-byte head, with
no gradient crossing blocks, exactly like ``forward-chained``; what differs is where its input
comes from. A forward-chained worker recomputes h_{b-1} itself from downloaded snapshots of blocks
< b (b extra forwards per step, snapshots as stale as their last refresh). A forward-streamed
worker receives h_{b-1} (detached) from a holder of block b-1 that just computed it on its own
micro-batch, trains on it, and sends its own output on to a holder of block b+1: the same forward
traffic as ``pipeline``, and no backward traffic. In one process (``chain_train.chain_step``) one
pass computes every block's input once, on the same batch.

Blocks, hops, scoring and generation are forward-chained's (a block checkpoint of one loads as the
other's). ``local_loss`` is forward-chained's too: given snapshots of blocks < b it is the loss
block b trains on (the network itself does not keep snapshots: ``needs_upstream`` is False).
"""
from __future__ import annotations

import torch.nn.functional as F

from ...device import autocast
from ..forward_chained.objective import ForwardChainedObjective


class ForwardStreamedObjective(ForwardChainedObjective):
    name = "forward-streamed"
    needs_upstream = False
    chain_training = "streamed"

    def upstream_blocks(self, b: int) -> int:
        return 0

    def local_loss(self, block, b, windows, generator=None, upstream=None):
        """Block b's loss on the outputs of ``upstream`` (blocks 0..b-1, read-only), as forward-chained."""
        return super().local_loss(block, b, windows, generator, upstream=upstream)

    def stage_forward(self, block, b, h_in, context):
        with autocast((h_in if h_in is not None else context).device):
            h = block.stream(None if b == 0 else h_in, context)
        return h.float()

    def stage_has_loss(self, b: int) -> bool:
        return True

    def stage_loss(self, block, b, h_out, targets):
        with autocast(h_out.device):
            logits = block.logits(h_out)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return ce, {"ce": float(ce.detach())}
