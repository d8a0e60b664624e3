"""p2p/inprocess.py: the in-process stand-in for hivemind's control pipe, and the layout switch.

The DHT and averager loops themselves are exercised in threads by every test that starts a
Discovery or a node (the default layout); tests/test_bench_resources.py checks that a node then
has no forked hivemind child and no torch_shm_manager.
"""
from __future__ import annotations

import asyncio
import os
import select
import threading
import time

import pytest

from blocktrain.p2p.inprocess import HIVEMIND_IN_ENV, hivemind_in, local_pipe


def test_local_pipe_passes_the_same_objects_in_order_both_ways():
    a, b = local_pipe()
    first, second = {"future": object()}, ["x"]
    a.send(first)
    a.send(second)
    assert b.poll() and not a.poll()
    assert b.recv() is first and b.recv() is second   # by reference: no pickling, no copies
    assert not b.poll()
    b.send(3)
    assert a.recv() == 3


def test_local_pipe_wakes_an_event_loop_reader_like_a_connection():
    a, b = local_pipe()
    got = []

    async def main():
        loop = asyncio.get_running_loop()
        woke = asyncio.Event()
        loop.add_reader(b.fileno(), woke.set)
        threading.Timer(0.2, a.send, args=[("_get", [], {"k": 1})]).start()
        await asyncio.wait_for(woke.wait(), 5)
        loop.remove_reader(b.fileno())
        got.append(b.recv())

    asyncio.run(main())
    assert got == [("_get", [], {"k": 1})]


def test_local_pipe_blocking_recv_ends_with_eof_when_the_other_end_closes():
    a, b = local_pipe()
    out = []
    t = threading.Thread(target=lambda: out.append(pytest.raises(EOFError, b.recv)))
    t.start()
    time.sleep(0.2)
    a.close()
    t.join(5)
    assert not t.is_alive() and out
    with pytest.raises(OSError):
        a.send(1)
    with pytest.raises(BrokenPipeError):
        b.send(1)


def test_layout_switch_refuses_unknown_values(monkeypatch):
    monkeypatch.delenv(HIVEMIND_IN_ENV, raising=False)
    assert hivemind_in() == "thread"
    monkeypatch.setenv(HIVEMIND_IN_ENV, "process")
    assert hivemind_in() == "process"
    monkeypatch.setenv(HIVEMIND_IN_ENV, "forked")
    with pytest.raises(ValueError, match="BT_HIVEMIND_IN must be one of thread, process"):
        hivemind_in()


def test_local_pipe_never_reads_an_empty_fd_when_an_event_loop_made_it_non_blocking():
    a, b = local_pipe()
    os.set_blocking(b.fileno(), False)   # what an event loop's add_reader does to the fd
    n = 2000
    t = threading.Thread(target=lambda: [a.send(i) for i in range(n)])
    t.start()
    got = []
    while len(got) < n:
        if b.poll(1.0):
            got.append(b.recv())
    t.join(5)
    assert got == list(range(n))
    assert not select.select([b.fileno()], [], [], 0)[0]   # every wake-up byte consumed with its message
