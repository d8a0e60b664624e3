"""Client side of the block RPC: forward hops and block-state downloads, with timeouts and typed errors.

Small calls go unary; a call whose request or expected answer exceeds ``unary_limit`` (~2 MB,
hivemind's unary cap is 4 MiB) is streamed in ``chunk_bytes`` parts. Every failure surfaces as
:class:`RemoteHopError` (the peer refused or broke; ``.code`` says why), :class:`HopTimeoutError`
(no answer in time) or :class:`HopRequestError` (the request itself is unsendable).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.errors import HopRequestError, HopTimeoutError, RemoteHopError, StreamTruncatedError, drop_tracebacks
from blocktrain.p2p.hops import (
    STATE_DTYPES, WIRE_VERSION, HopRequest, HopResponse, decode_meta, encode_meta, estimate_request_bytes,
    estimate_response_bytes, namespace,
)
from blocktrain.p2p.records import validate_run_id
from blocktrain.p2p.rpc_server import INFO_NAMESPACE, UNARY_LIMIT_BYTES, BlockService, InfoService
from blocktrain.p2p.tensors import DEFAULT_CHUNK_BYTES, TensorAssembler, decode_tensor, encode_tensor, split_parts
from blocktrain.p2p.traffic import TrafficCounter

__all__ = ["HopClient", "StreamProgress", "get_node_info", "read_answer"]

logger = logging.getLogger(__name__)

# why a stream can end short without an error (p2p/errors.py StreamTruncatedError says more)
CUT_CAUSE = ("no error and no timeout: the stream was closed or reset under it (the connection between "
             "the two daemons dropped, e.g. one starved past yamux's 10 s keepalive on a loaded machine, "
             "or the peer went away)")


def _peer(peer_id: str | PeerID) -> PeerID:
    return peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(peer_id)


class HopClient:
    """Calls :class:`BlockService` handlers on other peers. Bound to the event loop that owns ``p2p``;
    the ``*_sync`` helpers need ``loop`` (the :class:`LoopThread` running that loop)."""

    def __init__(
        self, p2p: P2P, run_id: str | None, *, loop: LoopThread | None = None, default_timeout: float = 30.0,
        unary_limit: int = UNARY_LIMIT_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES, vocab_size_hint: int = 256,
        max_response_bytes: int = 1 << 30,
    ):
        if run_id is not None:
            namespace(run_id, 0)  # validates run_id
        self.p2p = p2p
        self.run_id = run_id
        self.loop = loop
        self.default_timeout = default_timeout
        self.unary_limit = unary_limit
        self.chunk_bytes = chunk_bytes
        self.vocab_size_hint = vocab_size_hint
        self.max_response_bytes = max_response_bytes
        self.traffic = TrafficCounter()

    # -- forward hop ------------------------------------------------------------------------
    async def forward(self, peer_id: str | PeerID, request: HopRequest, timeout: float | None = None) -> HopResponse:
        """Run one hop of ``request.block_index`` on ``peer_id``. The answer is validated here, the one
        place callers rely on: state of the request's shape and dtype, logits (N, T, V) when asked
        for, both finite; anything else raises :class:`RemoteHopError` with code ``bad_response``."""
        t = self.default_timeout if timeout is None else timeout
        rid = request.request_id or uuid.uuid4().hex
        pbs = [encode_tensor(request.state), encode_tensor(request.context), encode_tensor(request.sigmas)]
        meta = encode_meta(
            {"v": WIRE_VERSION, "request_id": rid, "block_index": int(request.block_index),
             "want_logits": bool(request.want_logits)}
        )
        stream = (estimate_request_bytes(request) > self.unary_limit
                  or estimate_response_bytes(request, self.vocab_size_hint) > self.unary_limit)
        what = f"hop of block {request.block_index}"
        try:
            resp_meta, tensors, transport = await asyncio.wait_for(
                self._forward(_peer(peer_id), request.block_index, meta, pbs, stream), t
            )
        except asyncio.TimeoutError:
            self.traffic.call(ok=False)
            raise HopTimeoutError(f"peer {peer_id} did not answer the {what} within {t:.1f}s") from None
        except RemoteHopError:
            self.traffic.call(ok=False)
            raise
        except (P2PHandlerError, P2PDaemonError, ConnectionError, asyncio.IncompleteReadError) as e:
            self.traffic.call(ok=False)
            raise _transport_error(str(peer_id), request.block_index, e) from None
        self.traffic.call(ok=True)
        resp = self._check_answer(str(peer_id), request, rid, resp_meta, tensors)
        resp.extra["transport"] = transport
        return resp

    async def _forward(
        self, peer: PeerID, block: int, meta: bytes, pbs: list[runtime_pb2.Tensor], stream: bool
    ) -> tuple[dict[str, Any], list[runtime_pb2.Tensor], str]:
        stub = BlockService.get_stub(self.p2p, peer, namespace=namespace(self.run_id, block))
        if not stream:
            msg = runtime_pb2.ExpertRequest(metadata=meta, tensors=pbs)
            self.traffic.sent(msg.ByteSize())
            resp = await stub.rpc_forward(msg)
            self.traffic.received(resp.ByteSize())
            resp_meta = decode_meta(resp.metadata, "response metadata")
            if resp_meta.get("ok") is False and resp_meta.get("code") == "use_stream":
                stream = True  # the answer is larger than we guessed: redo as a stream
            else:
                _raise_if_failed(str(peer), resp_meta)
                return resp_meta, list(resp.tensors), "unary"
        responses = await stub.rpc_forward_stream(self._request_parts(meta, pbs))
        resp_meta, tensors = await self._collect(str(peer), responses, max_tensors=2,
                                                 expect=lambda m: 2 if m.get("has_logits") else 1)
        return resp_meta, tensors, "stream"

    async def _request_parts(
        self, meta: bytes, pbs: list[runtime_pb2.Tensor]
    ) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        first = True
        for pb in pbs:
            for part in split_parts(pb, self.chunk_bytes):
                msg = runtime_pb2.ExpertRequest(metadata=meta if first else b"", tensors=[part])
                first = False
                self.traffic.sent(msg.ByteSize())
                yield msg

    async def _collect(
        self, peer: str, responses: AsyncIterator[runtime_pb2.ExpertResponse], max_tensors: int,
        max_bytes: int | None = None, *, expect: Callable[[dict[str, Any]], int | None] | None = None,
        progress: StreamProgress | None = None,
    ) -> tuple[dict[str, Any], list[runtime_pb2.Tensor]]:
        assembler = TensorAssembler(max_bytes or self.max_response_bytes, max_tensors=max_tensors, what="response")
        return await read_answer(peer, responses, assembler, count=self.traffic.received, expect=expect,
                                 progress=progress)

    def _check_answer(
        self, peer: str, req: HopRequest, rid: str, meta: dict[str, Any], tensors: list[runtime_pb2.Tensor]
    ) -> HopResponse:
        try:
            if meta.get("request_id") != rid:
                raise HopRequestError("bad_response", f"answer is for request {meta.get('request_id')!r}, not {rid!r}")
            if len(tensors) != (2 if req.want_logits else 1):
                raise HopRequestError("bad_response", f"answer carries {len(tensors)} tensors")
            state = decode_tensor(tensors[0], "answer state")
            if state.shape != req.state.shape or state.dtype != req.state.dtype:
                raise HopRequestError(
                    "bad_response", f"answer state is {tuple(state.shape)} {state.dtype}, "
                    f"expected {tuple(req.state.shape)} {req.state.dtype}"
                )
            if not bool(torch.isfinite(state).all()):
                raise HopRequestError("bad_response", "answer state holds NaN or Inf")
            logits = None
            if req.want_logits:
                if tensors[1].dtype not in STATE_DTYPES:
                    raise HopRequestError("bad_response", f"logits dtype {tensors[1].dtype!r} is not a float type")
                logits = decode_tensor(tensors[1], "answer logits")
                if logits.dim() != 3 or logits.shape[:2] != req.state.shape[:2]:
                    raise HopRequestError(
                        "bad_response", f"logits shape {tuple(logits.shape)} does not match (N, T, V)"
                    )
                if not bool(torch.isfinite(logits).all()):
                    raise HopRequestError("bad_response", "answer logits hold NaN or Inf")
        except HopRequestError as e:
            raise RemoteHopError(peer, "bad_response", e.reason) from None
        return HopResponse(request_id=rid, state=state, logits=logits)

    # -- block state ------------------------------------------------------------------------
    async def get_block_state(
        self, peer_id: str | PeerID, block_index: int, timeout: float | None = None, *, max_bytes: int | None = None,
        attempts: int = 2,
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Download a block's state from ``peer_id``: ``(metadata, {name: tensor})``, streamed in parts.

        A stream that ends short (:class:`StreamTruncatedError`: its connection dropped) is asked for
        again, up to ``attempts`` streams in all, within the one ``timeout``; the last truncation is raised.
        A stream that delivers no message for :data:`STATE_IDLE_S` (its first included) is given up at once:
        a holder that takes the request and never answers (a stalling Sybil) costs a download that long, not
        its whole ``timeout`` (sized for the slowest link a large block may come over: a minute or more).
        :class:`HopTimeoutError` says how far the stream got."""
        t = self.default_timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        for attempt in range(1, max(1, attempts) + 1):
            progress = StreamProgress()
            try:
                meta, pbs = await _while_streaming(self._get_state(_peer(peer_id), block_index, max_bytes, progress),
                                                   progress, deadline, STATE_IDLE_S)
                break
            except _StreamIdle:
                self.traffic.call(ok=False)
                raise HopTimeoutError(
                    f"peer {peer_id} sent no part of block {block_index}'s state for {STATE_IDLE_S:.0f}s "
                    f"(this stream delivered {progress.describe()})"
                ) from None
            except asyncio.TimeoutError:
                self.traffic.call(ok=False)
                raise HopTimeoutError(
                    f"peer {peer_id} did not deliver block {block_index}'s state within {t:.1f}s "
                    f"(this stream delivered {progress.describe()})"
                ) from None
            except StreamTruncatedError as e:
                if attempt >= attempts or deadline - time.monotonic() < 1.0:
                    self.traffic.call(ok=False)
                    raise
                logger.warning("block %d's state from %s arrived truncated (%s); asking again", block_index, peer_id,
                               e.reason)
                drop_tracebacks(e)   # its frames hold the parts that stream delivered (up to a block's size)
            except RemoteHopError:
                self.traffic.call(ok=False)
                raise
            except (P2PHandlerError, P2PDaemonError, ConnectionError, asyncio.IncompleteReadError) as e:
                self.traffic.call(ok=False)
                raise _transport_error(str(peer_id), block_index, e) from None
        names = meta.get("names")
        if not isinstance(names, list) or len(names) != len(pbs) or not all(isinstance(n, str) for n in names):
            raise RemoteHopError(str(peer_id), "bad_response", f"state names {names!r} do not match {len(pbs)} tensors")
        try:
            tensors = {n: decode_tensor(pb, f"state tensor {n!r}") for n, pb in zip(names, pbs)}
        except HopRequestError as e:
            raise RemoteHopError(str(peer_id), "bad_response", e.reason) from None
        self.traffic.call(ok=True)
        state_meta = meta.get("meta")
        return (state_meta if isinstance(state_meta, dict) else {}), tensors

    async def _get_state(
        self, peer: PeerID, block: int, max_bytes: int | None, progress: StreamProgress | None = None,
    ) -> tuple[dict[str, Any], list[runtime_pb2.Tensor]]:
        stub = BlockService.get_stub(self.p2p, peer, namespace=namespace(self.run_id, block))
        msg = runtime_pb2.ExpertRequest(metadata=encode_meta({"v": WIRE_VERSION, "block_index": int(block)}))
        self.traffic.sent(msg.ByteSize())
        responses = await stub.rpc_state(msg)
        return await self._collect(str(peer), responses, max_tensors=4096, max_bytes=max_bytes, progress=progress,
                                   expect=lambda m: len(m["names"]) if isinstance(m.get("names"), list) else None)

    # -- blocking helpers -------------------------------------------------------------------
    def _need_loop(self) -> LoopThread:
        if self.loop is None:
            raise RuntimeError("HopClient was built without loop=LoopThread; use the async methods")
        return self.loop

    def forward_sync(self, peer_id: str | PeerID, request: HopRequest, timeout: float | None = None) -> HopResponse:
        return self._need_loop().run(self.forward(peer_id, request, timeout))

    def get_info_sync(self, peer_id: str | PeerID, timeout: float = 10.0) -> list[dict[str, str]]:
        return self._need_loop().run(get_node_info(self.p2p, peer_id, timeout))

    def get_block_state_sync(
        self, peer_id: str | PeerID, block_index: int, timeout: float | None = None, *, max_bytes: int | None = None,
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return self._need_loop().run(self.get_block_state(peer_id, block_index, timeout, max_bytes=max_bytes))


#: a block state stream that delivers no message for this long is given up (a message is at most a chunk,
#: DEFAULT_CHUNK_BYTES: seconds at the slowest rate a download is sized for, MIN_STATE_RATE_MB_S = 1 MB/s)
STATE_IDLE_S = 10.0


class _StreamIdle(Exception):
    pass


async def _while_streaming(coro, progress: "StreamProgress", deadline: float, idle_s: float):
    """Await ``coro`` (a stream reader that updates ``progress``) until ``deadline`` (monotonic:
    ``asyncio.TimeoutError``), or until it has gone ``idle_s`` without a message (:class:`_StreamIdle`)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise asyncio.TimeoutError
            if now - progress.last >= idle_s:
                raise _StreamIdle
            await asyncio.wait({task}, timeout=min(deadline, progress.last + idle_s) - now)
            if task.done():
                return task.result()
    finally:
        if not task.done():   # given up (or we were cancelled): stop reading, close the stream
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())   # nothing left to report


@dataclass
class StreamProgress:
    """How far an answer stream got (read after a timeout or a truncation to say so)."""

    messages: int = 0
    bytes: int = 0
    tensors: int = 0                 # tensor headers seen
    expected: int | None = None      # tensors a complete answer carries, once the first message said
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)   # when the last message came (or the stream started)

    def describe(self) -> str:
        of = f" of {self.expected}" if self.expected is not None else ""
        return (f"{self.tensors}{of} tensor(s) in {self.messages} message(s), {self.bytes} bytes, "
                f"in {time.monotonic() - self.started:.1f}s")


async def read_answer(
    peer: str, responses: AsyncIterator[runtime_pb2.ExpertResponse], assembler: TensorAssembler, *,
    count: Callable[[int], None] | None = None, expect: Callable[[dict[str, Any]], int | None] | None = None,
    progress: StreamProgress | None = None,
) -> tuple[dict[str, Any], list[runtime_pb2.Tensor]]:
    """Read a streamed answer to its end: ``(metadata of its first message, tensors)``, closing the stream.

    hivemind ends the iteration the same way whether the peer finished or the stream was reset
    under it, so completeness is checked here: a stream that ends before its first message, inside
    a tensor, or with fewer tensors than ``expect(metadata)`` raises :class:`StreamTruncatedError`.
    The peer's error answer raises :class:`RemoteHopError` with its code; an answer breaking the
    protocol, ``bad_response``. ``count(n)`` is called with each message's size."""
    progress = progress if progress is not None else StreamProgress()
    meta: dict[str, Any] | None = None
    try:
        async for msg in responses:
            size = msg.ByteSize()
            progress.messages += 1
            progress.bytes += size
            progress.last = time.monotonic()
            if count is not None:
                count(size)
            if meta is None:
                meta = decode_meta(msg.metadata, "response metadata")
                _raise_if_failed(peer, meta)
                progress.expected = expect(meta) if expect is not None else None
            for part in msg.tensors:
                assembler.feed(part)
                progress.tensors += 1 if part.dtype else 0
        if meta is None:
            raise StreamTruncatedError(peer, f"the answer stream ended before its first message, "
                                             f"after {progress.describe()}: {CUT_CAUSE}")
        if assembler.cut is not None:
            raise StreamTruncatedError(peer, f"{assembler.cut}, after {progress.describe()}: {CUT_CAUSE}")
        tensors = assembler.finish()
        if progress.expected is not None and len(tensors) < progress.expected:
            raise StreamTruncatedError(peer, f"the answer stream ended after {progress.describe()}: {CUT_CAUSE}")
        return meta, tensors
    except HopRequestError as e:
        raise RemoteHopError(peer, "bad_response", e.reason) from None
    finally:
        aclose = getattr(responses, "aclose", None)
        if aclose is not None:
            await aclose()


async def get_node_info(p2p: P2P, peer_id: str | PeerID, timeout: float = 10.0) -> list[dict[str, str]]:
    """The runs a node serves (``InfoService``): ``[{"run_id", "seeder", "config_hash"}]``, malformed
    entries dropped; RemoteHopError / HopTimeoutError if it does not answer."""
    try:
        stub = InfoService.get_stub(p2p, _peer(peer_id), namespace=INFO_NAMESPACE)
        resp = await asyncio.wait_for(stub.rpc_info(runtime_pb2.ExpertRequest()), timeout)
        meta = decode_meta(resp.metadata, "info answer")
    except asyncio.TimeoutError:
        raise HopTimeoutError(f"peer {peer_id} did not say which run it serves within {timeout:.0f}s") from None
    except (P2PHandlerError, P2PDaemonError, ConnectionError, asyncio.IncompleteReadError) as e:
        raise _transport_error(str(peer_id), -1, e) from None
    except HopRequestError as e:
        raise RemoteHopError(str(peer_id), "bad_response", e.reason) from None
    _raise_if_failed(str(peer_id), meta)
    runs = meta.get("runs")
    out = []
    for r in runs if isinstance(runs, list) else []:
        try:
            if isinstance(r, dict) and isinstance(r.get("seeder"), str) and isinstance(r.get("config_hash"), str):
                out.append({"run_id": validate_run_id(r.get("run_id")), "seeder": r["seeder"][:128],
                            "config_hash": r["config_hash"][:64]})
        except ValueError:
            continue
    return out


def _raise_if_failed(peer: str, meta: dict[str, Any]) -> None:
    if meta.get("ok") is True:
        return
    code = meta.get("code") if isinstance(meta.get("code"), str) else "bad_response"
    reason = meta.get("reason") if isinstance(meta.get("reason"), str) else f"unexpected answer {meta!r}"
    raise RemoteHopError(peer, code, reason)


def _transport_error(peer: str, block: int, e: BaseException) -> RemoteHopError:
    text = str(e) or type(e).__name__
    low = text.lower()
    dial_failed = "failed to dial" in low or "security protocol" in low   # the peer's daemon did not answer
    if "protocol" in low and ("not supported" in low or "negotiate" in low) and not dial_failed:
        return RemoteHopError(peer, "unknown_block", f"the peer does not serve block {block} of this run ({text})")
    if isinstance(e, P2PHandlerError):
        return RemoteHopError(peer, "remote_failure", text)
    return RemoteHopError(peer, "unreachable", f"{type(e).__name__}: {text}")
