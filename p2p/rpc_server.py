"""Server side of the block RPC: one hivemind ``ServicerBase`` service per held block, one namespace each.

Handlers (namespaced ``bt_<run>_b<block>::BlockService.<name>``):

* ``rpc_forward``        unary hop (request and response below ~2 MB),
* ``rpc_forward_stream`` streamed hop (any size up to ``HopLimits.max_request_bytes``),
* ``rpc_state``          streamed download of the block's state (metadata + named tensors).

Every request is validated (metadata, block, dtypes, shapes, sizes, then cheap value checks) before
the node's ``hop_handler`` runs; the handler runs in a worker thread so the event loop keeps serving.
Failures go back as ``{"ok": false, "code", "reason"}`` responses; the service never dies on a bad call.

Private runs: with an ``authorize(peer_id) -> bool`` callback (``BlockRPCServer(authorize=...)``), every
handler first checks the caller's libp2p peer id (``context.remote_id``, authenticated by the secure
channel) and refuses others with code ``unauthorized`` before reading their request.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator  # hivemind only recognises typing.AsyncIterator as a stream hint

import torch
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from blocktrain.p2p.errors import HopRequestError, drop_tracebacks
from blocktrain.p2p.hops import (
    WIRE_VERSION, HopLimits, HopRequest, HopResponse, check_hop_headers, check_hop_output, check_hop_values, check_state_header,
    decode_meta, encode_meta, error_response, namespace, parse_request_meta,
)
from blocktrain.p2p.tensors import DEFAULT_CHUNK_BYTES, TensorAssembler, decode_tensor, encode_tensor, split_parts
from blocktrain.p2p.traffic import TrafficCounter

__all__ = ["BlockService", "BlockRPCServer", "HopHandler", "StateProvider", "UNARY_LIMIT_BYTES", "InfoService",
           "INFO_NAMESPACE", "failure_response", "log_cut", "split_response"]

logger = logging.getLogger(__name__)

HopHandler = Callable[[HopRequest], HopResponse]   # a decoded, validated request -> the answer
StateProvider = Callable[[int], tuple[dict[str, Any], dict[str, torch.Tensor]]]
InfoProvider = Callable[[], dict[str, Any]]
INFO_NAMESPACE = "bt_info"
UNARY_LIMIT_BYTES = 2_000_000  # hivemind's unary messages are capped at 4 MiB; stay well below
DRAIN_TIMEOUT_S = 5.0


def _ok_meta(request_id: str, **extra: Any) -> bytes:
    return encode_meta({"v": WIRE_VERSION, "ok": True, "request_id": request_id, **extra})


class BlockService(ServicerBase):
    """The RPC handlers for one block."""

    authorize: Callable[[str], bool] | None = None   # private runs: may this peer id call us?

    def _check_caller(self, context: P2PContext) -> None:
        if self.authorize is None:
            return
        caller = str(context.remote_id)
        try:
            ok = bool(self.authorize(caller))
        except Exception:  # a broken policy refuses rather than lets everyone in
            ok = False
        if not ok:
            raise HopRequestError("unauthorized", f"peer {caller} is not allowed to call this node "
                                                  f"(private run: ask the run's operator to allow this peer id)")

    def __init__(
        self, block_index: int, limits: HopLimits, hop_handler: HopHandler, state_provider: StateProvider | None,
        *, traffic: TrafficCounter, executor: ThreadPoolExecutor, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        unary_limit: int = UNARY_LIMIT_BYTES, inject_delay_s: float = 0.0, state_slots: "StateSlots | None" = None,
    ):
        self.block_index = block_index
        self.state_slots = state_slots or StateSlots(limits.max_state_streams)
        # benchmark/testing knob (``--inject-delay-ms``): sleep this one-way delay after a hop request
        # has arrived and again before its answer leaves, so each hop's round trip gains 2x the delay
        self.inject_delay_s = inject_delay_s
        self.limits = limits
        self.hop_handler = hop_handler
        self.state_provider = state_provider
        self.traffic = traffic
        self.chunk_bytes = chunk_bytes
        self.unary_limit = unary_limit
        self._executor = executor
        self._sem: asyncio.Semaphore | None = None

    # -- hops -------------------------------------------------------------------------------
    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self.traffic.received(request.ByteSize())
        await self._inject_delay()       # the request's one-way trip
        rid = ""
        try:
            self._check_caller(context)
            meta = decode_meta(request.metadata, "request metadata")
            rid, _, want = parse_request_meta(meta, self.block_index, self.limits)
            tensors = list(request.tensors)
            response_bytes = check_hop_headers(tensors, self.limits, want)
            if response_bytes > self.unary_limit:
                raise HopRequestError(
                    "use_stream", f"the answer would be {response_bytes} bytes: use rpc_forward_stream"
                )
            response = await self._run_hop(rid, tensors, want)
        except Exception as e:
            response = self._failure(e, rid, context)
        await self._inject_delay()       # the answer's one-way trip
        self.traffic.sent(response.ByteSize())
        return response

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        rid = ""
        consumed = False
        try:
            self._check_caller(context)
            assembler = TensorAssembler(self.limits.max_request_bytes, max_tensors=3, what="request")
            want, first = False, True
            async for msg in requests:
                self.traffic.received(msg.ByteSize())
                if first:
                    meta = decode_meta(msg.metadata, "request metadata")
                    rid, _, want = parse_request_meta(meta, self.block_index, self.limits)
                    first = False
                for part in msg.tensors:
                    if part.dtype and not assembler.headers:  # the state header: reject a wrong shape early
                        check_state_header(part, self.limits)
                    assembler.feed(part)
            consumed = True
            if first:
                raise HopRequestError("malformed", "empty request stream")
            tensors = assembler.finish()
            check_hop_headers(tensors, self.limits, want)
            await self._inject_delay()   # the request's one-way trip
            response = await self._run_hop(rid, tensors, want)
        except Exception as e:
            response = self._failure(e, rid, context)
        await self._inject_delay()       # the answer's one-way trip
        msgs, n = self._split(response), 0
        try:
            for n, msg in enumerate(msgs, 1):
                self.traffic.sent(msg.ByteSize())
                yield msg
        except (GeneratorExit, asyncio.CancelledError) as e:
            log_cut(f"the hop answer to {context.remote_id}", f"{n - 1} of {len(msgs)} messages", e)
            raise
        if not consumed:
            await self._discard_rest(requests)

    async def _inject_delay(self) -> None:
        if self.inject_delay_s > 0:
            await asyncio.sleep(self.inject_delay_s)

    async def _discard_rest(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        """After refusing a stream early, read and drop what the client still sends (bounded in time).

        Closing a libp2p stream with unread data resets it, and the reset can overtake our error
        answer; draining lets the answer arrive. The client stops sending as soon as it reads it.
        """
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                async for msg in requests:
                    self.traffic.received(msg.ByteSize())
        except Exception:  # timeout or the client went away: either way we are done
            pass

    async def _run_hop(self, rid: str, tensors: list[runtime_pb2.Tensor], want: bool) -> runtime_pb2.ExpertResponse:
        req = HopRequest(block_index=self.block_index, state=decode_tensor(tensors[0], "state"),
                         context=decode_tensor(tensors[1], "context"), sigmas=decode_tensor(tensors[2], "sigmas"),
                         want_logits=want, request_id=rid)
        check_hop_values(req.context, req.sigmas, self.limits)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.limits.max_inflight)
        async with self._sem:
            loop = asyncio.get_running_loop()
            try:
                resp = await loop.run_in_executor(self._executor, self.hop_handler, req)
            except Exception as e:
                raise HopRequestError("internal", f"hop handler failed: {type(e).__name__}: {e}") from e
        check_hop_output(resp.state, resp.logits, req.state, want, self.limits.vocab_size)
        pbs = [encode_tensor(resp.state.to(req.state.dtype))]
        if want:
            pbs.append(encode_tensor(resp.logits))
        self.traffic.call(ok=True)
        return runtime_pb2.ExpertResponse(metadata=_ok_meta(rid, has_logits=want), tensors=pbs)

    def _failure(self, e: Exception, rid: str, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self.traffic.call(ok=False)
        return failure_response(e, rid, f"hop from {context.remote_id}")

    def _split(self, response: runtime_pb2.ExpertResponse) -> list[runtime_pb2.ExpertResponse]:
        return split_response(response, self.chunk_bytes)

    # -- state download ---------------------------------------------------------------------
    async def rpc_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        self.traffic.received(request.ByteSize())
        slot = None
        try:
            self._check_caller(context)
            meta = decode_meta(request.metadata, "request metadata")
            block = meta.get("block_index")
            if meta.get("v") != WIRE_VERSION:
                raise HopRequestError("malformed", f"wire version {meta.get('v')!r} not supported")
            if block != self.block_index or isinstance(block, bool):
                raise HopRequestError("unknown_block", f"this service serves block {self.block_index}, not {block!r}")
            if self.state_provider is None:
                raise HopRequestError("unknown_block", f"this node does not share the state of block {block}")
            slot = self.state_slots.take(context.remote_id)   # before the copy below: a bounded number exist
            loop = asyncio.get_running_loop()
            try:
                state_meta, tensors = await loop.run_in_executor(self._executor, self.state_provider, block)
            except Exception as e:
                raise HopRequestError("internal", f"state provider failed: {type(e).__name__}: {e}") from e
            names = list(tensors)
            if not all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in tensors.items()):
                raise HopRequestError("internal", "state provider must return dict[str, Tensor]")
            try:
                head = _ok_meta(meta.get("request_id", ""), meta=state_meta, names=names)
            except (TypeError, ValueError) as e:
                raise HopRequestError("internal", f"state metadata is not JSON-serialisable: {e}") from e
        except Exception as e:
            if slot is not None:
                slot.release()
            msg = self._failure(e, "", context)
            self.traffic.sent(msg.ByteSize())
            yield msg
            return
        # the whole answer has a deadline (twice what a downloader allows itself at 1 MB/s, at least 60 s):
        # a caller that stops reading would otherwise hold the copy and the slot for as long as it likes
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        slot.watch(asyncio.current_task(), max(STATE_STREAM_MIN_S, 20.0 + 2.0 * size / STATE_STREAM_MIN_RATE_B_S))
        done = 0
        try:
            self.traffic.call(ok=True)
            first = runtime_pb2.ExpertResponse(metadata=head)
            self.traffic.sent(first.ByteSize())
            yield first
            loop = asyncio.get_running_loop()
            for name in names:
                pb = await loop.run_in_executor(self._executor, encode_tensor, tensors[name])  # big copies off-loop
                for part in split_parts(pb, self.chunk_bytes):
                    msg = runtime_pb2.ExpertResponse(tensors=[part])
                    self.traffic.sent(msg.ByteSize())
                    yield msg
                done += 1
        except (GeneratorExit, asyncio.CancelledError) as e:
            log_cut(f"block {self.block_index}'s state to {context.remote_id}", f"{done} of {len(names)} tensors", e)
            raise
        finally:
            slot.release()


STATE_STREAM_MIN_S = 60.0             # a state answer's deadline, at least
STATE_STREAM_MIN_RATE_B_S = 1e6        # ... and 20 s + twice its size at this rate (node/state_fetch.py: 1 MB/s)


class StateSlots:
    """How many block-state answers a server streams at once (``HopLimits.max_state_streams``, shared by
    all its blocks). Each holds a copy of its block until its caller has read it, so unbounded they let any
    peer grow a node's memory by a block per request it leaves unread (measured: 40 streams, +1.4 GB for
    a 25 MB block). A request over the limit is refused ``busy`` before anything is copied; an answer not
    read within its deadline is cut (its handler task cancelled), which frees its slot. Event-loop only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0
        self.refused = 0
        self.cut = 0

    def take(self, peer) -> "_StateSlot":
        if self.active >= self.limit:
            self.refused += 1
            raise HopRequestError("busy", f"this node is sending its block state to {self.active} peers, its limit; "
                                          "ask another holder or retry shortly")
        self.active += 1
        return _StateSlot(self, peer)


class _StateSlot:
    def __init__(self, slots: StateSlots, peer):
        self.slots, self.peer = slots, peer
        self._timer: asyncio.TimerHandle | None = None
        self._held = True

    def watch(self, task: asyncio.Task | None, deadline_s: float) -> None:
        if task is not None:
            self._timer = asyncio.get_running_loop().call_later(deadline_s, self._expire, task, deadline_s)

    def _expire(self, task: asyncio.Task, deadline_s: float) -> None:
        if self._held:
            self.slots.cut += 1
            logger.warning("block state to %s not read within %.0f s: cut", self.peer, deadline_s)
            self.release()
            task.cancel()

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._held:
            self._held = False
            self.slots.active -= 1


def log_cut(what: str, sent: str, e: BaseException) -> None:
    """Say that an answer stream was closed under us: hivemind drops a failed send without a word
    (and the caller's client may see a short stream; see p2p/errors.py StreamTruncatedError)."""
    how = "handler cancelled" if isinstance(e, asyncio.CancelledError) else "stream closed"
    logger.warning("%s stopped after %s (%s: the caller went away or the connection dropped)", what, sent, how)


def failure_response(e: Exception, rid: str, what: str) -> runtime_pb2.ExpertResponse:
    """The error answer to a refused or failed call (``what``: "hop from PEER", for the log)."""
    try:
        if isinstance(e, HopRequestError):
            logger.info("refused %s: %s", what, e)
            return error_response(e.code, e.reason, rid)
        logger.exception("unexpected failure serving %s", what)
        return error_response("internal", f"{type(e).__name__}: {e}", rid)
    finally:   # answered (and logged): the failure's frames, the request's tensors among their locals, go now
        drop_tracebacks(e)


def split_response(response: runtime_pb2.ExpertResponse, chunk_bytes: int) -> list[runtime_pb2.ExpertResponse]:
    """A streamed answer: first message metadata (+ first part), then one tensor part per message."""
    parts = [p for pb in response.tensors for p in split_parts(pb, chunk_bytes)]
    if not parts:
        return [response]
    msgs = [runtime_pb2.ExpertResponse(metadata=response.metadata, tensors=[parts[0]])]
    msgs += [runtime_pb2.ExpertResponse(tensors=[p]) for p in parts[1:]]
    return msgs


class BlockRPCServer:
    """Registers a :class:`BlockService` per held block on a hivemind ``P2P`` (e.g. ``await dht.replicate_p2p()``).

    Must be used from the event loop that owns ``p2p``.
    """

    def __init__(
        self, p2p: P2P, run_id: str, limits: HopLimits, hop_handler: HopHandler,
        state_provider: StateProvider | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        unary_limit: int = UNARY_LIMIT_BYTES, inject_delay_s: float = 0.0,
        authorize: Callable[[str], bool] | None = None,
    ):
        namespace(run_id, 0)  # validates run_id
        self.authorize = authorize
        if not 0.0 <= inject_delay_s <= 10.0:
            raise ValueError(f"inject_delay_s must be in [0, 10] seconds, got {inject_delay_s}")
        self.inject_delay_s = inject_delay_s
        self.p2p = p2p
        self.run_id = run_id
        self.limits = limits
        self.hop_handler = hop_handler
        self.state_provider = state_provider
        self.chunk_bytes = chunk_bytes
        self.unary_limit = unary_limit
        self.traffic = TrafficCounter()
        self._executor = ThreadPoolExecutor(max_workers=limits.max_inflight + 1, thread_name_prefix="bt-hop")
        self.state_slots = StateSlots(limits.max_state_streams)   # node-wide: every block's answers count
        self._services: dict[int, BlockService] = {}

    async def add_block(self, block_index: int) -> None:
        if block_index not in self.limits.allowed_blocks:
            allowed = sorted(self.limits.allowed_blocks)
            raise ValueError(f"block {block_index} is not in HopLimits.allowed_blocks {allowed}")
        if block_index in self._services:
            return
        svc = BlockService(
            block_index, self.limits, self.hop_handler, self.state_provider, traffic=self.traffic,
            executor=self._executor, chunk_bytes=self.chunk_bytes, unary_limit=self.unary_limit,
            inject_delay_s=self.inject_delay_s, state_slots=self.state_slots,
        )
        svc.authorize = self.authorize
        await svc.add_p2p_handlers(self.p2p, namespace=namespace(self.run_id, block_index))
        self._services[block_index] = svc

    async def remove_block(self, block_index: int) -> None:
        svc = self._services.pop(block_index, None)
        if svc is not None:
            await svc.remove_p2p_handlers(self.p2p, namespace=namespace(self.run_id, block_index))

    async def close(self) -> None:
        for b in list(self._services):
            try:
                await self.remove_block(b)
            except Exception as e:  # the daemon may already be gone
                logger.debug("removing handlers of block %d: %s", b, e)
        self._executor.shutdown(wait=False, cancel_futures=True)


class InfoService(ServicerBase):
    """What this node serves, asked by a member that was given only its address: ``rpc_info`` answers
    ``{"v", "ok", "runs": [{"run_id", "seeder", "config_hash"}]}``. A member without a run id joins the
    run its initial peer serves, not whatever a DHT-wide list says."""

    def __init__(self, provider: InfoProvider):
        self.provider = provider

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            return runtime_pb2.ExpertResponse(metadata=_ok_meta("", **self.provider()))
        except Exception as e:   # a broken provider answers an error, never kills the service
            logger.exception("info provider failed")
            return error_response("internal", f"{type(e).__name__}: {e}")

    @classmethod
    async def serve(cls, p2p: P2P, provider: InfoProvider) -> "InfoService":
        svc = cls(provider)
        await svc.add_p2p_handlers(p2p, namespace=INFO_NAMESPACE)
        return svc
