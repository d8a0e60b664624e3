"""A real ``bt-node`` whose every hop answer (or block state) is poisoned, the way a buggy or
hostile holder answers.

    python tests/test_utils/faulty_node.py nan_hops|inf_hops|shape_hops|nan_state|slow_step|open_stages join ...

The fault wraps the node's hop handler from the test side (the server-side hop adapter the node
hands to its RPC server), or for ``nan_state`` the block state its RPC serves (what late joiners
and rebalancing movers download; its hops stay honest); ``slow_step`` is not hostile: every local
training step after the first takes ``SLOW_STEP_S`` seconds longer, under the trainer's lock, as a
big block's step on a slow machine does; ``open_stages`` is not hostile either: its pipeline stages serve any
caller (the upstream gate of node/pipeline/admission.py off), for tests whose own peer sends a stage a
micro-batch. The product itself has no fault knob.
"""
from __future__ import annotations

import sys
import time

import torch

from blocktrain.p2p.hops import HopResponse

FAULTS = {
    "nan_hops": lambda s: torch.full_like(s, float("nan")),
    "inf_hops": lambda s: torch.full_like(s, float("inf")),
    "shape_hops": lambda s: s[:, :-1] if s.shape[1] > 1 else s[..., :-1],
}


def poisoned(kind: str, serve_local):
    """Wrap ``serve_local`` (hop -> RPC handler) so that every answer's state is poisoned."""
    poison = FAULTS[kind]

    def wrap(hop):
        handler = serve_local(hop)

        def bad(req):
            resp = handler(req)
            return HopResponse(resp.request_id, poison(resp.state), resp.logits)
        return bad
    return wrap


def nan_state(served_state):
    """Wrap ``BlockTrainer.served_state`` so that every tensor it serves is NaN."""
    def bad(self):
        meta, tensors = served_state(self)
        return meta, {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    return bad


SLOW_STEP_S = 12.0


def slow_steps(optimizer_step):
    """Wrap ``optimizer_step`` (called under the trainer's lock) so that every step after the first
    sleeps ``SLOW_STEP_S`` seconds."""
    calls = [0]

    def slow(*args, **kwargs):
        calls[0] += 1
        if calls[0] > 1:
            time.sleep(SLOW_STEP_S)
        return optimizer_step(*args, **kwargs)
    return slow


def open_stages() -> None:
    """Every pipeline stage of this node serves any caller (no upstream gate)."""
    from blocktrain.node.pipeline import compose
    compose.upstream_gate = lambda node, block, on_refused: None


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in (*FAULTS, "nan_state", "slow_step", "open_stages"):
        sys.exit(f"usage: faulty_node.py {{{','.join(FAULTS)},nan_state,slow_step,open_stages}} BT-NODE-ARGS...")
    from blocktrain.cli.main import main as bt_node
    from blocktrain.node import node as node_module
    if argv[0] == "open_stages":
        open_stages()
    elif argv[0] == "slow_step":
        from blocktrain.node import trainer
        trainer.optimizer_step = slow_steps(trainer.optimizer_step)
    elif argv[0] == "nan_state":
        from blocktrain.node.trainer import BlockTrainer
        BlockTrainer.served_state = nan_state(BlockTrainer.served_state)
    else:
        node_module.serve_local = poisoned(argv[0], node_module.serve_local)
    sys.argv = ["bt-node", *argv[1:]]
    bt_node()


if __name__ == "__main__":
    main(sys.argv[1:])
