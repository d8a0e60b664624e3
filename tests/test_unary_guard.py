"""hivemind's unary calls survive a call cancelled in the very loop iteration its answer is read
(p2p/unary_guard.py). Two real libp2p daemons on 127.0.0.1, each P2P instance on its own event loop
(thread), so the server answers while the caller's loop is held up.

The race, made deterministic: the caller starts a call, holds its loop for 0.3 s (the answer arrives
at its socket meanwhile), and a timer due during that hold cancels the call. When the loop runs
again it reads the socket before it runs the due timer, and the reader's step (which sets the
result) runs before the cancelled call's own step (which would have removed the call). Unguarded,
hivemind 1.1.12's reader then dies of ``InvalidStateError`` and every later unary call on that P2P
instance goes unanswered: this test then fails at its first follow-up call.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

import blocktrain.p2p  # noqa: F401  (installs the guard, as every blocktrain process does)
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.proto import runtime_pb2

from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.unary_guard import PendingCalls

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
ROUNDS = 10


@contextlib.contextmanager
def server_and_client(name: str, handler, server_loop: LoopThread, client_loop: LoopThread):
    """A P2P instance serving ``handler`` as unary protobuf handler ``name`` on ``server_loop``, and a caller
    on ``client_loop`` (the same loop or another); both shut down, and the loops stopped, on exit."""
    server = client = None
    try:
        server = server_loop.run(P2P.create(host_maddrs=LOCAL), timeout=60)
        server_loop.run(server.add_protobuf_handler(name, handler, runtime_pb2.ExpertRequest), timeout=10)
        maddrs = server_loop.run(server.get_visible_maddrs(), timeout=10)
        client = client_loop.run(P2P.create(host_maddrs=LOCAL, initial_peers=maddrs), timeout=60)
        yield server, client
    finally:
        if client is not None:
            client_loop.run(client.shutdown(), timeout=10)
        if server is not None:
            server_loop.run(server.shutdown(), timeout=10)
        client_loop.stop()
        server_loop.stop()


def test_a_unary_call_cancelled_as_its_answer_arrives_leaves_the_p2p_instance_working():
    assert getattr(ControlClient, "_bt_unary_guard", False)
    server_loop, client_loop = LoopThread(name="bt-test-server"), LoopThread(name="bt-test-client")
    served = []

    async def echo(req: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
        served.append(req.metadata)
        return runtime_pb2.ExpertResponse(metadata=req.metadata)

    with server_and_client("echo", echo, server_loop, client_loop) as (server, client):
        assert isinstance(client._client.control._pending_calls, PendingCalls)

        def call(tag: bytes):
            return client.call_protobuf_handler(server.peer_id, "echo", runtime_pb2.ExpertRequest(metadata=tag),
                                                runtime_pb2.ExpertResponse)

        async def race(i: int) -> tuple[str, bytes]:
            loop = asyncio.get_running_loop()
            task = asyncio.create_task(call(b"raced %d" % i))
            for _ in range(2):
                await asyncio.sleep(0)            # the request is written to the daemon
            loop.call_at(loop.time() + 0.05, task.cancel)
            loop.call_soon(time.sleep, 0.3)       # hold the loop while the answer arrives
            try:
                await task
                outcome = "answered"
            except asyncio.CancelledError:
                outcome = "cancelled"
            follow = await asyncio.wait_for(call(b"after %d" % i), 10)   # unguarded: no answer, ever
            return outcome, follow.metadata

        outcomes = []
        for i in range(ROUNDS):
            outcome, echoed = client_loop.run(race(i), timeout=30)
            assert echoed == b"after %d" % i
            outcomes.append(outcome)
        # the race was really run: the server answered the raced calls and the callers had given them up
        assert outcomes.count("cancelled") >= ROUNDS // 2, outcomes
        assert sum(m.startswith(b"raced") for m in served) >= outcomes.count("cancelled")
        assert len(client._client.control._pending_calls) == 0   # nothing left behind


def test_a_request_its_caller_gave_up_on_leaves_no_task_behind_on_the_server():
    """Unguarded, a unary request cancelled by its caller stays in the server's ``_handler_tasks`` for
    good, holding the request (its traceback's frames) for the life of the node."""
    loop = LoopThread(name="bt-test-leak")
    started = []

    async def slow(req: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
        started.append(len(req.metadata))
        await asyncio.sleep(30)
        return runtime_pb2.ExpertResponse()

    with server_and_client("slow", slow, loop, loop) as (server, client):
        tasks = server._client.control._handler_tasks

        async def give_up() -> None:
            try:
                await asyncio.wait_for(client.call_protobuf_handler(
                    server.peer_id, "slow", runtime_pb2.ExpertRequest(metadata=b"x" * 100_000),
                    runtime_pb2.ExpertResponse), 0.5)
            except asyncio.TimeoutError:
                return
            raise AssertionError("the slow handler answered")

        for _ in range(4):
            loop.run(give_up(), timeout=30)
        deadline = time.monotonic() + 10
        while (len(started) < 4 or tasks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(started) == 4   # every request reached the handler and was then cancelled
        assert len(tasks) == 0, f"{len(tasks)} cancelled request(s) left in _handler_tasks"
