"""A raw ``rpc_train`` call from a plain hivemind peer: one request message (metadata + tensors), the
answer's metadata and tensors back, nothing of the node's client (tests that attack a stage)."""
from __future__ import annotations

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from blocktrain.p2p.hops import decode_meta, encode_meta
from blocktrain.p2p.pipeline_rpc import PipelineService
from blocktrain.p2p.pipeline_wire import train_namespace


async def raw_train_call(p2p, peer: str, run: str, block: int, meta: dict, tensors: list) -> tuple[dict, list]:
    async def parts():
        yield runtime_pb2.ExpertRequest(metadata=encode_meta(meta), tensors=tensors)
    stub = PipelineService.get_stub(p2p, PeerID.from_base58(peer), namespace=train_namespace(run, block))
    first, rest = None, []
    async for msg in await stub.rpc_train(parts()):
        first = first or decode_meta(msg.metadata)
        rest += list(msg.tensors)
    return first, rest
