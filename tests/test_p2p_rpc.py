"""Block RPC against a real server process on 127.0.0.1 (its own p2pd), client in this process.

The server (``tests/test_utils/wire_node.py --serve-rpc``) computes ``state * 0.5 + sigma`` and
one-hot logits, so every answer can be checked exactly.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto import runtime_pb2

from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.errors import HopTimeoutError, RemoteHopError, StreamTruncatedError
from blocktrain.p2p.hops import WIRE_VERSION, HopRequest, decode_meta, encode_meta, namespace
from blocktrain.p2p.rpc_client import HopClient
from blocktrain.p2p.rpc_server import BlockService
from blocktrain.p2p.tensors import encode_tensor
from test_utils.wire_procs import NodeProc, group_alive, stop_all

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

RUN = "rpc-test"
D = 64
MAX_REQUEST = 8 << 20
STATE_FLOATS = 1_500_000  # 6 MB of block state: more than hivemind's 4 MiB unary cap


@pytest.fixture(scope="module")
def rpc(tmp_path_factory):
    logs = tmp_path_factory.mktemp("rpc-logs")
    server = NodeProc("server", [
        "--run-id", RUN, "--serve-rpc", "--blocks", "0", "--dim", str(D), "--max-batch", "32",
        "--max-seq", "2048", "--max-request-bytes", str(MAX_REQUEST), "--state-floats", str(STATE_FLOATS),
    ], logs)
    loop = p2p = None
    try:
        server.wait_ready()
        loop = LoopThread()
        p2p = loop.run(P2P.create(initial_peers=server.maddrs))
        client = HopClient(p2p, RUN, loop=loop, default_timeout=20)
        yield server, client
    finally:
        if p2p is not None:
            loop.run(p2p.shutdown(), timeout=10)
        if loop is not None:
            loop.stop()
        stop_all([server])
        assert not group_alive(server.proc.pid), "server processes survived teardown"


def hop(n=1, t=256, d=D, block=0, dtype=torch.float32, ctx_dtype=torch.uint8, sigma=2.0, want_logits=False):
    g = torch.Generator().manual_seed(n * 1000 + t)
    return HopRequest(
        block_index=block, state=torch.randn(n, t, d, generator=g).to(dtype),
        context=torch.randint(0, 256, (n, t), generator=g).to(ctx_dtype),
        sigmas=torch.tensor([sigma, sigma / 2]), want_logits=want_logits,
    )


def assert_good_answer(client: HopClient, server: NodeProc) -> None:
    req = hop(sigma=3.0)
    resp = client.forward_sync(server.peer_id, req)
    torch.testing.assert_close(resp.state, req.state * 0.5 + 3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_small_state(rpc, dtype):
    server, client = rpc
    req = hop(dtype=dtype, want_logits=True)
    resp = client.forward_sync(server.peer_id, req)
    assert resp.extra["transport"] == "unary"
    assert resp.state.shape == (1, 256, D) and resp.state.dtype == dtype
    torch.testing.assert_close(resp.state, (req.state.float() * 0.5 + 2.0).to(dtype))
    assert resp.logits is not None and resp.logits.shape == (1, 256, 256)
    assert torch.equal(resp.logits.argmax(-1), req.context.long())


def test_payload_above_4mib_is_streamed(rpc):
    server, client = rpc
    before = server.cmd("traffic")
    req = hop(n=20, t=1024)  # 5.2 MB of state each way
    assert req.payload_bytes > 4 * 2**20
    resp = client.forward_sync(server.peer_id, req)
    assert resp.extra["transport"] == "stream"
    torch.testing.assert_close(resp.state, req.state * 0.5 + 2.0)
    after = server.cmd("traffic")
    assert after["bytes_received"] - before["bytes_received"] >= req.payload_bytes
    assert after["bytes_sent"] - before["bytes_sent"] >= req.state.numel() * 4


def test_block_state_download_is_streamed(rpc):
    server, client = rpc
    meta, tensors = client.get_block_state_sync(server.peer_id, 0)
    assert meta == {"block": 0, "step": 7}
    assert set(tensors) == {"weight", "bias"}
    assert torch.equal(tensors["weight"], torch.arange(STATE_FLOATS, dtype=torch.float32))
    with pytest.raises(RemoteHopError) as e:
        client.get_block_state_sync(server.peer_id, 0, max_bytes=1 << 20)
    assert e.value.code == "bad_response" and "limit" in e.value.reason


# -- hostile / broken requests ----------------------------------------------------------------------
def _raw(client: HopClient, server: NodeProc, msg: runtime_pb2.ExpertRequest, ns_block: int = 0) -> dict:
    """Send a hand-made request through the public stub and return the decoded answer metadata."""
    stub = BlockService.get_stub(client.p2p, PeerID.from_base58(server.peer_id), namespace=namespace(RUN, ns_block))
    resp = client.loop.run(stub.rpc_forward(msg, timeout=10))
    return decode_meta(resp.metadata)


def _good_meta(block: int = 0) -> bytes:
    return encode_meta({"v": WIRE_VERSION, "request_id": "x", "block_index": block, "want_logits": False})


def _pbs(req: HopRequest) -> list[runtime_pb2.Tensor]:
    return [encode_tensor(req.state), encode_tensor(req.context), encode_tensor(req.sigmas)]


def truncated_state(client, server) -> dict:
    pbs = _pbs(hop())
    pbs[0].buffer = pbs[0].buffer[:-10]
    return _raw(client, server, runtime_pb2.ExpertRequest(metadata=_good_meta(), tensors=pbs))


def metadata_not_json(client, server) -> dict:
    return _raw(client, server, runtime_pb2.ExpertRequest(metadata=b"\x93\xff{not json", tensors=_pbs(hop())))


def block_mismatch(client, server) -> dict:
    return _raw(client, server, runtime_pb2.ExpertRequest(metadata=_good_meta(block=1), tensors=_pbs(hop())))


def via_client(req: HopRequest, timeout: float = 20) -> Callable[[HopClient, NodeProc], dict]:
    def call(client: HopClient, server: NodeProc) -> dict:
        with pytest.raises(RemoteHopError) as e:
            client.forward_sync(server.peer_id, req, timeout=timeout)
        assert e.value.peer_id == server.peer_id
        return {"code": e.value.code, "reason": e.value.reason}
    return call


def _with(req: HopRequest, **changes) -> HopRequest:
    for k, v in changes.items():
        setattr(req, k, v)
    return req


BAD_CASES = {
    "malformed tensor bytes": (truncated_state, "malformed", "carries"),
    "malformed metadata": (metadata_not_json, "malformed", "not JSON"),
    "state dtype int32": (via_client(hop(dtype=torch.int32)), "bad_dtype", "state has dtype 'int32'"),
    "context dtype float": (via_client(_with(hop(), context=torch.zeros(1, 256))), "bad_dtype", "context"),
    "state dim 65": (via_client(hop(d=65)), "bad_shape", "D=65"),
    "state 2-d": (via_client(_with(hop(), state=torch.zeros(256, D))), "bad_shape", "(N, T, D)"),
    "context shape": (via_client(_with(hop(), context=torch.zeros(1, 255, dtype=torch.uint8))), "bad_shape", "context"),
    "sigmas shape": (via_client(_with(hop(), sigmas=torch.ones(3))), "bad_shape", "sigmas"),
    "batch 33": (via_client(hop(n=33, t=8)), "bad_shape", "N=33"),
    "unknown block": (via_client(hop(block=5)), "unknown_block", "does not serve block 5"),
    "block mismatch": (block_mismatch, "unknown_block", "not block 1"),
    # refused on the declared size in the first header, not after receiving 16 MiB
    "oversize request": (via_client(hop(n=32, t=2048), timeout=60), "too_large",
                         "request declares 16777216 bytes, limit is 8388608"),
    "token id out of range": (via_client(_with(hop(ctx_dtype=torch.int64), context=torch.full((1, 256), 300))),
                              "bad_value", "context ids"),
    "nan sigma": (via_client(_with(hop(), sigmas=torch.tensor([float("nan"), 1.0]))), "bad_value", "sigmas"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_request_gets_clear_error_and_server_keeps_serving(rpc, case):
    server, client = rpc
    call, code, fragment = BAD_CASES[case]
    answer = call(client, server)
    assert answer["code"] == code, answer
    assert fragment in answer["reason"], answer
    assert_good_answer(client, server)


def test_garbage_bytes_get_an_error_and_server_keeps_serving(rpc):
    server, client = rpc
    handle = f"{namespace(RUN, 0)}::BlockService.rpc_forward"

    async def send_garbage() -> bytes:
        # below the protobuf layer on purpose: bytes that are not an ExpertRequest at all
        return await client.p2p._client.call_unary_handler(PeerID.from_base58(server.peer_id), handle, b"\xff\x00junk")

    with pytest.raises(P2PHandlerError, match="(?i)pars"):
        client.loop.run(asyncio.wait_for(send_garbage(), 10))
    assert_good_answer(client, server)


def test_slow_peer_times_out_and_server_recovers(rpc):
    server, client = rpc
    slow = hop(sigma=1003.0)  # the test server sleeps sigma - 1000 = 3 s
    t0 = time.monotonic()
    with pytest.raises(HopTimeoutError, match="did not answer the hop of block 0 within 0.5s"):
        client.forward_sync(server.peer_id, slow, timeout=0.5)
    assert time.monotonic() - t0 < 2.5  # gave up long before the peer would have answered
    assert_good_answer(client, server)  # the server still serves while its slow hop runs


# -- a stream cut under the client (the connection between the daemons drops) -----------------------
PAUSE = 1.5   # the test server sends each state tensor this long after the previous message


def _state_call_cut_after_metadata(client: HopClient, server: NodeProc, **kw):
    """Start a state download from the paced server, and once its first message (the metadata) is
    in, drop the connection between the two daemons, as yamux does when a peer's daemon misses its
    keepalive: the download's concurrent Future."""
    before = client.traffic.snapshot().bytes_received
    fut = client.loop.submit(client.get_block_state(server.peer_id, 0, **kw))
    deadline = time.monotonic() + 30
    while client.traffic.snapshot().bytes_received == before:
        assert time.monotonic() < deadline and not fut.done(), "the metadata never arrived"
        time.sleep(0.01)
    client.loop.run(client.p2p._client.disconnect(PeerID.from_base58(server.peer_id)), timeout=10)
    return fut


def test_a_state_stream_cut_mid_way_is_a_typed_truncation_then_read_again(rpc):
    server, client = rpc
    server.cmd("state_pause", seconds=PAUSE)
    try:
        t0 = time.monotonic()
        fut = _state_call_cut_after_metadata(client, server, timeout=60, attempts=1)
        with pytest.raises(StreamTruncatedError) as e:
            fut.result(timeout=60)
        assert e.value.code == "truncated" and e.value.peer_id == server.peer_id
        assert "of 2 tensor(s)" in e.value.reason and "no timeout" in e.value.reason, e.value.reason
        assert time.monotonic() - t0 < 30   # told at once, not at the 60 s timeout
        # the product's default: a truncated download is asked for again, within the same timeout
        meta, tensors = _state_call_cut_after_metadata(client, server, timeout=60).result(timeout=60)
        assert meta == {"block": 0, "step": 7}
        assert torch.equal(tensors["weight"], torch.arange(STATE_FLOATS, dtype=torch.float32))
        # a slow stream that runs out of time is a timeout, and says how far it got
        with pytest.raises(HopTimeoutError, match=r"within 2.0s \(this stream delivered \d+ (of 2 )?tensor"):
            client.get_block_state_sync(server.peer_id, 0, timeout=2.0)
    finally:
        server.cmd("state_pause", seconds=0)
    assert set(client.get_block_state_sync(server.peer_id, 0)[1]) == {"weight", "bias"}
