"""The two hop adapters, side by side: a block's hop as the model sees it (``blocks.chain``) and as
the wire carries it (``p2p.hops``).

* caller side, :func:`call_remote`: a model hop request for block b goes out as one typed wire
  request to a holder, and its (already validated, see ``HopClient.forward``) answer comes back
  as a model hop result;
* server side, :func:`serve_local`: a wire request arriving for our block runs the local hop.

The wire form carries the two noise levels as one (N, 2) ``sigmas`` tensor; everything else maps
field for field.
"""
from __future__ import annotations

import concurrent.futures

import torch

from blocktrain.blocks.chain import Hop, HopRequest, HopResult
from blocktrain.p2p import hops as wire
from blocktrain.p2p.rpc_client import HopClient
from blocktrain.p2p.rpc_server import HopHandler


def to_wire(block_index: int, req: HopRequest) -> wire.HopRequest:
    return wire.HopRequest(block_index=block_index, state=req.state.float().contiguous(),
                           context=req.context.to(torch.int64).contiguous(),
                           sigmas=torch.stack([req.sigma, req.sigma_next], dim=-1).float(),
                           want_logits=req.want_logits)


def from_wire(req: wire.HopRequest) -> HopRequest:
    s = req.sigmas.reshape(-1, 2).float()
    n = req.state.shape[0]
    if s.shape[0] == 1:
        s = s.expand(n, 2)
    return HopRequest(req.state.float(), req.context.long(), s[:, 0].contiguous(), s[:, 1].contiguous(),
                      req.want_logits)


def call_remote(client: HopClient, peer: str, block_index: int, req: HopRequest,
                timeout: float) -> tuple[HopResult, int, int]:
    """Run block ``block_index`` of ``req`` on ``peer``; returns (result, bytes sent, bytes received)."""
    return start_remote(client, peer, block_index, req, timeout).result()


def start_remote(client: HopClient, peer: str, block_index: int, req: HopRequest,
                 timeout: float) -> concurrent.futures.Future:
    """:func:`call_remote` without waiting: a future of (result, bytes sent, bytes received),
    cancellable (the router races holders it has not measured yet)."""
    w = to_wire(block_index, req)

    async def run():
        return _from_response(req, w, await client.forward(peer, w, timeout=timeout))
    return client.loop.submit(run())


def _from_response(req: HopRequest, w: wire.HopRequest, resp: wire.HopResponse) -> tuple[HopResult, int, int]:
    got = resp.state.numel() * resp.state.element_size()
    if resp.logits is not None:
        got += resp.logits.numel() * resp.logits.element_size()
    result = HopResult(resp.state.to(req.state.device, req.state.dtype),
                       resp.logits.to(req.state.device) if resp.logits is not None else None)
    return result, w.payload_bytes, got


def serve_local(hop: Hop) -> HopHandler:
    """The RPC server's handler for a block this node holds: decode, run ``hop``, encode."""
    def handle(req: wire.HopRequest) -> wire.HopResponse:
        out = hop(from_wire(req))
        return wire.HopResponse(req.request_id, out.state, out.logits)
    return handle
