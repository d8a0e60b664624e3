"""The node's loop helpers: the training duty cycle (``--train-duty``)."""
from __future__ import annotations

import threading
import time

import pytest

from blocktrain.node.loops import DutyCycle


def test_pause_brings_busy_time_to_the_fraction():
    d = DutyCycle(0.25)
    assert d.pause(1.0) == pytest.approx(3.0)          # busy 1 s of every 4
    assert d.paused_s == pytest.approx(3.0)
    assert DutyCycle(1.0).pause(5.0) == 0.0 and DutyCycle(0.5).pause(0.0) == 0.0


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_a_fraction_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="--train-duty"):
        DutyCycle(bad)


def _iterations(fraction: float, seconds: float = 1.0, work_s: float = 0.05) -> int:
    """How many ``work_s``-long units of work a paced loop gets through in ``seconds`` (sleeping work:
    the count does not depend on how loaded the machine is)."""
    d, stop, n = DutyCycle(fraction), threading.Event(), 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        d.paced(lambda: time.sleep(work_s), stop)
        n += 1
    return n


def test_paced_work_keeps_to_its_share_of_wall_time():
    full, quarter = _iterations(1.0), _iterations(0.25)
    assert full >= 12, full          # ~20 units of 50 ms in a second
    assert quarter <= 7, quarter     # ~5: each unit followed by 150 ms idle


def test_stop_cuts_the_idle_time_short():
    d, stop = DutyCycle(0.01), threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    d.paced(lambda: time.sleep(0.1), stop)   # would idle 9.9 s
    assert time.monotonic() - t0 < 3.0
