"""A round is bounded even when the averager's tensors stay locked: hivemind's all-reduce holds
that lock while it runs, and without an all-reduce timeout a round with a member that stopped
answering held it for good (a CI run saw every later ``/v1/average`` of a survivor hang). The node
passes ``allreduce_timeout`` to hivemind and waits for the lock a bounded time only."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from blocktrain.node.averaging.rounds import BlockAverager
from blocktrain.node.trainer import BlockTrainer

from test_utils.configs import tiny_config

pytestmark = [pytest.mark.reliability, pytest.mark.network]

DATA = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)


def test_a_round_gives_up_on_a_held_tensor_lock_in_bounded_time():
    from blocktrain.p2p.discovery import Discovery

    disc = Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=["bounds"])
    try:
        avg = BlockAverager(disc.dht, BlockTrainer(tiny_config(), 0, DATA, DATA), "bounds",
                            peer_id=disc.peer_id, matchmaking_time=1.0, allreduce_timeout=2.0)
        try:
            assert avg.handle.averager._allreduce_timeout == 2.0    # hivemind itself ends a stuck all-reduce
            lock = avg.handle.averager.lock_averaged_tensors
            assert lock.acquire(timeout=5)                   # as an all-reduce that never ends would
            out: dict = {}
            th = threading.Thread(target=lambda: out.update(v=avg.round()), daemon=True)
            t0 = time.monotonic()
            th.start()
            th.join(30)
            waited = time.monotonic() - t0
            lock.release()
            assert not th.is_alive(), "the round blocked on the averaged tensors' lock"
            assert out["v"] is None and "busy with an earlier all-reduce" in avg.stats.last_failure
            assert 6.5 <= waited < 15, waited            # the bound: allreduce_timeout + 5 s
            assert avg.stats.failed == 1
        finally:
            avg.shutdown()
    finally:
        disc.shutdown(withdraw=False)


@pytest.mark.parametrize("layout", ["thread", "process"])
def test_two_averagers_in_one_process_complete_a_round(layout, monkeypatch):
    """Both ends of a round in one process, in either layout of hivemind's loops. As threads (the
    default) the averager's control pipe passes hivemind's StepControl by reference, so the host and
    the loop both attach the same trigger to the same object; that must be one round, not an
    assertion."""
    from blocktrain.p2p.discovery import Discovery

    monkeypatch.setenv("BT_HIVEMIND_IN", layout)

    first = Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=["pair"])
    discs = [first]
    avgs: list = []
    try:
        discs.append(Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=["pair"],
                                     initial_peers=[str(a) for a in first.dht.get_visible_maddrs()]))
        assert all(getattr(d.dht, "bt_in_thread", False) == (layout == "thread") for d in discs)
        for d in discs:
            avgs.append(BlockAverager(d.dht, BlockTrainer(tiny_config(), 0, DATA, DATA), "pair",
                                      peer_id=d.peer_id, matchmaking_time=2.0))
        out: dict = {}
        ths = [threading.Thread(target=lambda k=k: out.update({k: avgs[k].round()}), daemon=True) for k in (0, 1)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(60)
        assert not any(th.is_alive() for th in ths), "a round did not end"
        failures = [a.stats.last_failure for a in avgs]
        assert all(out.get(k) is not None and out[k].accepted for k in (0, 1)), (out, failures)
        assert [a.stats.succeeded for a in avgs] == [1, 1]
    finally:
        for a in avgs:
            a.shutdown()
        for d in discs:
            d.shutdown(withdraw=False)
