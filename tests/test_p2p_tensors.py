"""Strict tensor codec, streaming reassembly with caps, and hop header validation (no network)."""
from __future__ import annotations

import pytest
import torch

from blocktrain.p2p.errors import HopRequestError
from blocktrain.p2p.hops import HopLimits, check_hop_headers, check_hop_values, decode_meta, namespace
from blocktrain.p2p.tensors import TensorAssembler, decode_tensor, encode_tensor, split_parts

LIMITS = HopLimits(allowed_blocks=frozenset({0}), max_batch=4, max_seq=512, state_dim=8, vocab_size=256,
                   max_request_bytes=50_000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int64, torch.bool])
def test_round_trip_keeps_dtype_shape_and_bits(dtype):
    t = (torch.randn(3, 5, 7) * 50).to(dtype)
    pb = encode_tensor(t[:, ::2])  # non-contiguous input is fine
    assert len(pb.buffer) == t[:, ::2].numel() * t.element_size()  # bf16 travels as 2 bytes
    out = decode_tensor(pb)
    assert out.dtype == dtype and torch.equal(out, t[:, ::2])
    out.fill_(0)  # writable: a copy, not a view of the read-only message


def test_decode_refuses_lies_about_size_and_dtype():
    pb = encode_tensor(torch.zeros(4, 4))
    pb.buffer = pb.buffer[:-1]
    with pytest.raises(HopRequestError, match="declares 4x4 float32 = 64 bytes but carries 63") as e:
        decode_tensor(pb)
    assert e.value.code == "malformed"
    pb = encode_tensor(torch.zeros(2))
    pb.dtype = "object"
    with pytest.raises(HopRequestError, match="dtype 'object' is not one of") as e:
        decode_tensor(pb)
    assert e.value.code == "bad_dtype"


def test_streamed_parts_reassemble_and_caps_apply_on_the_header():
    big, small = torch.arange(10_000, dtype=torch.float32), torch.ones(3, dtype=torch.int64)
    parts = [*split_parts(encode_tensor(big), 4096), *split_parts(encode_tensor(small), 4096)]
    assert len(parts) == 11
    asm = TensorAssembler(max_total_bytes=50_000)
    for p in parts:
        asm.feed(p)
    a, b = asm.finish()
    assert torch.equal(decode_tensor(a), big) and torch.equal(decode_tensor(b), small)

    capped = TensorAssembler(max_total_bytes=39_999)
    with pytest.raises(HopRequestError, match="declares 40000 bytes, limit is 39999"):
        capped.feed(parts[0])  # refused before any body part arrives
    broken = TensorAssembler(max_total_bytes=50_000)
    with pytest.raises(HopRequestError, match="before any tensor header"):
        broken.feed(parts[1])
    short = TensorAssembler(max_total_bytes=50_000)
    assert short.cut is None
    short.feed(parts[0])
    assert short.cut == "request tensor #0 (10000 float32) ended after 4096 of 40000 bytes"   # a stream cut here
    with pytest.raises(HopRequestError, match="ended after 4096 of 40000 bytes"):
        short.finish()
    for p in parts[1:10]:
        short.feed(p)
    assert short.cut is None
    with pytest.raises(HopRequestError, match="ended after 4096 of 40000 bytes"):
        broken = TensorAssembler(max_total_bytes=50_000)
        broken.feed(parts[0])
        broken.feed(parts[10])     # the next tensor's header before this one's bytes


def _headers(n=1, t=16, d=8, sdt=torch.float32, cdt=torch.uint8, sig=(2,)):
    return [encode_tensor(torch.zeros(n, t, d, dtype=sdt)), encode_tensor(torch.zeros(n, t, dtype=cdt)),
            encode_tensor(torch.zeros(*sig))]


def test_hop_headers_checked_against_limits():
    assert check_hop_headers(_headers(), LIMITS, want_logits=False) == 16 * 8 * 4
    assert check_hop_headers(_headers(), LIMITS, want_logits=True) == 16 * 8 * 4 + 16 * 256 * 4
    assert check_hop_headers(_headers(n=2, sig=(2, 2)), LIMITS, False) > 0
    bad = {
        "bad_dtype": [_headers(sdt=torch.int64), _headers(cdt=torch.float32)],
        "bad_shape": [_headers(n=5), _headers(t=513), _headers(d=9), _headers(sig=(3,)), _headers(n=2, sig=(1, 2))],
        "too_large": [_headers(n=4, t=512)],
        "malformed": [_headers()[:2]],
    }
    for code, cases in bad.items():
        for h in cases:
            with pytest.raises(HopRequestError) as e:
                check_hop_headers(h, LIMITS, False)
            assert e.value.code == code, (code, e.value)


def test_hop_values_and_metadata():
    check_hop_values(torch.tensor([[0, 255]]), torch.tensor([1.0, 0.0]), LIMITS)
    for ctx, sig in [(torch.tensor([[256]]), torch.ones(2)), (torch.tensor([[-1]]), torch.ones(2)),
                     (torch.tensor([[1]]), torch.tensor([float("inf"), 1.0])), (torch.tensor([[1]]), -torch.ones(2))]:
        with pytest.raises(HopRequestError) as e:
            check_hop_values(ctx, sig, LIMITS)
        assert e.value.code == "bad_value"
    with pytest.raises(HopRequestError, match="not JSON"):
        decode_meta(b"\xff")
    with pytest.raises(HopRequestError, match="must be a JSON object"):
        decode_meta(b"[1]")
    assert namespace("run-1", 3) == "bt_run-1_b3"
