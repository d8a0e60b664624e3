"""A large block over a slow link: the late join's and a move's download get time for its size; a cut
download's parts are freed as the next holder is asked.

Measured (tests/test_move_time.py, BENCHMARKS.md "Move time for a real block"): over a 20 Mbit/s link a
58.7 MB block took 25 s by the block RPC, and a late joiner of a 131 MB block died of hivemind's
TimeoutError after the fixed 30 s."""
from __future__ import annotations

from types import SimpleNamespace

from blocktrain.node.state_fetch import transfer_timeout

MEASURED_20MBIT_MB_S = 2.36   # the block RPC over the 20 Mbit/s namespace link


def test_a_large_blocks_download_gets_the_time_a_20_mbit_link_needs():
    assert transfer_timeout(100_000) == 30.0                      # tiny blocks: as before
    for mb in (58.74, 131.36, 500.0):
        needed = mb / MEASURED_20MBIT_MB_S
        assert transfer_timeout(int(mb * 1e6)) >= 1.5 * needed, mb   # room for a slower link


def test_a_cut_downloads_parts_are_freed_when_the_next_holder_is_asked():
    """A state stream cut mid-way raises through ``asyncio.wait_for``, whose reference cycle keeps the frames
    of the download, with the parts it delivered (up to a block's size), until the cycle collector runs.
    The fetcher lets them go as it moves on to the next holder (``drop_tracebacks``; tests/test_failure_memory.py
    measures the same cycle on real daemons)."""
    import gc

    import torch

    from blocktrain.node.state_fetch import StateFetcher
    from blocktrain.p2p.errors import StreamTruncatedError

    shape = (7, 11, 13)   # the parts delivered: a shape no other tensor here has

    class Client:
        def get_block_state_sync(self, peer, b, timeout=None):
            if peer == "cut":
                delivered = torch.zeros(shape)   # noqa: F841 (a local of the frame the cycle keeps)
                try:
                    raise StreamTruncatedError(peer, "the stream ended after 3 of 4 parts")
                except StreamTruncatedError as e:
                    err = e   # as wait_for's frame holds its future's exception: frame -> err -> traceback -> frame
                raise err
            return {"step": 3}, {"w": torch.ones(2)}

    class Objective:
        def build_block(self, b):
            return torch.nn.Module()

    alive = lambda: sum(1 for o in gc.get_objects() if torch.is_tensor(o) and tuple(o.shape) == shape)  # noqa: E731
    fetcher = StateFetcher(Client(), Objective(), self_peer="me")
    fetcher.build_checked = lambda objective, b, tensors: None   # the check is not what this test is about
    fetcher.ranking.record_success("cut", 0.01)   # asked first (strangers go in random order)
    holders = [SimpleNamespace(peer_id=p, state="online", is_live=True, step=0) for p in ("cut", "good")]
    gc.collect()
    gc.disable()
    try:
        errors: list[str] = []
        got = fetcher.fetch(0, holders, errors=errors)
        left = alive()
    finally:
        gc.enable()
    assert got is not None and got.peer == "good" and "ended after 3 of 4 parts" in errors[0], errors
    assert left == 0, "the cut stream's delivered parts are still held"


def test_a_state_stream_silent_for_the_idle_limit_is_given_up_but_a_slow_steady_one_is_not():
    """``get_block_state``'s guard (p2p/rpc_client.py): a stream that sends nothing for the idle limit, its
    first message included, is given up then, not at the download's whole timeout (a stalling Sybil holder
    cost each download its timeout: 60 s per staller for an export); a stream slower in all than the idle
    limit but never silent that long is read to its end; the overall deadline still holds."""
    import asyncio
    import time

    import pytest

    from blocktrain.p2p.rpc_client import StreamProgress, _StreamIdle, _while_streaming

    async def stream(progress, gaps):
        for g in gaps:
            await asyncio.sleep(g)
            progress.messages += 1
            progress.last = time.monotonic()
        return "done"

    async def run(gaps, deadline_s, idle_s=0.4):
        p = StreamProgress()
        return await _while_streaming(stream(p, gaps), p, time.monotonic() + deadline_s, idle_s)

    t0 = time.monotonic()
    with pytest.raises(_StreamIdle):                      # silent from the start: given up at the idle limit
        asyncio.run(run([60.0], 30.0))
    assert 0.35 < time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    with pytest.raises(_StreamIdle):                      # two messages, then silent
        asyncio.run(run([0.1, 0.1, 60.0], 30.0))
    assert 0.55 < time.monotonic() - t0 < 2.5
    assert asyncio.run(run([0.2] * 8, 30.0)) == "done"   # 1.6 s in all, never 0.4 s silent
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):             # steady, but past the overall deadline
        asyncio.run(run([0.2] * 20, 1.0))
    assert 0.95 < time.monotonic() - t0 < 2.5
