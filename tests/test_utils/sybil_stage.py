"""A Sybil holder of a chain-trained run's block b >= 1 that answers micro-batches with gradients of its choice.

Its own libp2p daemon under a key of its own; a signed record announcing it ``online`` and serving block b, stored
through a plain hivemind DHT peer (tests/test_utils/outsider.py); an ``rpc_train`` handler that runs block b (the
weights it is given, e.g. downloaded from an honest holder, as any member may) to the loss on each micro-batch and
answers ``sign`` times the true gradient dL/dh_{b-1}, with the true loss and itself as the route (so b must be the
last block). ``serve_state``: it also answers block-state downloads of block b with those weights (a gradient check
then recomputes the honest gradient from them); ``honest_first``: its first N answers are honest.

Create it before anything in this process starts a hivemind DHT client (the daemon's event-loop policy)."""
from __future__ import annotations

import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.hops import HopLimits
from blocktrain.p2p.pipeline_rpc import PipelineServer, PipelineTraffic
from blocktrain.p2p.pipeline_wire import PipelineLimits, StageResponse
from blocktrain.p2p.rpc_client import HopClient
from blocktrain.p2p.rpc_server import BlockRPCServer

from test_utils.outsider import ManyKeysSigner, Outsider, _add_signer, _der_args, owner, peer_id_of


class SybilStage:
    def __init__(self, run_id: str, block: int, initial_peers: list[str]):
        self.run_id, self.block = run_id, block
        self.key = RSAPrivateKey()
        self.peer_id = peer_id_of(self.key)
        self.answered = 0
        self.loop = LoopThread(name="bt-sybil-stage")
        self._dir = tempfile.mkdtemp(prefix="bt-sybil-")
        path = Path(self._dir) / "sybil.key"
        path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=self.key._private_key.private_bytes(
            *_der_args())).SerializeToString())
        self.p2p = self.loop.run(P2P.create(identity_path=str(path), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                            initial_peers=initial_peers), timeout=60)
        self.outsider: Outsider | None = None
        self._servers: list = []
        self._record: dict | None = None

    def download(self, peer: str) -> dict:
        """Block b's state from an honest holder, over the block-state RPC."""
        return self.loop.run(HopClient(self.p2p, self.run_id, loop=self.loop).get_block_state(peer, self.block,
                                                                                               timeout=60), 90)[1]

    def serve(self, objective, module, *, sign: float = -1.0, serve_state: bool = False, honest_first: int = 0,
              config_hash: str, d_model: int, max_seq: int, n_blocks: int, initial_peer: str) -> None:
        b, me = self.block, self.peer_id

        async def handler(req):   # the true gradient of block b's loss, times ``sign`` after the honest ones
            x = req.state.detach().requires_grad_(True)
            loss, _ = objective.stage_loss(module, b, objective.stage_forward(module, b, x, None), req.targets)
            loss.backward()
            module.zero_grad(set_to_none=True)
            self.answered += 1
            s = 1.0 if self.answered <= honest_first else sign
            return StageResponse(req.request_id, s * x.grad.detach(), float(loss), {b: float(loss)}, [me])

        limits = PipelineLimits(allowed_blocks={b}, n_blocks=n_blocks, mode="backprop", max_batch=64, max_seq=max_seq,
                                d_model=d_model)
        train = PipelineServer(self.p2p, self.run_id, limits, handler, traffic=PipelineTraffic())
        self.loop.run(train.add_block(b), timeout=30)
        self._servers.append(train)
        if serve_state:
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}

            def hop(*_a, **_k):
                raise RuntimeError("this holder serves no hops")
            states = BlockRPCServer(self.p2p, self.run_id, HopLimits({b}, 64, max_seq, d_model, 256), hop,
                                    lambda _b: ({"step": 1000, "samples_seen": 8000, "config_hash": config_hash}, state))
            self.loop.run(states.add_block(b), timeout=30)
            self._servers.append(states)
        self.outsider = Outsider(initial_peer)
        self.outsider.dht.run_coroutine(partial(_add_signer, signer=ManyKeysSigner([self.key])))
        maddrs = [str(m) for m in self.loop.run(self.p2p.get_visible_maddrs(), timeout=30)]
        self._record = {"peer_id": me, "block_index": b, "state": "online", "step": 1000, "samples_seen": 8000,
                        "throughput": 100.0, "loss": 2.0, "last_round_time": time.time(), "serving": True,
                        "addresses": maddrs, "software_version": "blocktrain/0.1.0", "config_hash": config_hash,
                        "run_id": self.run_id}
        if not self.announce():
            raise RuntimeError("the Sybil's record was not stored")

    def announce(self) -> bool:
        """(Re)store its record for 60 s."""
        self._record["last_round_time"] = time.time()
        return bool(self.outsider.dht.store(f"{self.run_id}_blocks", self._record, get_dht_time() + 60,
                                            subkey=str(self.block).encode() + owner(self.key)))

    def close(self) -> None:
        for s in self._servers:
            try:
                self.loop.run(s.close(), timeout=10)
            except Exception:
                pass
        try:
            self.loop.run(self.p2p.shutdown(), timeout=10)
        finally:
            try:
                self.loop.stop()
                if self.outsider is not None:
                    self.outsider.close()
            finally:
                shutil.rmtree(self._dir, ignore_errors=True)   # its private key
