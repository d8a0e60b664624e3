"""--average-clock: replicas whose steps never line up still average. Two real nodes hold block 2 of 4
and train with step-triggered rounds out of reach (--average-every 1000000) and idle rounds off: the
only thing that can start a round is the wall clock's instants of their block, where both look for a
group at once. With --average-clock 0 neither would ever average (rounds_ok 0); a node's default is
60 s. The schedule itself (each block's instant, a move re-targeting it) is unit-tested here too."""
from __future__ import annotations

import time

import pytest

from blocktrain.node.averaging.clock import AverageClock, clock_offset, next_clock_slot
from blocktrain.node.options import NodeOptions
from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.node.swarm.run import SWARM_DEFAULTS

from test_utils.configs import TEST_CORPUS


def test_next_clock_slot_is_the_next_multiple():
    assert next_clock_slot(100.0, 30.0) == 120.0
    assert next_clock_slot(119.99, 30.0) == 120.0
    assert next_clock_slot(120.0, 30.0) == 150.0       # strictly after now: a slot is never taken twice
    assert next_clock_slot(1_764_700_000.5, 7.5) % 7.5 == 0
    assert next_clock_slot(100.0, 60.0, offset=15.0) == 135.0
    assert next_clock_slot(135.0, 60.0, offset=15.0) == 195.0
    assert next_clock_slot(134.9, 60.0, offset=15.0) == 135.0


def test_each_block_has_its_own_instant_in_the_period():
    offsets = [clock_offset(60.0, b, 4) for b in range(4)]
    assert offsets == [0.0, 15.0, 30.0, 45.0]             # replicas of a block share one; blocks spread out
    assert all(0 <= o < 60.0 for o in offsets)


class _Wall:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_clock_is_due_once_at_each_instant_of_its_block():
    wall, block = _Wall(1000.0), [1]
    clock = AverageClock(60.0, 4, lambda: block[0], now=wall)
    assert clock.slot == 1035.0                          # block 1 of 4: 15 s past each minute
    due = []
    for t in range(1000, 1200):
        wall.t = float(t)
        if clock.due():
            due.append(t)
    assert due == [1035, 1095, 1155]


def test_a_move_retargets_the_next_instant_to_the_new_block_at_once():
    """Without the re-target, the first clocked round after a rebalancing move would run at the old
    block's instant, where none of the new block's holders look for a group."""
    wall, block = _Wall(1000.0), [1]
    clock = AverageClock(60.0, 4, lambda: block[0], now=wall)
    wall.t = 1010.0
    block[0] = 3                                         # moved to block 3: 45 s past each minute
    assert not clock.due() and clock.slot == 1065.0
    due = []
    for t in range(1011, 1120):
        wall.t = float(t)
        if clock.due():
            due.append(t)
    assert due == [1065]                                 # not block 1's 1035 first


def test_a_clock_of_zero_is_never_due():
    wall = _Wall(0.0)
    clock = AverageClock(0.0, 4, lambda: 2, now=wall)
    for t in (0.0, 60.0, 1e9):
        wall.t = t
        assert not clock.due()


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_bad_average_clock_is_refused(bad, tmp_path):
    with pytest.raises(ValueError, match="--average-clock"):
        NodeOptions(checkpoint_dir=tmp_path, run_id="r", average_clock=bad)


def _two_holders_meet(tmp_path, run_id: str, block: int, period: float) -> list[dict]:
    """Start two real nodes holding ``block`` whose only round trigger is the wall clock (step-triggered
    rounds out of reach, idle rounds off); wait until both accepted a round; their /v1/status."""
    args = ["--average-every", "1000000", "--average-period", "1e9", "--average-clock", str(period),
            "--device", "cpu", "--train-duty", "0.3"]
    sw = LocalSwarm(tmp_path / "sw", run_id=run_id, overrides=SWARM_DEFAULTS, data=str(TEST_CORPUS),
                    extra_args=args)
    try:
        sw.start_seed(block=block)
        sw.start_join(block=block)
        deadline = time.monotonic() + 90
        st = []
        while time.monotonic() < deadline:
            st = [n.get("/v1/status") for n in sw.nodes]
            if all(s["averaging"]["succeeded"] >= 1 for s in st):
                break
            time.sleep(1)
        assert all(s["averaging"]["succeeded"] >= 1 for s in st), [s["averaging"] for s in st]
        assert [s["self"]["block"] for s in st] == [block, block]
        return st
    finally:
        sw.stop_all()


@pytest.mark.network
def test_replicas_whose_steps_never_trigger_a_round_meet_at_their_blocks_instant(tmp_path):
    """Two holders of block 2 of 4 with an 8-second clock average although no step triggers a round,
    and they look for a group at second 4 of each period (clock_offset), not at block 0's second 0: the
    first round each begins starts at its block's instant (within the averaging thread's 0.5 s poll plus
    a loaded machine's scheduling)."""
    period, block = 8.0, 2
    offset = clock_offset(period, block, 4)
    assert offset == 4.0
    for s in _two_holders_meet(tmp_path, "clock", block=block, period=period):
        assert 0 < s["self"]["step"] < 1_000_000           # training, no step-triggered round
        # the first round each node began cannot have been delayed by an earlier round overrunning
        first = s["averaging"]["round_started"][0]
        assert offset <= first % period < offset + 2.0, (first % period, s["averaging"]["round_started"])
