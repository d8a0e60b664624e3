"""What an outsider can do to a `pipeline` run through its training traffic (session 35 probe).

A real 2-block `pipeline` run on 127.0.0.1 (seed on block 0, one holder of block 1, tiny blocks); block 0
stops after --max-steps, so after that the only training traffic is the outsider's. The outsider is a plain
hivemind peer (its own libp2p daemon, no DHT record, no identity of the run): it sends raw `rpc_train`
requests to block 1's holder, each a well-formed micro-batch whose activations are random and whose targets
are all one byte ('x'). Printed: how many it got trained, the chain's held-out CE before and after, and a
generation before and after.

    OMP_NUM_THREADS=1 python docs/records/s35/train_poison_probe.py [N_MICROBATCHES]
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from hivemind.p2p import P2P

from blocktrain.blocks.data import resolve_data
from blocktrain.node.client import NetworkClient
from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.hops import decode_meta
from blocktrain.p2p.pipeline_wire import StageRequest, request_message

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_utils.raw_pipeline import raw_train_call   # noqa: E402

CORPUS = Path(__file__).resolve().parents[3] / "tests" / "data" / "lord-arthur-savile"
SETS = ["d_model=64", "n_heads=2", "layers_per_block=1", "n_blocks=2", "seq_len=64", "target_dim=16",
        "batch_size=8", "warmup_steps=20", "lr=0.002", "objective=pipeline"]
STEPS = 150


def main(n_poison: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="bt-poison-"))
    sw = LocalSwarm(base, run_id="poison", overrides=SETS, data=str(CORPUS), extra_args=["--device", "cpu"])
    loop, outsider, client = LoopThread(name="bt-outsider"), None, None
    try:
        sw.start_seed(block=0, args=["--max-steps", str(STEPS)])
        b1 = sw.start_join(block=1)
        # the outsider's daemon first: once the client's DHT runs, this process's loop policy is hivemind's
        outsider = loop.run(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=b1.info["maddrs"]),
                            timeout=60)
        client = NetworkClient([sw.seed_maddr], "poison")
        split = resolve_data(str(CORPUS))
        t0 = time.monotonic()
        while sw.nodes[0].get("/v1/status")["self"]["step"] < STEPS:
            time.sleep(1.0)
        time.sleep(3.0)   # micro-batches in flight settle
        s_before = b1.get("/v1/status")
        ce_before = client.chain_ce(split.eval, n_windows=32, k=2)["chain_ce"]
        gen_before = client.generate(b"The ", 32, mode="autoregressive", seed=0)["text"]
        print(f"honest training: block 0 reached {STEPS} steps in {time.monotonic() - t0:.0f} s; block 1 at step "
              f"{s_before['self']['step']}; chain CE {ce_before:.3f} nats/byte; generation {gen_before!r}")

        peer, d, T, N = b1.info["peer_id"], 64, 64, 8
        g = torch.Generator().manual_seed(0)
        answers: dict[str, int] = {}
        t1 = time.monotonic()
        for i in range(n_poison):
            req = StageRequest(1, torch.randn(N, T, d, generator=g), torch.full((N, T), ord("x"), dtype=torch.int64),
                               "backprop", "fp32", deadline_s=10.0, request_id=f"poison-{i}")
            meta, pbs, _, _ = request_message(req)
            ans, _ = loop.run(raw_train_call(outsider, peer, "poison", 1, decode_meta(meta), pbs), timeout=30)
            key = "ok" if ans.get("ok") else f"refused:{ans.get('code')}"
            answers[key] = answers.get(key, 0) + 1
        took = time.monotonic() - t1
        time.sleep(2.0)
        s_after = b1.get("/v1/status")
        ce_after = client.chain_ce(split.eval, n_windows=32, k=2)["chain_ce"]
        gen_after = client.generate(b"The ", 32, mode="autoregressive", seed=0)["text"]
        print(f"outsider: {n_poison} micro-batches in {took:.1f} s, answers {answers}; block 1 step "
              f"{s_before['self']['step']} -> {s_after['self']['step']}")
        print(f"after: chain CE {ce_after:.3f} nats/byte ({ce_after - ce_before:+.3f}); generation {gen_after!r}")
    finally:
        if client is not None:
            client.close()
        if outsider is not None:
            loop.run(outsider.shutdown(), timeout=10)
        loop.stop()
        sw.stop_all()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
