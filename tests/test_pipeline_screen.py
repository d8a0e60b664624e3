"""The loss screen of a stage that computes a loss on what others send it (node/pipeline/screen.py), alone; the
live attack (a Sybil holder of block 0 sending poisoned micro-batches) is in tests/test_pipeline_admission.py."""
from __future__ import annotations

import random

import pytest

from blocktrain.node.pipeline.screen import LossScreen
from blocktrain.node.pipeline.settings import PipelineSettings


def _honest(n: int, start: float = 5.5, end: float = 2.0, noise: float = 0.08, seed: int = 0) -> list[float]:
    """Losses of a model learning: falling from ``start`` to ``end``, each micro-batch's a little off the trend."""
    r = random.Random(seed)
    return [start + (end - start) * i / (n - 1) + r.gauss(0, noise) for i in range(n)]


def test_nothing_is_screened_before_the_warm_up_then_a_far_loss_is_refused_and_moves_nothing():
    s = LossScreen(1.0, window=64, warmup=16)
    for x in [2.5] * 15:
        assert s.refuses(x) is None
        s.trained(x)
    assert s.threshold() is None and s.refuses(50.0) is None   # 15 < warm-up: not screened
    s.trained(2.5)
    assert s.threshold() == pytest.approx(3.5)
    why = s.refuses(9.2)
    assert why is not None and "9.200" in why and "3.500" in why
    assert s.refuses(3.4) is None
    for _ in range(100):   # refused losses never enter the window: the threshold stays where honest losses put it
        assert s.refuses(9.2) is not None
    assert s.threshold() == pytest.approx(3.5) and s.refused == 101


def test_a_learning_model_is_never_refused_and_the_threshold_follows_it_down():
    s = LossScreen(1.0)
    for x in _honest(2000):
        assert s.refuses(x) is None, x
        s.trained(x)
    assert s.threshold() == pytest.approx(2.0 + 1.0, abs=0.15)
    assert s.refuses(2.0 + 1.5) is not None


def test_wide_honest_spread_widens_the_screen_and_zero_turns_it_off():
    wide = LossScreen(0.1)   # a small margin: the spread of the honest losses decides
    for x in _honest(500, 2.5, 2.5, noise=0.3):
        wide.trained(x)
    assert wide.threshold() > 2.5 + 6 * 0.3 * 0.9
    off = LossScreen(0.0)
    for x in [2.0] * 200:
        off.trained(x)
    assert not off.on and off.threshold() is None and off.refuses(1e6) is None


def test_settings_check_the_margin():
    assert PipelineSettings().loss_screen == 0.0   # opt-in
    for bad in (-0.1, 100.5, float("nan")):
        with pytest.raises(ValueError, match="loss screen"):
            PipelineSettings(loss_screen=bad)


def test_rebase_moves_the_window_by_the_reference_losses_change():
    s = LossScreen(1.0, window=64, warmup=16)
    for x in [2.0] * 40:
        s.trained(x, "inputs", "targets")
    assert s.rebase(3.6) == pytest.approx(1.6)   # an averaging round raised every honest loss by 1.6
    assert s.threshold() == pytest.approx(4.6) and s.refuses(3.5) is None and s.refuses(4.7) is not None
    assert s.reference == ("inputs", "targets", 3.6) and s.rebased == 1


def test_a_stage_follows_an_averaging_round_that_moves_every_loss_and_keeps_refusing_poison():
    """The engine's part: after an outside write of the weights (here a change as an accepted averaging round
    applies it) that raises every honest loss by more than the margin, honest micro-batches are still trained
    on (without the rebase the screen refused every one from then on, its window never following), and
    poisoned targets are still refused."""
    import numpy as np
    import torch
    from blocktrain.blocks.config import ModelConfig
    from blocktrain.node.pipeline.engine import PipelineEngine, _Outlier
    from blocktrain.node.trainer import BlockTrainer
    from blocktrain.p2p.aioloop import LoopThread

    cfg = ModelConfig(objective="pipeline", d_model=32, n_heads=2, layers_per_block=1, n_blocks=2, seq_len=16,
                      batch_size=4, warmup_steps=0, lr=0.01)
    data = np.frombuffer(bytes(range(256)) * 64, dtype=np.uint8)
    t = BlockTrainer(cfg, 1, data, data)
    loop = LoopThread(name="bt-test-screen")
    try:
        eng = PipelineEngine(t, n_blocks=2, loop=loop, next_stage=None, settings=PipelineSettings(loss_screen=1.0))
        g = torch.Generator().manual_seed(0)
        h = torch.randn(4, 16, 32, generator=g)   # one upstream state, and the text it stands for (all "e")
        y = torch.full((4, 16), ord("e"))
        for _ in range(40):
            eng._forward(h.clone(), None, y)
        base = eng.screen.threshold()
        assert base is not None
        with pytest.raises(_Outlier):
            eng._forward(h.clone(), None, torch.full_like(y, ord("x")))
        with torch.no_grad():   # an accepted round that makes every loss much worse: a shift well past the margin
            change = [torch.randn(p.shape, generator=g) * 2.0 * p.detach().abs().mean() for p in t.module.parameters()]
            t.apply_change(change)

            def honest_loss():
                return float(t.objective.stage_loss(t.module, 1, t.objective.stage_forward(t.module, 1, h, None), y)[0])
            assert honest_loss() > base   # without following the write, every honest micro-batch is refused now
        eng._forward(h.clone(), None, y)          # honest: trained on, the window moved with the weights
        assert eng.screen.rebased == 1 and eng.screen.threshold() != pytest.approx(base)
        with pytest.raises(_Outlier):
            eng._forward(h.clone(), None, torch.full_like(y, ord("x")))
    finally:
        loop.stop()


def test_a_stage_that_refused_everything_for_a_while_warms_up_again():
    """Liveness: senders whose weights moved far (a fresh or wrecked block before) are not refused for good; while
    any micro-batch passes, the window stays."""
    now = [0.0]
    s = LossScreen(1.0, window=64, warmup=16, valve_s=60.0, valve_n=16, clock=lambda: now[0])
    for _ in range(40):
        s.trained(2.0)
    for i in range(100):               # 100 refused in 50 s: not yet
        now[0] += 0.5
        assert s.refuses(9.0) is not None
    s.trained(2.1)                     # one passes: the clock starts again
    for i in range(100):
        now[0] += 0.5
        assert s.refuses(9.0) is not None
    now[0] += 11.0                      # 61 s with nothing trained, 100 refused: emptied, warming up on what comes
    assert s.refuses(9.0) is None and s.resets == 1 and s.threshold() is None
    for _ in range(16):
        s.trained(9.0)
    assert s.threshold() == pytest.approx(10.0) and s.refuses(9.5) is None
