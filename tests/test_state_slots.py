"""Block-state downloads a caller leaves unread (``p2p/rpc_server.py`` ``StateSlots``).

Each state answer holds a copy of its block until it is read. Before the limit, an outsider that asked
for the state 40 times and read only each answer's first message grew a seeded node (d_model 512, 2
layers: a 25 MB block) from 359 to 1,726 MiB (``docs/records/s33/state_stream_probe.py``); a few hundred
would kill any node. Now a server streams at most ``max_state_streams`` answers at once (2), refuses
the next ``busy`` before copying anything, and cuts an answer not read within its deadline, which
frees its slot for an honest downloader.

Two libp2p daemons on 127.0.0.1: a real ``BlockRPCServer``, and a plain hivemind caller using the
service's stub (the outsider), then our ``HopClient`` (an honest late joiner).
"""
from __future__ import annotations

import time

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from blocktrain.p2p import rpc_server
from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.hops import WIRE_VERSION, HopLimits, decode_meta, encode_meta, namespace
from blocktrain.p2p.rpc_client import HopClient
from blocktrain.p2p.rpc_server import BlockRPCServer, BlockService

pytestmark = [pytest.mark.network, pytest.mark.timeout(180)]

RUN = "stateslots"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
STATE = {"w": torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024), "b": torch.ones(7)}   # 4 MiB


def _no_hop(req):
    raise AssertionError("no hop in this test")


def test_unread_state_answers_are_bounded_and_cut(monkeypatch):
    monkeypatch.setattr(rpc_server, "STATE_STREAM_MIN_S", 3.0)   # the deadline of a 4 MiB answer: 3 s
    monkeypatch.setattr(rpc_server, "STATE_STREAM_MIN_RATE_B_S", 1e12)
    loop, p2ps = LoopThread(name="bt-test-stateslots"), []
    try:
        holder = loop.run(P2P.create(host_maddrs=LOCAL), timeout=60)
        p2ps.append(holder)
        maddrs = [str(a) for a in loop.run(holder.get_visible_maddrs(), timeout=10)]
        outsider = loop.run(P2P.create(host_maddrs=LOCAL, initial_peers=maddrs), timeout=60)
        p2ps.append(outsider)
        limits = HopLimits({0}, max_batch=8, max_seq=16, state_dim=8, vocab_size=256)
        assert limits.max_state_streams == 2
        server = BlockRPCServer(holder, RUN, limits, _no_hop, lambda b: ({"step": 5}, dict(STATE)))
        loop.run(server.add_block(0), timeout=30)
        stub = BlockService.get_stub(outsider, PeerID.from_base58(str(holder.peer_id)), namespace=namespace(RUN, 0))
        meta = encode_meta({"v": WIRE_VERSION, "request_id": "x", "block_index": 0})

        async def ask_and_stall():
            stream = await stub.rpc_state(runtime_pb2.ExpertRequest(metadata=meta))
            first = await stream.__anext__()
            return stream, decode_meta(first.metadata)

        held = [loop.run(ask_and_stall(), timeout=30) for _ in range(4)]
        answers = [m.get("code", "ok") for _, m in held]
        assert answers == ["ok", "ok", "busy", "busy"], answers
        assert "its limit" in held[2][1]["reason"]
        assert server.state_slots.active == 2 and server.state_slots.refused == 2

        # the two unread answers are cut at their deadline, and an honest downloader gets the whole state
        t0 = time.monotonic()
        while server.state_slots.active and time.monotonic() - t0 < 20:
            time.sleep(0.2)
        assert server.state_slots.active == 0 and server.state_slots.cut == 2, vars(server.state_slots)
        client = HopClient(outsider, RUN, loop=loop, default_timeout=30)
        got_meta, got = client.get_block_state_sync(str(holder.peer_id), 0)
        assert got_meta["step"] == 5 and set(got) == set(STATE) and all(torch.equal(got[k], STATE[k]) for k in STATE)
        assert server.state_slots.active == 0   # a completed answer gives its slot back

        async def close_all():
            for stream, _ in held:
                await stream.aclose()
        loop.run(close_all(), timeout=30)
    finally:
        for p in reversed(p2ps):
            loop.run(p.shutdown(), timeout=10)
        loop.stop()
