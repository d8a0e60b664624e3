"""The node trainer's learning rate: warm-up then constant by default (a volunteer run has no end), or
with ``--lr-decay-seconds`` (a budgeted run: benchmarks) warm-up then cosine to a tenth of the peak over
that many seconds of its training, from its first step; the optimizer steps at that rate, locally and
for a pipeline block's accumulated micro-batches."""
from __future__ import annotations

import math

import numpy as np
import pytest

from blocktrain.node.trainer import BlockTrainer

from test_utils.configs import tiny_config

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _group_lr(t: BlockTrainer) -> float:
    return t.opt.param_groups[0]["lr"]


def test_default_is_warm_up_then_constant():
    cfg = tiny_config(warmup_steps=2, lr=2e-3)
    t = BlockTrainer(cfg, 0, DATA, DATA)
    rates = []
    for _ in range(5):
        t.train_step()
        rates.append(_group_lr(t))
    assert rates == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3, 2e-3]) and t.last_lr == pytest.approx(2e-3)


def test_decay_follows_this_trainers_own_clock_to_a_tenth():
    cfg = tiny_config(warmup_steps=1, lr=4e-3)
    clock = Clock()
    t = BlockTrainer(cfg, 0, DATA, DATA, lr_decay_s=100.0, clock=clock)
    assert t.last_lr is None
    clock.t += 50                 # time before the first step does not count
    t.train_step()                # step 0: warm-up, and the clock starts
    assert _group_lr(t) == pytest.approx(4e-3)
    seen = []
    for elapsed in (0.0, 25.0, 50.0, 100.0, 400.0):
        clock.t = 1050.0 + elapsed
        t.train_step()
        seen.append(_group_lr(t))
    floor = 0.1 * 4e-3
    want = [floor + (4e-3 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, e / 100))) for e in (0, 25, 50, 100, 400)]
    assert seen == pytest.approx(want) and seen[-1] == pytest.approx(floor) and t.last_lr == pytest.approx(floor)


def test_a_pipeline_blocks_accumulated_step_uses_the_same_rate():
    cfg = tiny_config(warmup_steps=0, lr=2e-3, objective="pipeline")
    clock = Clock()
    t = BlockTrainer(cfg, 1, DATA, DATA, lr_decay_s=10.0, clock=clock)
    for k in range(2):
        for p in t.module.parameters():            # a micro-batch's gradients, as the engine leaves them
            p.grad = p.detach().clone().normal_() if p.requires_grad else None
        t.add_microbatch(4, 1.0)
        clock.t += 10.0 * k                        # the first step starts the clock; the second is at the end
        assert t.step_accumulated() is not None
    assert t.step == 2 and _group_lr(t) == pytest.approx(2e-4) and t.last_lr == pytest.approx(2e-4)


@pytest.mark.parametrize("bad", [0.0, -5.0, float("inf"), float("nan")])
def test_a_bad_decay_is_refused(bad):
    with pytest.raises(ValueError, match="lr_decay_s"):
        BlockTrainer(tiny_config(), 0, DATA, DATA, lr_decay_s=bad)
