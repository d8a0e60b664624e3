"""A node's pipeline parts in the test's process: what ``node/pipeline/compose.py`` reads of a node (options,
config, libp2p daemon, event loop, router), so tests can run a node's real engine, ``rpc_train`` service and
train loop (``Node._run_pipeline``) on a real daemon, without its DHT, averager or HTTP API."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from blocktrain.node.node import Node
from blocktrain.node.options import NodeOptions
from blocktrain.node.pipeline.compose import start_pipeline
from blocktrain.node.trainer import BlockTrainer

from test_utils.reliability import wait_for

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


def holder(peer_id: str) -> SimpleNamespace:
    """A holder record as the router lists it (online, serving)."""
    return SimpleNamespace(peer_id=peer_id, state="online", serving=True)


class PipelineNode:
    """Block ``block`` of ``cfg`` served on ``p2p`` by the node's own engine and train loop. ``holders(fresh)``
    is the router's answer, {block: [holder records]} (nobody by default). Use as a context manager."""

    def __init__(self, p2p, loop, cfg, block: int, run_id: str, checkpoint_dir, holders=lambda fresh: {}):
        self.cfg, self.stop_event, self._thread, self._teardown = cfg, threading.Event(), None, []
        self.ns = SimpleNamespace(
            opts=NodeOptions(checkpoint_dir=checkpoint_dir, run_id=run_id), cfg=cfg, run_id=run_id, p2p=p2p,
            peer_id=str(p2p.peer_id), loop=loop, router=SimpleNamespace(holders=holders),
            auth=SimpleNamespace(restricted=False), duty=None, _after_step=lambda: None, _idle=lambda: False,
            teardown=SimpleNamespace(push=lambda name, fn, budget=None: self._teardown.append(fn)),
            trainer=self.trainer(block), block_index=block)

    def trainer(self, block: int) -> BlockTrainer:
        return BlockTrainer(self.cfg, block, DATA, DATA)

    def __enter__(self) -> "PipelineNode":
        try:
            start_pipeline(self.ns)
            self._thread = threading.Thread(target=Node._run_pipeline, args=(self.ns, self.stop_event), daemon=True)
            self._thread.start()
            wait_for(lambda: self.ns.pipeline.accepting, 30, "the node's engine to accept micro-batches")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(10)
        for fn in reversed(self._teardown):   # the node's teardown order: its engine, then its rpc_train service
            fn()
        self._teardown.clear()
