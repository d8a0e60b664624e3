"""Pipeline training RPC (issue 13): ``rpc_train``, one recursive call per micro-batch and stage.

Why not hivemind's ``moe`` engine or Petals' remote forward/backward as they are (both were read
before writing this):

* hivemind ``moe`` (``ConnectionHandler.rpc_forward`` / ``rpc_backward``, ``ModuleBackend``,
  ``TaskPool``): a server batches requests from many clients in its own Runtime process and its
  ``ModuleBackend.backward`` re-runs the forward and *steps its own optimizer on every backward*.
  Here the trainer must stay the only writer of a block's weights (optimizer steps every k
  micro-batches, averaging rounds, downloads under one lock), the stages call each other rather
  than a client calling all of them, and ``deserialize_torch_tensor`` trusts the sender's dtype
  and buffer length. What is kept: the transport (hivemind ``ServicerBase`` handlers on the node's
  libp2p daemon, ``runtime_pb2.ExpertRequest`` / ``ExpertResponse`` messages, streamed in parts),
  the idea of stateless recompute when the weights changed between forward and backward
  (``ModuleBackend.backward`` always recomputes; the engine recomputes only then), and its codecs'
  sizes (fp16 and uniform 8-bit), re-implemented in ``pipeline_wire.py`` behind the strict codec.
* Petals (``client/sequential_autograd.py``, ``remote_forward_backward.py``, ``server/handler.py``):
  the *client* drives forward through every span, keeps each span's input, then calls backward
  on each span in reverse, and servers recompute their forward (their weights are frozen). Every
  activation goes through the client twice, and the client must hold B inputs per micro-batch.
  SWARM instead sends activations from a stage straight to a holder of the next stage.

So here: a holder of block b receives h_{b-1}, runs its block, and itself calls a holder of block
b+1 (stochastic wiring, chosen by the node); the answer to its call is dL/dh_b, it runs its
backward and answers its caller with dL/dh_{b-1}. The route back is the route forward by
construction; nothing is stashed beyond the call (the call's frame holds it), a failure anywhere
surfaces as an error answer to the caller, and every call carries how long its caller waits.

This module moves and validates tensors only: the stage logic is the node's ``TrainHandler``, and who may
call a stage is the node's rule too (``admit``: node/pipeline/admission.py; ``authorize``: private runs).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, AsyncIterator  # hivemind only recognises typing.AsyncIterator as a stream hint

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from blocktrain.p2p.errors import HopRequestError, HopTimeoutError, RemoteHopError
from blocktrain.p2p.hops import decode_meta
from blocktrain.p2p.pipeline_wire import (
    PipelineLimits, SentRequest, StageRequest, StageResponse, activation_tensors, decode_request, decode_response,
    request_message, response_message, train_namespace,
)
from blocktrain.p2p.rpc_client import StreamProgress, _transport_error, read_answer
from blocktrain.p2p.rpc_server import failure_response, log_cut, split_response
from blocktrain.p2p.tensors import DEFAULT_CHUNK_BYTES, TensorAssembler, split_parts

__all__ = ["PipelineService", "PipelineServer", "PipelineClient", "PipelineTraffic", "TrainHandler"]

logger = logging.getLogger(__name__)

TrainHandler = Callable[[StageRequest], Awaitable[StageResponse]]
DRAIN_TIMEOUT_S = 5.0
_FIELDS = ("wire_bytes_sent", "wire_bytes_received", "activation_bytes_sent", "activation_bytes_received",
           "gradient_bytes_sent", "gradient_bytes_received", "target_bytes_sent", "target_bytes_received",
           "calls_out", "calls_out_failed", "calls_in", "calls_in_refused")


class PipelineTraffic:
    """What one worker's training traffic cost, both as caller and as stage (thread-safe).

    ``*_bytes`` of activations, gradients and targets are tensor payload bytes (what the codec
    puts on the wire); ``wire_bytes`` are whole protobuf messages (metadata and framing too)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._c = dict.fromkeys(_FIELDS, 0)

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._c[k] += int(v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


class PipelineService(ServicerBase):
    """The ``rpc_train`` handler of one block."""

    def __init__(self, block_index: int, limits: PipelineLimits, handler: TrainHandler, *, traffic: PipelineTraffic,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, inject_delay_s: float = 0.0,
                 authorize: Callable[[str], bool] | None = None,
                 admit: Callable[[str], Awaitable[bool]] | None = None):
        self.block_index, self.limits, self.handler = block_index, limits, handler
        self.traffic, self.chunk_bytes = traffic, chunk_bytes
        self.inject_delay_s, self.authorize, self.admit = inject_delay_s, authorize, admit

    async def rpc_train(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                        context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        rid, consumed, grad_bytes = "", False, 0
        try:
            self._check_caller(context)
            if self.admit is not None and not await self.admit(str(context.remote_id)):
                raise HopRequestError("not_upstream", f"peer {context.remote_id} is not an announced holder of "
                                                      f"block {self.block_index - 1}: it may not send block "
                                                      f"{self.block_index} training traffic")
            meta, tensors = await self._receive(requests)
            consumed = True
            if meta is None:
                raise HopRequestError("malformed", "empty request stream")
            await self._delay()
            req = decode_request(meta, tensors, self.block_index, self.limits)
            rid, k = req.request_id, activation_tensors(req.codec)
            self.traffic.add(activation_bytes_received=sum(len(t.buffer) for t in tensors[:k]),
                             target_bytes_received=sum(len(t.buffer) for t in tensors[k:]))
            del tensors   # decoded: the received bytes are not kept while the chain below runs
            try:
                resp = await asyncio.wait_for(self.handler(req), req.deadline_s + 5.0)
            except asyncio.TimeoutError:
                raise HopRequestError("timeout", f"the stage did not finish within {req.deadline_s:.1f}s") from None
            except HopRequestError:
                raise
            except Exception as e:
                logger.exception("pipeline stage handler failed")
                raise HopRequestError("internal", f"stage failed: {type(e).__name__}: {e}") from e
            meta_out, pbs, grad_bytes = response_message(resp, req.codec)
            response = runtime_pb2.ExpertResponse(metadata=meta_out, tensors=pbs)
        except Exception as e:
            response = self._failure(e, rid, context)
            grad_bytes = 0
        await self._delay()
        self.traffic.add(calls_in=1, gradient_bytes_sent=grad_bytes)
        msgs, n = self._split(response), 0
        try:
            for n, msg in enumerate(msgs, 1):
                self.traffic.add(wire_bytes_sent=msg.ByteSize())
                yield msg
        except (GeneratorExit, asyncio.CancelledError) as e:
            log_cut(f"the answer of block {self.block_index} to {context.remote_id}",
                    f"{n - 1} of {len(msgs)} messages", e)
            raise
        if not consumed:
            await _drain(requests)

    async def _receive(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]
                       ) -> tuple[dict[str, Any] | None, list[runtime_pb2.Tensor]]:
        """The whole request stream: (metadata of its first message or None if none came, tensors),
        bounded by the limits."""
        meta: dict[str, Any] | None = None
        assembler = TensorAssembler(self.limits.max_request_bytes, max_tensors=3, what="request")
        async for msg in requests:
            self.traffic.add(wire_bytes_received=msg.ByteSize())
            if meta is None:
                meta = decode_meta(msg.metadata, "request metadata")
            for part in msg.tensors:
                assembler.feed(part)
        return meta, assembler.finish()

    def _check_caller(self, context: P2PContext) -> None:
        if self.authorize is None:
            return
        try:
            ok = bool(self.authorize(str(context.remote_id)))
        except Exception:
            ok = False
        if not ok:
            raise HopRequestError("unauthorized", f"peer {context.remote_id} is not allowed to call this node")

    async def _delay(self) -> None:
        if self.inject_delay_s > 0:
            await asyncio.sleep(self.inject_delay_s)

    def _failure(self, e: Exception, rid: str, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self.traffic.add(calls_in_refused=1)
        return failure_response(e, rid, f"pipeline call from {context.remote_id}")

    def _split(self, response: runtime_pb2.ExpertResponse) -> list[runtime_pb2.ExpertResponse]:
        return split_response(response, self.chunk_bytes)


async def _drain(requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
    """Read what a refused caller still sends (bounded), so our error answer is not lost in a reset."""
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for _ in requests:
                pass
    except Exception:
        pass


class PipelineServer:
    """Registers a :class:`PipelineService` per held block on ``p2p`` (use from the loop that owns it)."""

    def __init__(self, p2p: P2P, run_id: str, limits: PipelineLimits, handler: TrainHandler, *,
                 traffic: PipelineTraffic, inject_delay_s: float = 0.0,
                 authorize: Callable[[str], bool] | None = None,
                 admit: Callable[[str], Awaitable[bool]] | None = None):
        train_namespace(run_id, 0)   # validates run_id
        self.p2p, self.run_id, self.limits, self.handler = p2p, run_id, limits, handler
        self.traffic, self.inject_delay_s, self.authorize = traffic, inject_delay_s, authorize
        self.admit = admit   # (the caller's peer id) -> may it send this block training traffic (node's rule)
        self._services: dict[int, PipelineService] = {}

    async def add_block(self, block_index: int) -> None:
        if block_index not in self.limits.allowed_blocks:
            raise ValueError(f"block {block_index} is not in PipelineLimits.allowed_blocks")
        svc = PipelineService(block_index, self.limits, self.handler, traffic=self.traffic,
                              inject_delay_s=self.inject_delay_s, authorize=self.authorize, admit=self.admit)
        await svc.add_p2p_handlers(self.p2p, namespace=train_namespace(self.run_id, block_index))
        self._services[block_index] = svc

    async def close(self) -> None:
        for b, svc in list(self._services.items()):
            try:
                await svc.remove_p2p_handlers(self.p2p, namespace=train_namespace(self.run_id, b))
            except Exception as e:   # the daemon may already be gone
                logger.debug("removing pipeline handlers of block %d: %s", b, e)
        self._services.clear()


class PipelineClient:
    """Calls ``rpc_train`` of a holder of the next block; answers validated, failures typed."""

    def __init__(self, p2p: P2P, run_id: str, limits: PipelineLimits, traffic: PipelineTraffic, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        train_namespace(run_id, 0)
        self.p2p, self.run_id, self.limits, self.traffic, self.chunk_bytes = p2p, run_id, limits, traffic, chunk_bytes

    async def call(self, peer_id: str, req: StageRequest, timeout: float) -> StageResponse:
        """Send ``req`` to ``peer_id`` and wait at most ``timeout`` s. Raises RemoteHopError (``.code``:
        the peer's error code, ``unreachable``, ``bad_response``), HopTimeoutError, or HopRequestError
        when the request cannot be sent (e.g. a non-finite state: nothing left this node).

        Once encoded, the request's tensors are let go here (``req`` itself is not kept: what checking
        the answer needs is its :class:`SentRequest`), and each encoded tensor is dropped as soon as its
        last part is handed to the stream; so a caller that keeps no reference of its own (the engine
        with ``--pipeline-recompute``) holds no copy of the state while the next stage computes."""
        if not req.request_id:
            req.request_id = uuid.uuid4().hex
        meta, pbs, _, _ = request_message(req)
        sent, k = req.sent(), activation_tensors(req.codec)
        del req
        parts = self._parts(meta, pbs, k)
        del pbs
        self.traffic.add(calls_out=1)
        progress = StreamProgress()
        try:
            resp_meta, tensors = await asyncio.wait_for(
                self._call(PeerID.from_base58(peer_id), sent, parts, progress), timeout)
            resp = decode_response(resp_meta, tensors, sent, self.limits)
        except asyncio.TimeoutError:
            self.traffic.add(calls_out_failed=1)
            raise HopTimeoutError(f"peer {peer_id} did not answer the micro-batch for block {sent.block_index} "
                                  f"within {timeout:.1f}s (its answer stream delivered {progress.describe()})"
                                  ) from None
        except RemoteHopError:
            self.traffic.add(calls_out_failed=1)
            raise
        except HopRequestError as e:   # the answer broke the protocol
            self.traffic.add(calls_out_failed=1)
            raise RemoteHopError(peer_id, "bad_response", e.reason) from None
        except (P2PHandlerError, P2PDaemonError, ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
            self.traffic.add(calls_out_failed=1)
            raise _transport_error(peer_id, sent.block_index, e) from None
        self.traffic.add(gradient_bytes_received=sum(len(t.buffer) for t in tensors))
        return resp

    async def _call(self, peer: PeerID, sent: SentRequest, parts: AsyncIterator[runtime_pb2.ExpertRequest],
                    progress: StreamProgress) -> tuple[dict[str, Any], list[runtime_pb2.Tensor]]:
        stub = PipelineService.get_stub(self.p2p, peer, namespace=train_namespace(self.run_id, sent.block_index))
        responses = await stub.rpc_train(parts)
        assembler = TensorAssembler(self.limits.max_request_bytes, max_tensors=2, what="answer")
        k = activation_tensors(sent.codec) if sent.mode == "backprop" else 0
        return await read_answer(str(peer), responses, assembler, progress=progress, expect=lambda m: k,
                                 count=lambda n: self.traffic.add(wire_bytes_received=n))

    async def _parts(self, meta: bytes, pbs: list[runtime_pb2.Tensor],
                     k_state: int) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        """The request in parts, each counted as it is handed to the stream (the state's tensors as
        activation bytes, the last one as target bytes). Each tensor leaves ``pbs`` (the only list
        holding it) once its first part is made, so its bytes are freed when its last part is sent."""
        first, i = True, 0
        while pbs:
            pb = pbs.pop(0)
            kind = "activation_bytes_sent" if i < k_state else "target_bytes_sent"
            parts = split_parts(pb, self.chunk_bytes)
            del pb
            for part in parts:
                msg = runtime_pb2.ExpertRequest(metadata=meta if first else b"", tensors=[part])
                first = False
                self.traffic.add(wire_bytes_sent=msg.ByteSize(), **{kind: len(part.buffer)})
                yield msg
            i += 1
