"""What a Sybil holder of the *next* block can do to a `pipeline` run: gradients of its choice (session 36 probe).

A real 2-block `pipeline` run on 127.0.0.1 (seed on block 0, one honest holder of block 1; the s35/s36 probes'
tiny config). After 150 honest steps the attacker (tests/test_utils/sybil_stage.py) joins as a holder of block 1:
its own libp2p daemon under a key of its own, a signed record announcing it `online` and serving (stored through a
plain hivemind DHT peer), and an `rpc_train` handler that runs block 1 (its weights downloaded from the honest
holder, as any member may) on each micro-batch block 0 sends it, takes the true gradient dL/dh_0 and answers
``-SCALE`` times it (with the true loss). Block 0 then steps on a negated gradient whenever its stochastic wiring
picks the Sybil, unless a gradient check catches it (node/pipeline/verify.py). ``SCALE 0`` runs no attacker (the
control). With ``serve-state`` the attacker also answers block-state downloads of block 1 with the honest weights
it downloaded (a gradient check then recomputes the honest gradient from them); with ``honest-first`` it answers
its first 5 micro-batches honestly (the first answer of every holder is checked) and lies from then on; any other
extra argument is passed to the nodes (e.g. ``--pipeline-check-rate 0``). Printed: the share of block 0's
micro-batches the Sybil answered and the held-out CE of the honest chain (block 0 and the honest block 1,
downloaded and scored here on the same 32 windows) every 20 s for 120 s, and block 0's check counters.

    OMP_NUM_THREADS=1 python docs/records/s36/sybil_gradient_probe.py SCALE [serve-state] [honest-first] [NODE ARGS]
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from blocktrain.blocks.data import resolve_data
from blocktrain.blocks.windows import eval_windows
from blocktrain.node.client import NetworkClient
from blocktrain.node.swarm.launcher import LocalSwarm

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_utils.sybil_stage import SybilStage   # noqa: E402

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


def main(scale: float, flags: list[str], node_args: list[str]) -> None:
    tag = " ".join([f"scale {scale}", *flags, *node_args])
    base = Path(tempfile.mkdtemp(prefix="bt-sybil-grad-"))
    sw = LocalSwarm(base, run_id=RUN, overrides=SETS, data=str(CORPUS),
                    extra_args=["--device", "cpu", "--no-rebalance", *node_args])
    client, sybil = None, None
    try:
        seed = sw.start_seed(block=0)
        b1 = sw.start_join(block=1)
        if scale > 0:   # its daemon before this process's client DHT (the event-loop policy)
            sybil = SybilStage(RUN, 1, b1.info["maddrs"])
        client = NetworkClient([sw.seed_maddr], RUN)
        windows = eval_windows(resolve_data(str(CORPUS)).eval, 64, 32)
        peers = [seed.info["peer_id"], b1.info["peer_id"]]
        while seed.get("/v1/status")["self"]["step"] < STEPS:
            time.sleep(0.5)
        if sybil is not None:
            obj = client.objective
            block1 = obj.build_block(1)
            block1.load_state_dict(sybil.download(peers[1]))
            sybil.serve(obj, block1, sign=-scale, serve_state="serve-state" in flags,
                        honest_first=5 if "honest-first" in flags else 0,
                        config_hash=seed.get("/v1/status")["run"]["config_hash"], d_model=64, max_seq=64, n_blocks=2,
                        initial_peer=sw.seed_maddr)
        p0 = seed.get("/v1/status")["self"]["pipeline"]
        ce = [chain_ce(client, peers, windows)]
        print(f"[{tag}] at {STEPS} honest steps: chain CE {ce[0]:.3f} nats/byte", flush=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < WATCH_S:
            time.sleep(EVERY_S)
            if sybil is not None:
                sybil.announce()
            p = seed.get("/v1/status")["self"]["pipeline"]
            ce.append(chain_ce(client, peers, windows))
            done = p["completed"] - p0["completed"]
            n = sybil.answered if sybil is not None else 0
            print(f"[{tag}] +{time.monotonic() - t0:.0f} s: block 0 completed {done} micro-batches, the Sybil "
                  f"answered {n} ({n / max(1, done):.0%}); chain CE {ce[-1]:.3f}", flush=True)
        p = seed.get("/v1/status")["self"]["pipeline"]
        print(f"[{tag}] block 0: gradient checks {p['gradient_checks']}, failed {p['gradient_checks_failed']}, "
              f"inconclusive {p['gradient_checks_inconclusive']}; lost {p['lost_by_reason']}", flush=True)
    finally:
        if sybil is not None:
            sybil.close()
        if client is not None:
            client.close()
        sw.stop_all()


if __name__ == "__main__":
    rest = sys.argv[2:]
    main(float(sys.argv[1]), [a for a in rest if a in ("serve-state", "honest-first")],
         [a for a in rest if a not in ("serve-state", "honest-first")])
