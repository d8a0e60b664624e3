"""The pipeline training protocol (issue 13): message formats, activation codecs and validation.

One call per micro-batch and stage, ``rpc_train`` (handler in ``pipeline_rpc.py``), streamed both
ways in parts of ``DEFAULT_CHUNK_BYTES``. The first request message carries JSON metadata::

    {"v": 1, "request_id": str, "block_index": b, "mode": "backprop" | "streamed",
     "codec": "fp32" | "fp16" | "8bit", "deadline_s": seconds the caller waits (0 < d <= 600),
     "scale": float (fp16 only), "origin": peer id of the block-0 holder (optional),
     "window": int (optional: the block-0 holder's window of micro-batches, GPipe flush; a stage
     steps its optimizer when a micro-batch of a new (origin, window) arrives)}

then the tensors: the state h_{b-1} (N, T, D) as the codec sends it, then ``targets`` (N, T) uint8 or
int64 (the next bytes, for the losses). The answer's first message carries
``{"v", "ok": true, "request_id", "codec", "scale" (fp16), "loss": the chain's (backprop) or the last
block's (streamed) loss or null, "losses": [[block, loss], ...], "route": [peer ids, stage b first]}``
and, in backprop mode, the gradient dL/dh_{b-1} (N, T, D) in the request's codec; or
``{"v", "ok": false, "code", "reason", "request_id"}``.

Codecs (activations and gradients alike), with their bytes on the wire per (N, T, D) tensor:

* ``fp32``: one float32 tensor, 4 N T D bytes;
* ``fp16``: one float16 tensor of x / scale, scale = max |x| in the metadata, 2 N T D bytes (the
  scale keeps small gradients from flushing to zero in half precision);
* ``8bit``: uint8 codes (N, T, D) and float32 ``qparams`` (N, T, 2) = (low, step) per vector,
  x ~ low + code * step: N T D + 8 N T bytes.

Error codes: malformed, bad_dtype, bad_shape, bad_value, unknown_block, too_large, busy (the stage
holds as many micro-batches as it may), downstream (a later stage failed), timeout, unauthorized,
internal. A request is checked field by field before any model code runs: metadata, tensor count,
dtypes, shapes against the limits, byte size, then values (finite state, sane qparams, byte ids).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from blocktrain.p2p.errors import HopRequestError
from blocktrain.p2p.hops import WIRE_VERSION, encode_meta
from blocktrain.p2p.records import validate_run_id
from blocktrain.p2p.tensors import declared_nbytes, decode_tensor, describe, encode_tensor

__all__ = ["CODECS", "MODES", "PipelineLimits", "StageRequest", "SentRequest", "StageResponse", "Encoded",
           "encode_activation", "decode_activation", "activation_tensors", "request_message",
           "parse_request_meta", "check_request_headers", "decode_request", "response_message",
           "decode_response", "payload_bytes", "train_namespace"]

CODECS = ("fp32", "fp16", "8bit")
MODES = ("backprop", "streamed")
TARGET_DTYPES = ("uint8", "int64")
MAX_DEADLINE_S = 600.0
MAX_ROUTE = 64
MAX_WINDOW = 2**53           # window ids are JSON integers: exact in a double


def train_namespace(run_id: str, block_index: int) -> str:
    """Handler namespace of one block's pipeline service: ``bt_<run>_t<block>``."""
    return f"bt_{validate_run_id(run_id)}_t{int(block_index)}"


@dataclass(frozen=True)
class PipelineLimits:
    """What a stage accepts; everything is checked before the stage handler runs."""

    allowed_blocks: frozenset[int]
    n_blocks: int
    mode: str
    max_batch: int
    max_seq: int
    d_model: int
    vocab_size: int = 256
    max_request_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_blocks", frozenset(int(b) for b in self.allowed_blocks))
        if self.mode not in MODES:
            raise ValueError(f"PipelineLimits.mode must be one of {MODES}, got {self.mode!r}")
        for name in ("n_blocks", "max_batch", "max_seq", "d_model", "vocab_size", "max_request_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"PipelineLimits.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class StageRequest:
    block_index: int
    state: torch.Tensor           # (N, T, D) float32, decoded
    targets: torch.Tensor         # (N, T) int64
    mode: str
    codec: str = "fp32"           # how the state travelled; the gradient goes back the same way
    deadline_s: float = 60.0      # how long the caller waits for the answer
    request_id: str = ""
    origin: str = ""
    window: int | None = None     # the block-0 holder's window (--pipeline-flush); None: not windowed

    @property
    def state_shape(self) -> tuple[int, ...]:
        return tuple(self.state.shape)

    def sent(self) -> "SentRequest":
        """What checking the answer needs of this request, without its tensors: a caller keeps this
        while it waits, so the state it sent is not held here for the whole call."""
        return SentRequest(int(self.block_index), self.mode, self.codec, self.request_id, self.state_shape)


@dataclass(frozen=True)
class SentRequest:
    """A request already on its way: the fields its answer is checked against (no tensors)."""
    block_index: int
    mode: str
    codec: str
    request_id: str
    state_shape: tuple[int, ...]


@dataclass
class StageResponse:
    request_id: str
    grad: torch.Tensor | None = None            # dL/d state (N, T, D) float32, backprop only
    loss: float | None = None
    losses: dict[int, float] = field(default_factory=dict)
    route: list[str] = field(default_factory=list)


@dataclass
class Encoded:
    tensors: list[runtime_pb2.Tensor]
    meta: dict[str, Any]
    nbytes: int                   # tensor payload bytes (what the codec costs on the wire)


def payload_bytes(pbs: list[runtime_pb2.Tensor]) -> int:
    return sum(len(pb.buffer) for pb in pbs)


def activation_tensors(codec: str) -> int:
    """How many wire tensors one activation or gradient takes in ``codec``."""
    return 2 if codec == "8bit" else 1


def encode_activation(x: torch.Tensor, codec: str) -> Encoded:
    """(N, T, D) float tensor -> wire tensors in ``codec``; a non-finite tensor is not sent."""
    if codec not in CODECS:
        raise HopRequestError("malformed", f"codec {codec!r} is not one of {', '.join(CODECS)}")
    x = x.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(x).all()):
        raise HopRequestError("bad_value", "refusing to send a tensor holding NaN or Inf")
    if codec == "fp32":
        pbs, meta = [encode_tensor(x)], {}
    elif codec == "fp16":
        scale = float(x.abs().max()) if x.numel() else 0.0
        scale = scale if scale > 0 else 1.0
        pbs, meta = [encode_tensor((x / scale).to(torch.float16))], {"scale": scale}
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        step = (hi - lo) / 255.0
        codes = torch.where(step > 0, (x - lo) / torch.where(step > 0, step, 1.0), 0.0).round().clamp_(0, 255)
        pbs, meta = [encode_tensor(codes.to(torch.uint8)), encode_tensor(torch.cat([lo, step], -1))], {}
    return Encoded(pbs, meta, payload_bytes(pbs))


def _check_state_headers(pbs: list[runtime_pb2.Tensor], codec: str, limits: PipelineLimits,
                         shape: tuple[int, ...] | None, what: str) -> tuple[int, int]:
    """dtype and shape checks of an activation's wire tensors; returns (N, T)."""
    st = pbs[0]
    want = {"fp32": "float32", "fp16": "float16", "8bit": "uint8"}[codec]
    if st.dtype != want:
        raise HopRequestError("bad_dtype", f"{what} has dtype {st.dtype!r}; codec {codec} sends {want}")
    if len(st.size) != 3:
        raise HopRequestError("bad_shape", f"{what} must be (N, T, D), got {describe(st)}")
    n, t, d = st.size
    if shape is not None and tuple(st.size) != tuple(shape):
        raise HopRequestError("bad_shape", f"{what} is {describe(st)}, expected {'x'.join(map(str, shape))}")
    if not 1 <= n <= limits.max_batch:
        raise HopRequestError("bad_shape", f"{what} batch N={n} outside [1, {limits.max_batch}]")
    if not 1 <= t <= limits.max_seq:
        raise HopRequestError("bad_shape", f"{what} length T={t} outside [1, {limits.max_seq}]")
    if d != limits.d_model:
        raise HopRequestError("bad_shape", f"{what} dim D={d} but this block expects D={limits.d_model}")
    if codec == "8bit":
        q = pbs[1]
        if q.dtype != "float32":
            raise HopRequestError("bad_dtype", f"{what} qparams have dtype {q.dtype!r}, expected float32")
        if list(q.size) != [n, t, 2]:
            raise HopRequestError("bad_shape", f"{what} qparams must be ({n}, {t}, 2), got {describe(q)}")
    return n, t


def decode_activation(pbs: list[runtime_pb2.Tensor], codec: str, meta: dict[str, Any], what: str) -> torch.Tensor:
    """Wire tensors (headers already checked) -> a finite float32 (N, T, D) tensor, else bad_value."""
    if codec == "fp32":
        x = decode_tensor(pbs[0], what).float()
    elif codec == "fp16":
        scale = meta.get("scale")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
            raise HopRequestError("bad_value", f"{what}: fp16 needs a finite positive 'scale', got {scale!r}")
        x = decode_tensor(pbs[0], what).float() * float(scale)
    else:
        codes, q = decode_tensor(pbs[0], what), decode_tensor(pbs[1], f"{what} qparams")
        if not bool(torch.isfinite(q).all()) or bool((q[..., 1] < 0).any()):
            raise HopRequestError("bad_value", f"{what}: qparams must be finite with step >= 0")
        x = q[..., :1] + codes.float() * q[..., 1:]
    if not bool(torch.isfinite(x).all()):
        raise HopRequestError("bad_value", f"{what} holds NaN or Inf")
    return x


# -- requests -------------------------------------------------------------------------------------
def request_message(req: StageRequest) -> tuple[bytes, list[runtime_pb2.Tensor], int, int]:
    """(metadata, tensors, activation bytes, target bytes) of a request."""
    enc = encode_activation(req.state, req.codec)
    y = req.targets
    as_bytes = y.numel() == 0 or (int(y.min()) >= 0 and int(y.max()) < 256)   # byte ids travel as uint8
    targets = encode_tensor(y.to(torch.uint8) if as_bytes else y.to(torch.int64))
    meta = {"v": WIRE_VERSION, "request_id": req.request_id, "block_index": int(req.block_index),
            "mode": req.mode, "codec": req.codec, "deadline_s": float(req.deadline_s), **enc.meta}
    if req.origin:
        meta["origin"] = req.origin
    if req.window is not None:
        meta["window"] = int(req.window)
    return encode_meta(meta), [*enc.tensors, targets], enc.nbytes, len(targets.buffer)


def parse_request_meta(meta: dict[str, Any], served_block: int, limits: PipelineLimits) -> str:
    """Check a request's metadata; returns its request id."""
    rid, block = meta.get("request_id", ""), meta.get("block_index")
    if meta.get("v") != WIRE_VERSION:
        raise HopRequestError("malformed", f"wire version {meta.get('v')!r} not supported (this node speaks {WIRE_VERSION})")
    if not isinstance(rid, str) or len(rid) > 128 or not rid.isprintable():
        raise HopRequestError("malformed", "request_id must be a printable string of at most 128 characters")
    if not isinstance(block, int) or isinstance(block, bool):
        raise HopRequestError("malformed", f"block_index must be an integer, got {block!r}")
    if block != served_block or block not in limits.allowed_blocks:
        raise HopRequestError("unknown_block", f"this service trains block {served_block}, not block {block}")
    if block == 0:
        raise HopRequestError("unknown_block", "block 0 reads its own data: it takes no activations")
    if meta.get("mode") != limits.mode:
        raise HopRequestError("bad_value", f"this run trains in mode {limits.mode!r}, not {meta.get('mode')!r}")
    if meta.get("codec") not in CODECS:
        raise HopRequestError("malformed", f"codec must be one of {', '.join(CODECS)}, got {meta.get('codec')!r}")
    d = meta.get("deadline_s")
    if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0 < d <= MAX_DEADLINE_S:
        raise HopRequestError("malformed", f"deadline_s must be a number in (0, {MAX_DEADLINE_S:.0f}], got {d!r}")
    origin = meta.get("origin", "")
    if not isinstance(origin, str) or len(origin) > 128:
        raise HopRequestError("malformed", "origin must be a peer id string")
    window = meta.get("window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or not 0 <= window < MAX_WINDOW):
        raise HopRequestError("malformed", f"window must be an integer in [0, 2**53), got {window!r}")
    return rid


def check_request_headers(pbs: list[runtime_pb2.Tensor], codec: str, limits: PipelineLimits) -> None:
    """Tensor count, dtypes, shapes and total size, from the headers alone."""
    k = activation_tensors(codec)
    if len(pbs) != k + 1:
        raise HopRequestError("malformed", f"codec {codec} requests carry {k + 1} tensors, got {len(pbs)}")
    n, t = _check_state_headers(pbs[:k], codec, limits, None, "state")
    tg = pbs[k]
    if tg.dtype not in TARGET_DTYPES:
        raise HopRequestError("bad_dtype", f"targets have dtype {tg.dtype!r}; allowed: {', '.join(TARGET_DTYPES)}")
    if list(tg.size) != [n, t]:
        raise HopRequestError("bad_shape", f"targets must be (N, T)=({n}, {t}), got {describe(tg)}")
    total = sum(declared_nbytes(pb, "request tensor") for pb in pbs)
    if total > limits.max_request_bytes:
        raise HopRequestError("too_large", f"request carries {total} bytes, limit is {limits.max_request_bytes}")


def decode_request(meta: dict[str, Any], pbs: list[runtime_pb2.Tensor], served_block: int,
                   limits: PipelineLimits) -> StageRequest:
    """A fully validated request (metadata, headers, then values)."""
    rid = parse_request_meta(meta, served_block, limits)
    codec = meta["codec"]
    check_request_headers(pbs, codec, limits)
    k = activation_tensors(codec)
    state = decode_activation(pbs[:k], codec, meta, "state")
    targets = decode_tensor(pbs[k], "targets").to(torch.int64)
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= limits.vocab_size):
        raise HopRequestError("bad_value", f"target byte ids must lie in [0, {limits.vocab_size})")
    return StageRequest(served_block, state, targets, meta["mode"], codec, float(meta["deadline_s"]), rid,
                        meta.get("origin", ""), meta.get("window"))


# -- responses ------------------------------------------------------------------------------------
def response_message(resp: StageResponse, codec: str) -> tuple[bytes, list[runtime_pb2.Tensor], int]:
    """(metadata, tensors, gradient bytes) of a successful answer."""
    enc = encode_activation(resp.grad, codec) if resp.grad is not None else Encoded([], {}, 0)
    meta = {"v": WIRE_VERSION, "ok": True, "request_id": resp.request_id, "codec": codec,
            "loss": _finite_or_none(resp.loss), "losses": [[int(b), float(v)] for b, v in resp.losses.items()
                                                             if math.isfinite(v)],
            "route": list(resp.route)[:MAX_ROUTE], **enc.meta}
    return encode_meta(meta), enc.tensors, enc.nbytes


def decode_response(meta: dict[str, Any], pbs: list[runtime_pb2.Tensor], req: StageRequest | SentRequest,
                    limits: PipelineLimits) -> StageResponse:
    """Validate a successful answer to ``req`` (raises HopRequestError 'bad_response')."""
    def bad(msg: str) -> HopRequestError:
        return HopRequestError("bad_response", msg)
    if meta.get("request_id") != req.request_id:
        raise bad(f"answer is for request {meta.get('request_id')!r}, not {req.request_id!r}")
    loss = meta.get("loss")
    if loss is not None and (not isinstance(loss, (int, float)) or isinstance(loss, bool) or not math.isfinite(loss)):
        raise bad(f"loss {loss!r} is not a finite number")
    losses, route = meta.get("losses", []), meta.get("route", [])
    if not isinstance(losses, list) or len(losses) > limits.n_blocks or not all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and not isinstance(x[0], bool)
            and isinstance(x[1], (int, float)) and math.isfinite(x[1]) for x in losses):
        raise bad("losses must be a list of [block, finite loss] pairs")
    if not isinstance(route, list) or len(route) > MAX_ROUTE or not all(isinstance(p, str) and len(p) <= 128
                                                                          for p in route):
        raise bad("route must be a list of peer ids")
    grad = None
    if req.mode == "backprop":
        k = activation_tensors(req.codec)
        if meta.get("codec") != req.codec or len(pbs) != k:
            raise bad(f"a {req.codec} gradient takes {k} tensor(s), got {len(pbs)} ({meta.get('codec')!r})")
        _check_state_headers(pbs, req.codec, limits, req.state_shape, "gradient")
        grad = decode_activation(pbs, req.codec, meta, "gradient")
    elif pbs:
        raise bad("a streamed-mode answer carries no tensors")
    return StageResponse(req.request_id, grad, None if loss is None else float(loss),
                         {int(b): float(v) for b, v in losses}, route)


def _finite_or_none(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None
