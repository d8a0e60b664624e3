"""The pipeline training wire (no network): codecs and their sizes, and the validation every
request and answer passes before model code runs (typed errors, nothing decoded on a bad header)."""
from __future__ import annotations

import pytest
import torch

from blocktrain.node.pipeline.settings import CODECS as SETTINGS_CODECS
from blocktrain.p2p.errors import HopRequestError
from blocktrain.p2p.hops import decode_meta
from blocktrain.p2p.pipeline_wire import (
    CODECS, PipelineLimits, StageRequest, StageResponse, decode_request, decode_response, encode_activation,
    request_message, response_message,
)
from blocktrain.p2p.tensors import encode_tensor

N, T, D = 3, 8, 16
LIMITS = PipelineLimits(allowed_blocks={1}, n_blocks=4, mode="backprop", max_batch=8, max_seq=16, d_model=D)


def x(scale=1.0, seed=0):
    return torch.randn(N, T, D, generator=torch.Generator().manual_seed(seed)) * scale


def request(codec="fp32", state=None, **kw):
    return StageRequest(1, x() if state is None else state, torch.randint(0, 256, (N, T)), "backprop", codec,
                        deadline_s=30.0, request_id="r1", **kw)


def roundtrip(req):
    meta, pbs, act, tgt = request_message(req)
    return decode_request(decode_meta(meta), pbs, 1, LIMITS), act, tgt


def test_codecs_cost_what_they_say_and_keep_the_values():
    assert SETTINGS_CODECS == CODECS
    want = {"fp32": 4 * N * T * D, "fp16": 2 * N * T * D, "8bit": N * T * D + 8 * N * T}
    for codec in CODECS:
        req = request(codec)
        got, act, tgt = roundtrip(req)
        assert act == want[codec] and tgt == N * T            # targets travel as uint8
        assert torch.equal(got.targets, req.targets) and got.targets.dtype == torch.int64
        err = (got.state - x()).abs()
        if codec == "fp32":
            assert torch.equal(got.state, x())
        elif codec == "fp16":
            assert float(err.max()) <= 1e-3 * float(x().abs().max())
        else:   # within half a quantization step of each vector
            step = (x().amax(-1, keepdim=True) - x().amin(-1, keepdim=True)) / 255
            assert bool((err <= step / 2 + 1e-6).all())
    # gradients are tiny: the fp16 scale keeps them from flushing to zero
    g = x(scale=1e-9)
    enc = encode_activation(g, "fp16")
    assert enc.meta["scale"] == pytest.approx(float(g.abs().max()))
    got, _, _ = roundtrip(request("fp16", state=g))
    assert float((got.state - g).abs().max()) <= 1e-3 * float(g.abs().max())


def test_a_flushed_micro_batch_carries_its_origin_and_window():
    got, _, _ = roundtrip(request(origin="QmOrigin", window=41))
    assert (got.origin, got.window) == ("QmOrigin", 41)
    got, _, _ = roundtrip(request())           # not flushed: no window on the wire
    assert got.window is None and "window" not in decode_meta(request_message(request())[0])


def test_a_non_finite_state_is_never_sent():
    bad = x()
    bad[0, 0, 0] = float("inf")
    with pytest.raises(HopRequestError) as e:
        request_message(request(state=bad))
    assert e.value.code == "bad_value"


def meta_and_tensors(**change):
    meta, pbs, _, _ = request_message(request())
    m = decode_meta(meta)
    m.update(change.pop("meta", {}))
    for i, pb in change.pop("tensors", {}).items():
        pbs[i] = pb
    return m, pbs


@pytest.mark.parametrize("change,code", [
    (dict(tensors={0: encode_tensor(torch.randn(N, T, D + 1))}), "bad_shape"),          # wrong D
    (dict(tensors={0: encode_tensor(torch.randn(N, T, D, dtype=torch.float64))}), "bad_dtype"),
    (dict(tensors={0: encode_tensor(torch.full((N, T, D), float("nan")))}), "bad_value"),
    (dict(tensors={0: encode_tensor(torch.randn(9, T, D))}), "bad_shape"),               # batch over the limit
    (dict(tensors={1: encode_tensor(torch.zeros(N, T, dtype=torch.int32))}), "bad_dtype"),
    (dict(tensors={1: encode_tensor(torch.full((N, T), 300, dtype=torch.int64))}), "bad_value"),
    (dict(tensors={1: encode_tensor(torch.zeros(N, T + 1, dtype=torch.uint8))}), "bad_shape"),
    (dict(meta={"mode": "streamed"}), "bad_value"),
    (dict(meta={"block_index": 2}), "unknown_block"),
    (dict(meta={"deadline_s": 1e9}), "malformed"),
    (dict(meta={"codec": "zip"}), "malformed"),
    (dict(meta={"v": 99}), "malformed"),
    (dict(meta={"codec": "fp16"}), "bad_dtype"),                                          # float32 sent as fp16
    (dict(meta={"window": -1}), "malformed"),
    (dict(meta={"window": 2**53}), "malformed"),
    (dict(meta={"window": "7"}), "malformed"),
    (dict(meta={"window": True}), "malformed"),
    (dict(meta={"window": 1.5}), "malformed"),
])
def test_bad_requests_are_refused_with_a_typed_error(change, code):
    m, pbs = meta_and_tensors(**change)
    with pytest.raises(HopRequestError) as e:
        decode_request(m, pbs, 1, LIMITS)
    assert e.value.code == code, e.value


def test_8bit_and_fp16_parameters_are_checked():
    meta, pbs, _, _ = request_message(request("8bit"))
    q = torch.zeros(N, T, 2)
    q[..., 1] = -1.0
    with pytest.raises(HopRequestError, match="step >= 0") as e:
        decode_request(decode_meta(meta), [pbs[0], encode_tensor(q), pbs[2]], 1, LIMITS)
    assert e.value.code == "bad_value"
    meta, pbs, _, _ = request_message(request("fp16"))
    m = decode_meta(meta)
    m["scale"] = -2.0
    with pytest.raises(HopRequestError) as e:
        decode_request(m, pbs, 1, LIMITS)
    assert e.value.code == "bad_value"
    with pytest.raises(HopRequestError) as e:
        decode_request(decode_meta(meta), pbs[:1], 1, LIMITS)
    assert e.value.code == "malformed"


def test_answers_are_validated_against_the_request():
    req = request()
    good = StageResponse("r1", x(seed=1) * 1e-4, 2.5, {3: 2.5}, ["peerA", "peerB"])
    for codec in CODECS:
        req.codec = codec
        meta, pbs, nbytes = response_message(good, codec)
        back = decode_response(decode_meta(meta), pbs, req, LIMITS)
        assert back.loss == 2.5 and back.losses == {3: 2.5} and back.route == ["peerA", "peerB"]
        assert back.grad.shape == (N, T, D) and nbytes == sum(len(p.buffer) for p in pbs)
    req.codec = "fp32"
    for bad, what in ((StageResponse("r1", torch.randn(N, T + 1, D)), "gradient"),
                      (StageResponse("other", x()), "answer is for request")):
        meta, pbs, _ = response_message(bad, "fp32")
        with pytest.raises(HopRequestError, match=what):
            decode_response(decode_meta(meta), pbs, req, LIMITS)
    meta, pbs, _ = response_message(good, "fp32")
    pbs = [encode_tensor(torch.full((N, T, D), float("nan")))]
    with pytest.raises(HopRequestError, match="NaN"):
        decode_response(decode_meta(meta), pbs, req, LIMITS)
