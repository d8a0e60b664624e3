"""Tensor (de)serialisation for the wire: hivemind's ``runtime_pb2.Tensor`` as the container, strict decoding.

We do not use hivemind's ``deserialize_torch_tensor``: it trusts the sender's dtype string and buffer
length. Here every header (dtype, shape) is checked against an allow-list and the byte count is
known *before* any buffer is accepted or any tensor allocated, so a hostile or buggy peer gets a
clear error instead of costing us memory or compute. bfloat16 travels as its raw 2 bytes.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from hivemind.proto import runtime_pb2

from blocktrain.p2p.errors import HopRequestError

__all__ = [
    "DTYPES", "MAX_NDIM", "DEFAULT_CHUNK_BYTES", "encode_tensor", "decode_tensor", "declared_nbytes",
    "describe", "split_parts", "TensorAssembler",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_NDIM = 8
DEFAULT_CHUNK_BYTES = 1 << 20


def encode_tensor(t: torch.Tensor) -> runtime_pb2.Tensor:
    """CPU tensor -> protobuf (raw little-endian bytes, no compression)."""
    if t.dtype not in _NAMES:
        raise HopRequestError("bad_dtype", f"dtype {t.dtype} cannot be sent; allowed: {', '.join(DTYPES)}")
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return runtime_pb2.Tensor(
        buffer=raw.numpy().tobytes(), size=list(t.shape), dtype=_NAMES[t.dtype],
        compression=runtime_pb2.CompressionType.NONE,
    )


def describe(pb: runtime_pb2.Tensor) -> str:
    return f"{'x'.join(map(str, pb.size)) or 'scalar'} {pb.dtype or '?'}"


def declared_nbytes(pb: runtime_pb2.Tensor, what: str = "tensor") -> int:
    """Bytes a tensor header promises, after checking dtype, compression and shape; raises HopRequestError."""
    if pb.compression != runtime_pb2.CompressionType.NONE:
        raise HopRequestError("bad_dtype", f"{what}: compressed tensors are not accepted")
    if pb.dtype not in DTYPES:
        raise HopRequestError("bad_dtype", f"{what}: dtype {pb.dtype!r} is not one of {', '.join(DTYPES)}")
    if len(pb.size) > MAX_NDIM:
        raise HopRequestError("bad_shape", f"{what}: {len(pb.size)} dimensions, at most {MAX_NDIM} allowed")
    itemsize = torch.empty((), dtype=DTYPES[pb.dtype]).element_size()
    return math.prod(pb.size) * itemsize


def decode_tensor(pb: runtime_pb2.Tensor, what: str = "tensor") -> torch.Tensor:
    """Protobuf -> writable CPU tensor; the buffer must hold exactly the declared bytes."""
    expected = declared_nbytes(pb, what)
    if len(pb.buffer) != expected:
        raise HopRequestError(
            "malformed", f"{what} declares {describe(pb)} = {expected} bytes but carries {len(pb.buffer)} bytes"
        )
    dtype = DTYPES[pb.dtype]
    shape = tuple(pb.size)
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    wire_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(pb.buffer), dtype=wire_dtype)
    if dtype == torch.bfloat16:
        flat = flat.view(torch.bfloat16)
    return flat.reshape(shape)


def split_parts(pb: runtime_pb2.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[runtime_pb2.Tensor]:
    """Header part (dtype, shape, first chunk) then buffer-only parts, for streaming."""
    buf = memoryview(pb.buffer)
    yield runtime_pb2.Tensor(
        buffer=buf[:chunk_bytes].tobytes(), size=pb.size, dtype=pb.dtype, compression=pb.compression,
        chunks=max(1, math.ceil(len(buf) / chunk_bytes)),
    )
    for start in range(chunk_bytes, len(buf), chunk_bytes):
        yield runtime_pb2.Tensor(buffer=buf[start : start + chunk_bytes].tobytes())


class TensorAssembler:
    """Rebuilds tensors from streamed parts, refusing as soon as declared or received bytes pass a cap."""

    def __init__(self, max_total_bytes: int, max_tensors: int = 64, what: str = "request"):
        self.max_total_bytes = max_total_bytes
        self.max_tensors = max_tensors
        self.what = what
        self._done: list[runtime_pb2.Tensor] = []
        self._cur: runtime_pb2.Tensor | None = None
        self._cur_parts: list[bytes] = []
        self._cur_expected = 0
        self._cur_received = 0
        self.total_declared = 0

    @property
    def headers(self) -> list[runtime_pb2.Tensor]:
        """Headers seen so far (finished tensors plus the one being received)."""
        return [*self._done, *([self._cur] if self._cur is not None else [])]

    def feed(self, part: runtime_pb2.Tensor) -> None:
        if part.dtype:  # header of a new tensor
            self._close_current()
            if len(self._done) >= self.max_tensors:
                raise HopRequestError("too_large", f"{self.what} has more than {self.max_tensors} tensors")
            n = declared_nbytes(part, f"{self.what} tensor #{len(self._done)}")
            self.total_declared += n
            if self.total_declared > self.max_total_bytes:
                raise HopRequestError(
                    "too_large", f"{self.what} declares {self.total_declared} bytes, limit is {self.max_total_bytes}"
                )
            self._cur, self._cur_parts, self._cur_expected, self._cur_received = part, [], n, 0
        elif self._cur is None:
            raise HopRequestError("malformed", f"{self.what}: tensor data arrived before any tensor header")
        self._cur_received += len(part.buffer)
        if self._cur_received > self._cur_expected:
            raise HopRequestError(
                "malformed", f"{self.what} tensor #{len(self._done)} carries more bytes than its header declares"
            )
        self._cur_parts.append(part.buffer)

    @property
    def cut(self) -> str | None:
        """Where the parts fed so far stop inside a tensor (None: at a tensor's end): a stream that
        ends here was cut off, or its sender is broken."""
        if self._cur is None or self._cur_received == self._cur_expected:
            return None
        return (f"{self.what} tensor #{len(self._done)} ({describe(self._cur)}) ended after "
                f"{self._cur_received} of {self._cur_expected} bytes")

    def _close_current(self) -> None:
        if self._cur is None:
            return
        if self.cut is not None:
            raise HopRequestError("malformed", self.cut)
        whole = runtime_pb2.Tensor(size=self._cur.size, dtype=self._cur.dtype, compression=self._cur.compression)
        whole.buffer = b"".join(self._cur_parts)
        self._done.append(whole)
        self._cur, self._cur_parts = None, []

    def finish(self) -> list[runtime_pb2.Tensor]:
        self._close_current()
        return self._done
