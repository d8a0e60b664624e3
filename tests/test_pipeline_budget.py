"""A micro-batch's time budget (node/pipeline/budget.py) and what the engine does with it, in process.

* the estimate is RFC 6298's (SRTT + 4 RTTVAR, and at least 2 SRTT), clamped to
  [--pipeline-timeout, --pipeline-timeout-max];
  a micro-batch lost for want of time doubles it, once for micro-batches that shared one budget;
* a block-0 holder whose chain answers slower than the budget loses the first micro-batch, backs off,
  and completes the next ones (a fixed budget, floor == ceiling, loses them all);
* a stage whose compute thread frees up only after its caller's deadline does not run that forward:
  it answers ``timeout`` at once and counts it (``expired_in_queue``).
The same on real processes: tests/test_pipeline_slow_chain.py.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from blocktrain.node.pipeline.budget import MicrobatchBudget
from blocktrain.node.pipeline.engine import PipelineEngine
from blocktrain.node.pipeline.settings import PipelineSettings
from blocktrain.node.routing.pipeline_route import DownstreamFailed
from blocktrain.node.trainer import BlockTrainer
from blocktrain.p2p.errors import HopRequestError
from blocktrain.p2p.pipeline_wire import StageRequest, StageResponse

from test_utils.configs import tiny_config

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


def test_the_budget_follows_rfc6298_within_its_floor_and_ceiling():
    b = MicrobatchBudget(1.0, 20.0)
    assert b.current() == 1.0                       # the configured timeout, until something is measured
    b.completed(2.0)                                # first sample: SRTT 2, RTTVAR 1 -> 2 + 4
    assert b.current() == pytest.approx(6.0)
    b.completed(2.0)                                # RTTVAR 0.75, SRTT 2 -> 5
    assert b.current() == pytest.approx(5.0)
    for _ in range(100):                            # steady: the deviation decays, twice the mean stays
        b.completed(2.0)
    assert b.snapshot()["rttvar_s"] < 1e-3 and b.current() == pytest.approx(4.0)
    for _ in range(200):                            # a fast chain: the floor holds
        b.completed(0.1)
    assert b.current() == pytest.approx(1.0)
    assert b.snapshot()["srtt_s"] == pytest.approx(0.1, abs=1e-3)
    for _ in range(3):
        b.completed(100.0)                          # a chain slower than the ceiling: clamped to it
    assert b.current() == 20.0


def test_a_timeout_doubles_the_budget_once_per_budget_and_never_past_the_ceiling():
    b = MicrobatchBudget(2.0, 10.0)
    used = b.current()
    for _ in range(4):                              # four in flight on one budget time out together
        b.timed_out(used)
    assert b.current() == 4.0 and b.snapshot()["backoffs"] == 1
    b.timed_out(b.current())
    b.timed_out(b.current())
    assert b.current() == 10.0                      # 16 clamped
    b.timed_out(b.current())
    assert b.snapshot()["backoffs"] == 3            # at the ceiling: nothing more to double
    fixed = MicrobatchBudget(5.0, 5.0)              # floor == ceiling: the old fixed budget
    fixed.timed_out(5.0)
    fixed.completed(50.0)
    assert fixed.current() == 5.0
    with pytest.raises(ValueError):
        MicrobatchBudget(10.0, 5.0)
    with pytest.raises(ValueError, match="timeout max"):
        PipelineSettings(timeout_s=30.0, timeout_max_s=10.0)


class _SlowChain:
    """The route to block 1 of a chain whose round trip is ``rtt`` seconds: it answers in time or, when
    the deadline is shorter, gives up at the deadline with ``timeout`` (as NextStage does)."""

    def __init__(self, rtt: float, shape):
        self.rtt, self.shape, self.deadlines = rtt, shape, []

    async def any_holder(self, block):
        return True

    async def send(self, block, state, targets, deadline_s, origin="", window=None):
        self.deadlines.append(deadline_s)
        if deadline_s < self.rtt:
            await asyncio.sleep(deadline_s)
            raise DownstreamFailed("timeout", f"no time left to reach block {block}")
        await asyncio.sleep(self.rtt)
        return StageResponse("r", torch.zeros(self.shape), 1.0, {1: 1.0}, ["p1"])


def _engine(block: int, settings: PipelineSettings, route) -> tuple[PipelineEngine, BlockTrainer]:
    cfg = tiny_config(objective="pipeline", n_blocks=3, batch_size=2)
    t = BlockTrainer(cfg, block, DATA, DATA, seed=0, worker_id=1)
    return PipelineEngine(t, n_blocks=3, loop=None, next_stage=route, settings=settings), t


@pytest.mark.parametrize("fixed", [False, True])
def test_a_block0_holder_backs_off_until_a_slow_chain_answers(fixed):
    cfg = tiny_config(objective="pipeline", n_blocks=3, batch_size=2)
    settings = PipelineSettings(timeout_s=1.0, timeout_max_s=1.0 if fixed else 8.0)
    route = _SlowChain(1.5, None)                   # a round trip slower than the 1 s floor
    e, t = _engine(0, settings, route)
    route.shape = (2, cfg.seq_len, t.objective.state_dim())
    try:
        windows = torch.randint(0, 256, (2, cfg.seq_len + 1))

        async def four():
            for _ in range(4):
                await e._microbatch(windows)
        asyncio.run(four())
        st = e.stats.snapshot()
        if not fixed:
            assert st["lost_by_reason"] == {"timeout": 1} and st["completed"] == 3, st
            assert route.deadlines[:2] == [1.0, 2.0]            # lost at 1 s, then twice the budget
            snap = e.budget.snapshot()
            assert snap["backoffs"] == 1 and snap["samples"] == 3
            assert 1.5 <= snap["srtt_s"] < 2.0 and e.budget.current() > 1.5
            assert t.step == 3                                  # the completed ones trained
        else:                                                   # a fixed 1 s budget: every one lost
            assert st["lost_by_reason"] == {"timeout": 4} and st["completed"] == 0, st
            assert route.deadlines == [1.0] * 4 and t.step == 0
    finally:
        e.close()


def test_a_stage_does_not_run_a_forward_whose_caller_has_given_up():
    cfg = tiny_config(objective="pipeline", n_blocks=3, batch_size=2)
    e, t = _engine(1, PipelineSettings(), _SlowChain(0.0, None))
    D = t.objective.state_dim()
    e.next.shape = (2, cfg.seq_len, D)
    e.accepting = True
    try:
        busy = e._compute.submit(time.sleep, 1.5)            # the compute thread is busy for 1.5 s
        req = StageRequest(1, torch.randn(2, cfg.seq_len, D), torch.randint(0, 256, (2, cfg.seq_len)),
                           "backprop", "fp32", deadline_s=1.0, request_id="late")
        t0 = time.monotonic()
        with pytest.raises(HopRequestError) as ei:
            asyncio.run(e.handle(req))
        assert ei.value.code == "timeout" and "deadline passed" in str(ei.value)
        assert time.monotonic() - t0 < 5.0                   # answered when the thread freed up (1.5 s)
        busy.result()
        st = e.stats.snapshot()
        assert st["expired_in_queue"] == 1 and "forward" not in st["times_s"], st
        assert t.pending_microbatches == 0 and e._open == 0 and st["received"] == 1
        ok = StageRequest(1, torch.randn(2, cfg.seq_len, D), torch.randint(0, 256, (2, cfg.seq_len)),
                          "backprop", "fp32", deadline_s=30.0, request_id="ok")
        resp = asyncio.run(e.handle(ok))                     # one in time runs as before
        assert resp.grad is not None and resp.grad.shape == (2, cfg.seq_len, D)
        assert e.stats.snapshot()["expired_in_queue"] == 1
    finally:
        e.close()


def test_block0s_duty_cycle_charges_its_compute_not_the_wait_on_the_chain_below():
    """--train-duty paces block 0 by the compute each micro-batch took on the node (forward, backward, step),
    not by its round trip: a chain that takes 1 s to answer, or a holder that stalls until the budget runs
    out, kept the node idle (before, the pause was (1 - f) / f times the round trip: a 60-s stall at
    --train-duty 0.1 idled block 0 for 9 minutes after it)."""
    import concurrent.futures
    import threading

    from blocktrain.node.loops import DutyCycle
    cfg = tiny_config(objective="pipeline", n_blocks=3, batch_size=2)
    route = _SlowChain(1.0, None)                   # answers in 1 s
    e, t = _engine(0, PipelineSettings(timeout_s=2.0, timeout_max_s=2.0), route)
    route.shape = (2, cfg.seq_len, t.objective.state_dim())
    e.duty = DutyCycle(0.25)
    windows = torch.randint(0, 256, (2, cfg.seq_len + 1))
    try:
        t0 = time.monotonic()
        busy = asyncio.run(e._microbatch(windows))
        wall = time.monotonic() - t0
        assert t.step == 1 and wall >= 1.0 and 0.0 < busy < 0.5, (wall, busy)   # forward + backward + step
        fut = concurrent.futures.Future()
        fut.set_result(busy)
        slots = threading.BoundedSemaphore(1)
        slots.acquire()
        e._done(slots, t0, fut)
        assert e._owed == pytest.approx(3 * busy)   # 3x its compute, not 3x its 1-s round trip
        route.rtt = 30.0                            # the holder below stalls: lost when the 2-s budget runs out
        t0 = time.monotonic()
        busy = asyncio.run(e._microbatch(windows))
        assert time.monotonic() - t0 >= 2.0 and 0.0 < busy < 0.5 and t.step == 1
        assert e.stats.snapshot()["lost_by_reason"] == {"timeout": 1}
    finally:
        e.close()
