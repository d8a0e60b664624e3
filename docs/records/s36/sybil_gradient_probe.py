"""What a Sybil holder of the *next* block can do to a `pipeline` run: gradients of its choice (session 36 probe).

A real 2-block `pipeline` run on 127.0.0.1 (seed on block 0, one honest holder of block 1; the s35/s36 probes'
tiny config). After 150 honest steps the attacker joins as a holder of block 1: its own libp2p daemon under a key
of its own, a signed record announcing it `online` and serving (stored through a plain hivemind DHT peer), and an
`rpc_train` handler that runs block 1 (its weights downloaded from the honest holder, as any member may) on each
micro-batch block 0 sends it, takes the true gradient dL/dh_0 and answers ``-SCALE`` times it (a loss and a
route that look honest). Block 0 then steps on a negated gradient whenever its stochastic wiring picks the
Sybil. ``SCALE 0`` runs no attacker (the control). Printed: the share of block 0's micro-batches the Sybil
answered, and the held-out CE of the honest chain (block 0 and the honest block 1, downloaded and scored here on
the same 32 windows) every 20 s for 120 s.

    OMP_NUM_THREADS=1 python docs/records/s36/sybil_gradient_probe.py SCALE
"""
from __future__ import annotations

import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from blocktrain.blocks.data import resolve_data
from blocktrain.blocks.windows import eval_windows
from blocktrain.node.client import NetworkClient
from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.pipeline_rpc import PipelineServer, PipelineTraffic
from blocktrain.p2p.pipeline_wire import PipelineLimits, StageResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_utils.outsider import ManyKeysSigner, Outsider, _add_signer, _der_args, owner, peer_id_of   # noqa: E402

CORPUS = Path(__file__).resolve().parents[3] / "tests" / "data" / "lord-arthur-savile"
RUN = "sybilgrad"
SETS = ["d_model=64", "n_heads=2", "layers_per_block=1", "n_blocks=2", "seq_len=64", "target_dim=16",
        "batch_size=8", "warmup_steps=20", "lr=0.002", "objective=pipeline"]
STEPS, WATCH_S, EVERY_S = 150, 120, 20


def chain_ce(client, peers: list[str], windows) -> float:
    obj = client.objective
    blocks = []
    for b, peer in enumerate(peers):
        m = obj.build_block(b)
        m.load_state_dict(client.hop_client.get_block_state_sync(peer, b, timeout=60)[1])
        blocks.append(m.eval())
    return obj.score(obj.local_hops(blocks), windows, k=2, generator=torch.Generator().manual_seed(0)).ce


def main(scale: float) -> None:
    base = Path(tempfile.mkdtemp(prefix="bt-sybil-grad-"))
    sw = LocalSwarm(base, run_id=RUN, overrides=SETS, data=str(CORPUS), extra_args=["--device", "cpu", "--no-rebalance"])
    loop, client, outsider, p2p, server = LoopThread(name="bt-sybil"), None, None, None, None
    answered = [0]
    try:
        seed = sw.start_seed(block=0)
        b1 = sw.start_join(block=1)
        client = NetworkClient([sw.seed_maddr], RUN)
        windows = eval_windows(resolve_data(str(CORPUS)).eval, 64, 32)
        peers = [seed.info["peer_id"], b1.info["peer_id"]]
        while seed.get("/v1/status")["self"]["step"] < STEPS:
            time.sleep(0.5)
        if scale > 0:
            key = RSAPrivateKey()
            path = base / "sybil.key"
            path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key._private_key.private_bytes(
                *_der_args())).SerializeToString())
            p2p = loop.run(P2P.create(identity_path=str(path), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                      initial_peers=b1.info["maddrs"]), timeout=60)
            obj = client.objective
            block1 = obj.build_block(1)
            block1.load_state_dict(client.hop_client.get_block_state_sync(peers[1], 1, timeout=60)[1])
            me = peer_id_of(key)

            async def handler(req):   # the true gradient of block 1's loss, negated and scaled
                x = req.state.detach().requires_grad_(True)
                loss, _ = obj.stage_loss(block1, 1, obj.stage_forward(block1, 1, x, None), req.targets)
                loss.backward()
                block1.zero_grad(set_to_none=True)
                answered[0] += 1
                return StageResponse(req.request_id, -scale * x.grad.detach(), float(loss), {1: float(loss)}, [me])

            limits = PipelineLimits(allowed_blocks={1}, n_blocks=2, mode="backprop", max_batch=64, max_seq=64,
                                    d_model=64)
            server = PipelineServer(p2p, RUN, limits, handler, traffic=PipelineTraffic())
            loop.run(server.add_block(1), timeout=30)
            outsider = Outsider(sw.seed_maddr)   # a plain hivemind DHT peer: stores the Sybil's signed record
            outsider.dht.run_coroutine(partial(_add_signer, signer=ManyKeysSigner([key])))
            maddrs = [str(m) for m in loop.run(p2p.get_visible_maddrs(), timeout=30)]
            cfg_hash = seed.get("/v1/status")["run"]["config_hash"]

            def announce():
                value = {"peer_id": me, "block_index": 1, "state": "online", "step": 1000, "samples_seen": 8000,
                         "throughput": 100.0, "loss": 2.0, "last_round_time": time.time(), "serving": True,
                         "addresses": maddrs, "software_version": "blocktrain/0.1.0", "config_hash": cfg_hash,
                         "run_id": RUN}
                return outsider.dht.store(f"{RUN}_blocks", value, get_dht_time() + 60, subkey=b"1" + owner(key))
            assert announce(), "the Sybil's record was not stored"
        p0 = seed.get("/v1/status")["self"]["pipeline"]
        ce = [chain_ce(client, peers, windows)]
        print(f"[scale {scale}] at {STEPS} honest steps: chain CE {ce[0]:.3f} nats/byte", flush=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < WATCH_S:
            time.sleep(EVERY_S)
            if scale > 0:
                announce()
            p = seed.get("/v1/status")["self"]["pipeline"]
            ce.append(chain_ce(client, peers, windows))
            done = p["completed"] - p0["completed"]
            print(f"[scale {scale}] +{time.monotonic() - t0:.0f} s: block 0 completed {done} micro-batches, the Sybil "
                  f"answered {answered[0]} ({answered[0] / max(1, done):.0%}); chain CE {ce[-1]:.3f}", flush=True)
    finally:
        if server is not None:
            loop.run(server.close(), timeout=10)
        if p2p is not None:
            loop.run(p2p.shutdown(), timeout=10)
        loop.stop()
        if outsider is not None:
            outsider.close()
        if client is not None:
            client.close()
        sw.stop_all()


if __name__ == "__main__":
    main(float(sys.argv[1]))
