"""A failed call's tensors go as it is answered, not at the next cycle collection: a pipeline stage whose
next block fails every micro-batch, and a block service whose hop handler fails. On Python 3.11 an exception raised through ``asyncio.wait_for`` sits in a reference cycle
with the waiting frame, and its traceback holds the frames below it with their locals: the micro-batch's
activations (the engine's ``handle``, the router's ``send``, the wire's ``call``). Before ``drop_tracebacks``
each failed micro-batch left its tensors to the cycle collector, which may not run for a long while
(docs/records/s28/failed_downstream_memory.py: 291 tensors, 52.5 MiB, after 252 failures; BENCHMARKS
"Training along the chain", "Not done": a worker that failed 697 micro-batches peaked at 649 MiB).

Pipeline: the node's engine of block 1 and its ``rpc_train`` service and train loop (test_utils/pipeline_node.py),
two libp2p daemons on 127.0.0.1; the next block's only holder is a plain hivemind peer that answers
``busy`` to every micro-batch, or serves no ``rpc_train`` at all (that case held no state before the change
either: the call fails before the state reaches a frame in a cycle; it guards that path). Hops: a ``BlockService`` on a real daemon
whose handler raises, called by a ``HopClient`` that handles the refusal as the router does."""
from __future__ import annotations

import asyncio
import gc
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hivemind.p2p import P2P

from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.errors import HopRequestError, RemoteHopError, drop_tracebacks
from blocktrain.p2p.hops import HopLimits, HopRequest, decode_meta, namespace
from blocktrain.p2p.pipeline_rpc import PipelineServer, PipelineTraffic
from blocktrain.p2p.pipeline_wire import PipelineLimits, StageRequest, request_message
from blocktrain.p2p.rpc_client import HopClient
from blocktrain.p2p.rpc_server import BlockService
from blocktrain.p2p.traffic import TrafficCounter

from test_utils.configs import tiny_config
from test_utils.pipeline_node import PipelineNode, holder
from test_utils.raw_pipeline import raw_train_call

pytestmark = [pytest.mark.network, pytest.mark.timeout(180)]

RUN = "failmem"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
N, T, D = 3, 24, 40   # a shape no other test module's tensors have (a worker runs several files)
MICROBATCHES = 8


def _message(i: int) -> tuple[dict, list]:
    g = torch.Generator().manual_seed(i)
    req = StageRequest(1, torch.randn(N, T, D, generator=g) * 0.1, torch.randint(0, 256, (N, T), generator=g),
                       "backprop", "fp32", deadline_s=1.5, request_id=f"m{i}")
    meta, pbs, _, _ = request_message(req)
    return decode_meta(meta), pbs


def _states_alive() -> int:
    """Tensors of a micro-batch's state shape that exist now, garbage in cycles included (no collection runs)."""
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o) and tuple(o.shape) == (N, T, D))


def _states_left(baseline: int, settle_s: float = 5.0) -> int:
    """The states beyond ``baseline`` once threads still finishing a call (a pool thread between running a
    task and dropping it, a stream's last message) have let theirs go; with the collector off, a reference
    cycle never lets go, so waiting cannot hide one."""
    deadline = time.monotonic() + settle_s
    while (left := _states_alive() - baseline) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("next_block", ["busy", "absent"])
def test_failed_microbatches_leave_no_tensors_to_the_cycle_collector(tmp_path, next_block):
    cfg = tiny_config(objective="pipeline", n_blocks=3, d_model=D)
    loop, p2ps = LoopThread(name="bt-test-failmem"), []
    try:
        node_p2p = loop.run(P2P.create(host_maddrs=LOCAL), timeout=60)
        p2ps.append(node_p2p)
        maddrs = [str(a) for a in loop.run(node_p2p.get_visible_maddrs(), timeout=10)]
        other = loop.run(P2P.create(host_maddrs=LOCAL, initial_peers=maddrs), timeout=60)
        p2ps.append(other)
        if next_block == "busy":
            async def refuse(req):
                raise HopRequestError("busy", "always busy")
            limits = PipelineLimits(allowed_blocks={2}, n_blocks=3, mode="backprop", max_batch=64, max_seq=T,
                                    d_model=D, vocab_size=cfg.vocab_size)
            loop.run(PipelineServer(other, RUN, limits, refuse, traffic=PipelineTraffic()).add_block(2), timeout=30)
        # ``other`` sends block 1 its micro-batches (so it is listed as block 0's holder) and holds block 2
        listed = {0: [holder(str(other.peer_id))], 2: [holder(str(other.peer_id))]}
        with PipelineNode(node_p2p, loop, cfg, 1, RUN, tmp_path, holders=lambda fresh: listed) as pn:
            async def all_of_them():
                return await asyncio.gather(*(raw_train_call(other, pn.ns.peer_id, RUN, 1, *_message(i))
                                              for i in range(MICROBATCHES)))
            gc.collect()
            gc.disable()   # what the test measures is what refcounting frees
            try:
                baseline = _states_alive()
                answers = [a for a, _ in loop.run(all_of_them(), timeout=120)]
                left = _states_left(baseline)
            finally:
                gc.enable()
            assert all(a["ok"] is False and a["code"] in ("timeout", "downstream") for a in answers), answers
            st = pn.ns.pipeline.stats.snapshot()
            assert st["received"] == MICROBATCHES and st["failed_downstream"] == MICROBATCHES, st
            assert left == 0, f"{left} micro-batch states still held after {MICROBATCHES} failed downstream"
    finally:
        for p in reversed(p2ps):
            loop.run(p.shutdown(), timeout=10)
        loop.stop()


def _hop(i: int) -> HopRequest:
    g = torch.Generator().manual_seed(i)
    return HopRequest(block_index=0, state=torch.randn(N, T, D, generator=g), context=torch.randint(0, 256, (N, T),
                      generator=g, dtype=torch.uint8), sigmas=torch.tensor([1.0, 0.5]), want_logits=False)


def test_failed_hops_leave_no_tensors_to_the_cycle_collector():
    def broken(req):
        raise RuntimeError("the block failed")

    loop, p2ps, pool = LoopThread(name="bt-test-failmem-hop"), [], ThreadPoolExecutor(1)
    try:
        server = loop.run(P2P.create(host_maddrs=LOCAL), timeout=60)
        p2ps.append(server)
        maddrs = [str(a) for a in loop.run(server.get_visible_maddrs(), timeout=10)]
        caller = loop.run(P2P.create(host_maddrs=LOCAL, initial_peers=maddrs), timeout=60)
        p2ps.append(caller)
        svc = BlockService(0, HopLimits({0}, max_batch=8, max_seq=T, state_dim=D, vocab_size=256), broken, None,
                           traffic=TrafficCounter(), executor=pool)
        loop.run(svc.add_p2p_handlers(server, namespace=namespace(RUN, 0)), timeout=30)
        client, codes = HopClient(caller, RUN, loop=loop, default_timeout=20), []
        gc.collect()
        gc.disable()
        try:
            baseline = _states_alive()
            for i in range(MICROBATCHES):
                try:
                    client.forward_sync(str(server.peer_id), _hop(i))
                except RemoteHopError as e:   # as the router handles a holder's failure
                    codes.append(e.code)
                    drop_tracebacks(e)
            left = _states_left(baseline)
        finally:
            gc.enable()
        assert codes == ["internal"] * MICROBATCHES, codes
        assert left == 0, f"{left} hop states still held after {MICROBATCHES} failed hops"
    finally:
        for p in reversed(p2ps):
            loop.run(p.shutdown(), timeout=10)
        loop.stop()
        pool.shutdown()
