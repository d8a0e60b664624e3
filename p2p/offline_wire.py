"""The wire's transformations replayed in one process, without a network (for benchmarks and tests).

- ``codec_round_trip``: what a peer receives when a tensor is sent with one of hivemind's codecs;
- ``butterfly_average``: hivemind 1.1.12's all-reduce of replicas' tensors, codec applied where it is;
- ``pipeline_call_round_trip``: one pipeline hand-off's encode / protobuf / decode, both ways.

They live here because hivemind does (p2p/ is its only home): ``bench compression`` and
``bench/pipeline_hop_cost.py`` call them.
"""
from __future__ import annotations

import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionInfo
from hivemind.proto import runtime_pb2

from blocktrain.p2p.hops import decode_meta
from blocktrain.p2p.pipeline_wire import (
    PipelineLimits, StageRequest, StageResponse, decode_request, decode_response, request_message, response_message,
)
from blocktrain.p2p.tensors import DEFAULT_CHUNK_BYTES, TensorAssembler, split_parts


def codec_round_trip(codec, tensor: torch.Tensor) -> torch.Tensor:
    """What a peer receives when ``tensor`` is sent with hivemind ``codec`` (encode, then decode)."""
    return codec.extract(codec.compress(tensor, CompressionInfo.from_tensor(tensor))).to(tensor.dtype)


def butterfly_average(replicas: list[list[torch.Tensor]], codec) -> list[list[torch.Tensor]]:
    """Each replica's result of one equal-weight all-reduce of its tensors, as hivemind 1.1.12 runs it.

    hivemind's ``TensorPartContainer`` cuts the concatenated tensors into parts (~512 KiB of encoded
    values each) and gives each of the g peers a contiguous range to reduce. For a part reduced by
    peer j: every other peer r sends its copy encoded, j averages them with its own exact copy, and
    sends r back the DELTA ``average - (what r sent, as decoded)``, encoded; r adds it to its own
    copy. So j ends with the exact average and the others with the average up to two codec errors."""
    g = len(replicas)
    flats = [[t.detach().float() for t in tensors] for tensors in replicas]
    parts = [[TensorPartContainer(f, [1.0] * g, compression=codec).get_raw_input_parts(j) for j in range(g)]
             for f in flats]                                           # parts[r][j][i]: r's copy of j's part i
    out_flat: list[list[torch.Tensor]] = [[] for _ in range(g)]
    for j in range(g):
        for i in range(len(parts[j][j])):
            sent = [parts[r][j][i] if r == j else codec_round_trip(codec, parts[r][j][i]) for r in range(g)]
            average = torch.stack(sent).mean(0)
            for r in range(g):
                out_flat[r].append(average if r == j else parts[r][j][i] + codec_round_trip(codec, average - sent[r]))
    out = []
    for r in range(g):
        flat = torch.cat(out_flat[r])
        sizes = [t.numel() for t in replicas[r]]
        out.append([x.view_as(t).to(t.dtype) for x, t in zip(flat.split(sizes), replicas[r])])
    return out


def pipeline_call_round_trip(h: torch.Tensor, y: torch.Tensor, codec: str, lim: PipelineLimits) -> None:
    """One ``rpc_train`` hand-off both ways without a network: encode, split into parts, protobuf
    serialise and parse as hivemind's stream does, reassemble and decode the request; the same for the
    answer. What our Python costs per hop, beside the daemons and sockets."""
    req = StageRequest(1, h, y, "backprop", codec, deadline_s=30.0, request_id="r", origin="")
    meta, pbs, _, _ = request_message(req)
    parts = [part for pb in pbs for part in split_parts(pb, DEFAULT_CHUNK_BYTES)]
    wire = [runtime_pb2.ExpertRequest(metadata=meta if i == 0 else b"", tensors=[p]).SerializeToString()
            for i, p in enumerate(parts)]
    got = [runtime_pb2.ExpertRequest.FromString(w) for w in wire]
    asm = TensorAssembler(lim.max_request_bytes, max_tensors=3, what="request")
    for m in got:
        for part in m.tensors:
            asm.feed(part)
    decode_request(decode_meta(got[0].metadata, "request"), asm.finish(), 1, lim)
    meta2, pbs2, _ = response_message(StageResponse("r", h, 1.0, {1: 1.0}, ["peer"]), codec)
    answer = runtime_pb2.ExpertResponse.FromString(
        runtime_pb2.ExpertResponse(metadata=meta2, tensors=pbs2).SerializeToString())
    asm2 = TensorAssembler(lim.max_request_bytes, max_tensors=2, what="answer")
    for part in answer.tensors:
        asm2.feed(part)
    decode_response(decode_meta(answer.metadata, "answer"), asm2.finish(), req, lim)
