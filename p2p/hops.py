"""The hop protocol: request/response types, limits, metadata encoding and validation.

A forward hop carries, in this order, the tensors ``state`` (N, T, D) float32/float16/bfloat16,
``context`` (N, T) uint8/int64 and ``sigmas`` (2,) or (N, 2) float32/float64, plus JSON metadata
``{"v", "request_id", "block_index", "want_logits"}``. The answer carries ``state`` (same shape and
dtype) and optionally ``logits`` (N, T, V), with metadata ``{"ok": true, ...}`` or
``{"ok": false, "code", "reason"}``. Error codes: malformed, bad_dtype, bad_shape, bad_value,
unknown_block, too_large, use_stream, internal.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from blocktrain.p2p.errors import HopRequestError
from blocktrain.p2p.records import validate_run_id
from blocktrain.p2p.tensors import declared_nbytes, describe

__all__ = [
    "WIRE_VERSION", "HopLimits", "HopRequest", "HopResponse", "namespace", "encode_meta", "decode_meta",
    "parse_request_meta", "check_state_header", "check_hop_headers", "check_hop_values", "check_hop_output",
    "error_response", "estimate_request_bytes", "estimate_response_bytes", "STATE_DTYPES", "CONTEXT_DTYPES",
    "SIGMA_DTYPES",
]

WIRE_VERSION = 1
STATE_DTYPES = ("float32", "float16", "bfloat16")
CONTEXT_DTYPES = ("uint8", "int64")
SIGMA_DTYPES = ("float32", "float64")
MAX_META_BYTES = 64 * 1024
_REQUEST_ID_RE = re.compile(r"^[\x20-\x7e]{0,128}$")


def namespace(run_id: str, block_index: int) -> str:
    """The p2p handler namespace of one block service: ``bt_<run id>_b<block>``."""
    return f"bt_{validate_run_id(run_id)}_b{int(block_index)}"


@dataclass(frozen=True)
class HopLimits:
    """What a server accepts. Everything is checked before the hop handler runs.

    ``allowed_blocks`` may be given as any collection of ints; it is stored as a frozenset.
    """

    allowed_blocks: frozenset[int]
    max_batch: int
    max_seq: int
    state_dim: int
    vocab_size: int
    max_request_bytes: int = 64 << 20
    max_inflight: int = 2
    max_state_streams: int = 2   # block-state downloads served at once by the whole server (each holds a copy)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_blocks", frozenset(int(b) for b in self.allowed_blocks))
        for name in ("max_batch", "max_seq", "state_dim", "vocab_size", "max_request_bytes", "max_inflight",
                     "max_state_streams"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"HopLimits.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class HopRequest:
    block_index: int
    state: torch.Tensor
    context: torch.Tensor
    sigmas: torch.Tensor
    want_logits: bool = False
    request_id: str = ""

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.state, self.context, self.sigmas))


@dataclass
class HopResponse:
    request_id: str
    state: torch.Tensor
    logits: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def encode_meta(d: dict[str, Any]) -> bytes:
    return json.dumps(d, separators=(",", ":"), allow_nan=False).encode()


def decode_meta(raw: bytes, what: str = "metadata") -> dict[str, Any]:
    if len(raw) > MAX_META_BYTES:
        raise HopRequestError("too_large", f"{what} is {len(raw)} bytes, limit is {MAX_META_BYTES}")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HopRequestError("malformed", f"{what} is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise HopRequestError("malformed", f"{what} must be a JSON object, got {type(d).__name__}")
    return d


def error_response(code: str, reason: str, request_id: str = "") -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(
        metadata=encode_meta({"v": WIRE_VERSION, "ok": False, "code": code, "reason": reason, "request_id": request_id})
    )


def parse_request_meta(meta: dict[str, Any], served_block: int, limits: HopLimits) -> tuple[str, int, bool]:
    rid, block, want = meta.get("request_id", ""), meta.get("block_index"), meta.get("want_logits", False)
    if meta.get("v") != WIRE_VERSION:
        raise HopRequestError(
            "malformed", f"wire version {meta.get('v')!r} not supported (this server speaks {WIRE_VERSION})"
        )
    if not isinstance(rid, str) or not _REQUEST_ID_RE.match(rid):
        raise HopRequestError("malformed", "request_id must be a printable ASCII string of at most 128 characters")
    if not isinstance(block, int) or isinstance(block, bool):
        raise HopRequestError("malformed", f"block_index must be an integer, got {block!r}")
    if block != served_block or block not in limits.allowed_blocks:
        raise HopRequestError("unknown_block", f"this service serves block {served_block}, not block {block}")
    if not isinstance(want, bool):
        raise HopRequestError("malformed", f"want_logits must be a boolean, got {want!r}")
    return rid, block, want


def check_state_header(st: runtime_pb2.Tensor, limits: HopLimits) -> tuple[int, int]:
    """Check the state tensor's dtype and (N, T, D) against the limits; returns (N, T)."""
    if st.dtype not in STATE_DTYPES:
        raise HopRequestError("bad_dtype", f"state has dtype {st.dtype!r}; allowed: {', '.join(STATE_DTYPES)}")
    if len(st.size) != 3:
        raise HopRequestError("bad_shape", f"state must be (N, T, D), got {describe(st)}")
    n, t, d = st.size
    if not 1 <= n <= limits.max_batch:
        raise HopRequestError("bad_shape", f"state batch N={n} outside [1, {limits.max_batch}]")
    if not 1 <= t <= limits.max_seq:
        raise HopRequestError("bad_shape", f"state length T={t} outside [1, {limits.max_seq}]")
    if d != limits.state_dim:
        raise HopRequestError("bad_shape", f"state dim D={d} but this block expects D={limits.state_dim}")
    return n, t


def check_hop_headers(tensors: list[runtime_pb2.Tensor], limits: HopLimits, want_logits: bool) -> int:
    """Check dtypes/shapes/sizes from the headers alone; returns the response size in bytes."""
    if len(tensors) != 3:
        raise HopRequestError("malformed", f"expected 3 tensors (state, context, sigmas), got {len(tensors)}")
    st, ctx, sg = tensors
    n, t = check_state_header(st, limits)
    for pb, name, allowed in ((ctx, "context", CONTEXT_DTYPES), (sg, "sigmas", SIGMA_DTYPES)):
        if pb.dtype not in allowed:
            raise HopRequestError("bad_dtype", f"{name} has dtype {pb.dtype!r}; allowed: {', '.join(allowed)}")
    if list(ctx.size) != [n, t]:
        raise HopRequestError("bad_shape", f"context must be (N, T)=({n}, {t}), got {describe(ctx)}")
    if list(sg.size) not in ([2], [n, 2]):
        raise HopRequestError("bad_shape", f"sigmas must be (2,) or (N, 2)=({n}, 2), got {describe(sg)}")
    total = sum(declared_nbytes(pb, name) for pb, name in ((st, "state"), (ctx, "context"), (sg, "sigmas")))
    if total > limits.max_request_bytes:
        raise HopRequestError("too_large", f"request carries {total} bytes, limit is {limits.max_request_bytes}")
    state_bytes = declared_nbytes(st, "state")
    return state_bytes + (n * t * limits.vocab_size * 4 if want_logits else 0)


def check_hop_values(context: torch.Tensor, sigmas: torch.Tensor, limits: HopLimits) -> None:
    """Cheap value checks that guard the model: token ids in range, finite non-negative noise levels."""
    if context.numel() and (int(context.min()) < 0 or int(context.max()) >= limits.vocab_size):
        raise HopRequestError("bad_value", f"context ids must lie in [0, {limits.vocab_size})")
    if not bool(torch.isfinite(sigmas).all()) or bool((sigmas < 0).any()):
        raise HopRequestError("bad_value", "sigmas must be finite and >= 0")


def check_hop_output(state: Any, logits: Any, req_state: torch.Tensor, want_logits: bool, vocab: int) -> None:
    """The server checks its own handler's output before sending it (a bug there is an 'internal' error)."""
    if not isinstance(state, torch.Tensor) or tuple(state.shape) != tuple(req_state.shape):
        got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise HopRequestError("internal", f"hop handler returned state {got}, expected {tuple(req_state.shape)}")
    if want_logits:
        n, t, _ = req_state.shape
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (n, t, vocab):
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise HopRequestError("internal", f"hop handler returned logits {got}, expected {(n, t, vocab)}")


def estimate_request_bytes(req: HopRequest) -> int:
    return req.payload_bytes + 256


def estimate_response_bytes(req: HopRequest, vocab_hint: int) -> int:
    n, t = (req.state.shape[0], req.state.shape[1]) if req.state.dim() == 3 else (0, 0)
    return req.state.numel() * req.state.element_size() + (n * t * vocab_hint * 4 if req.want_logits else 0) + 256
