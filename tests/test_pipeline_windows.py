"""Flushed windows in the pipeline engine (node/pipeline/engine.py), on a middle stage's compute alone:
with ``--pipeline-flush`` a block-0 holder marks every micro-batch with its window, and a stage steps
when the first micro-batch of another window arrives, never while a kept graph awaits its backward,
whatever number of micro-batches it counted (run 15's defect: counting made a failed or extra
micro-batch shift a holder's step phase, and later backwards ran on moved weights). In-process and
network-free on purpose, like test_pipeline_stash.py; the real-process check is
test_pipeline_flush.py.
"""
from __future__ import annotations

import numpy as np
import torch

from blocktrain.node.pipeline.engine import MAX_DEFERRED, PipelineEngine
from blocktrain.node.pipeline.settings import PipelineSettings
from blocktrain.node.trainer import BlockTrainer

from test_utils.configs import tiny_config

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


class _NoRoute:   # block 1's engine needs a route object; these tests never send (compute only)
    async def send(self, *a, **k):
        raise AssertionError("not used")


def _engine(accumulate: int = 2) -> tuple[PipelineEngine, BlockTrainer]:
    cfg = tiny_config(objective="pipeline", n_blocks=4, batch_size=2)
    t = BlockTrainer(cfg, 1, DATA, DATA, seed=0, worker_id=1)
    return PipelineEngine(t, n_blocks=4, loop=None, next_stage=_NoRoute(),
                          settings=PipelineSettings(accumulate=accumulate, inflight=2, flush=True)), t


def _mb(t: BlockTrainer, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n, T, D = 2, t.cfg.seq_len, t.objective.state_dim()
    return torch.randn(n, T, D, generator=gen), torch.randint(0, 256, (n, T), generator=gen), \
        torch.randn(n, T, D, generator=gen) * 1e-2


def _through(e: PipelineEngine, t: BlockTrainer, window, seeds):
    """Forwards of ``seeds`` in ``window``, then their backwards (a window as block 0 sends it)."""
    works = []
    for s in seeds:
        x, y, _ = _mb(t, s)
        works.append(e._forward(x, None, y, window))
    for s, w in zip(seeds, works):
        e._backward(w, _mb(t, s)[2], 1.0)


def test_a_stage_steps_once_per_window_whatever_it_counted():
    e, t = _engine(accumulate=2)
    try:
        _through(e, t, ("o", 0), [1, 2, 3])      # three micro-batches (more than accumulate): no step yet
        assert t.step == 0 and t.pending_microbatches == 3
        _through(e, t, ("o", 1), [4])            # the next window: one step on the three, before its forward
        assert t.step == 1 and t.pending_microbatches == 1
        _through(e, t, ("o", 1), [5])            # a retry or an extra one in the same window: no step
        assert t.step == 1 and t.pending_microbatches == 2
        _through(e, t, ("o", 2), [6, 7])
        st = e.stats.snapshot()
        assert t.step == 2 and st["steps"] == 2 and st["recomputed"] == 0 and e._open == 0
    finally:
        e.close()


def test_a_window_change_while_a_graph_is_open_waits_then_steps_anyway():
    e, t = _engine()
    try:
        _through(e, t, ("o", 0), [1])
        x, y, g = _mb(t, 2)
        held = e._forward(x, None, y, ("o", 1))  # steps (nothing open), then keeps its graph
        assert t.step == 1 and e._open == 1
        _through(e, t, ("o", 1), [3])            # a second one of its window goes through: gradients pending
        for k in range(MAX_DEFERRED):            # other windows arrive while it is held: no step
            _through(e, t, ("p", k), [10 + k])
        assert t.step == 1 and e.stats.snapshot()["window_steps_deferred"] == MAX_DEFERRED
        e._backward(held, g, 1.0)                # its backward meets the weights its forward used
        assert e.stats.snapshot()["recomputed"] == 0 and e._open == 0
        held = e._forward(x, None, y, ("o", 5))  # nothing open at this change: a normal step
        assert t.step == 2
        _through(e, t, ("o", 5), [4])
        for k in range(MAX_DEFERRED + 1):        # held through more changes than MAX_DEFERRED: forced
            _through(e, t, ("q", k), [20 + k])
        st = e.stats.snapshot()
        assert t.step == 3 and st["window_steps_forced"] == 1
        e._backward(held, g, 1.0)                # that one is now stale, and counted
        assert e.stats.snapshot()["recomputed"] == 1
        e._release(held)                         # releasing twice (answer path and finally) is harmless
        assert e._open == 0
    finally:
        e.close()


def test_micro_batches_without_a_window_keep_the_accumulate_count():
    e, t = _engine(accumulate=2)
    try:
        _through(e, t, None, [1])
        assert t.step == 0
        _through(e, t, None, [2])
        assert t.step == 1 and t.pending_microbatches == 0
        _through(e, t, None, [3, 4, 5])
        assert t.step == 2 and t.pending_microbatches == 1
    finally:
        e.close()
