"""A large block over a slow link: the late join's and a move's download get time for its size, and an
averager download that runs out of time is no answer (the block RPC is tried), not a crash.

Measured (tests/test_move_time.py, BENCHMARKS.md "Move time for a real block"): over a 20 Mbit/s link a
58.7 MB block took 25 s by the block RPC, and a late joiner of a 131 MB block died of hivemind's
TimeoutError after the fixed 30 s."""
from __future__ import annotations

from types import SimpleNamespace

from blocktrain.node.state_fetch import transfer_timeout
from blocktrain.p2p.averager import BlockAveragerHandle

MEASURED_20MBIT_MB_S = 2.36   # the block RPC over the 20 Mbit/s namespace link


def test_a_large_blocks_download_gets_the_time_a_20_mbit_link_needs():
    assert transfer_timeout(100_000) == 30.0                      # tiny blocks: as before
    for mb in (58.74, 131.36, 500.0):
        needed = mb / MEASURED_20MBIT_MB_S
        assert transfer_timeout(int(mb * 1e6)) >= 1.5 * needed, mb   # room for a slower link


def test_an_averager_download_that_runs_out_of_time_is_no_answer():
    def times_out(timeout=None):
        raise TimeoutError()

    h = BlockAveragerHandle.__new__(BlockAveragerHandle)   # no process: only download_state's own handling
    h.averager = SimpleNamespace(load_state_from_peers=times_out)
    assert h.download_state(timeout=0.1) is None
