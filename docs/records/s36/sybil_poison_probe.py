"""What a Sybil holder of block 0 can do to a `pipeline` run through its training traffic (session 36 probe).

A real 2-block `pipeline` run on 127.0.0.1 (seed on block 0, one holder of block 1, tiny blocks, the s35 probe's
config); block 0 stops after 150 steps, so after that the only training traffic is the attacker's. The attacker is
tests/test_utils/outsider.py (a plain hivemind peer): it announces itself as an online holder of block 0 under a
key of its own (the upstream gate then serves it) and sends block 1's holder N micro-batches. Its activations are
made the way an honest holder's are (block 0's current weights, downloaded from the seed as any member may, run on
windows of the training text) unless the variant says random; its targets per variant:

* ``honest``: the text's own next bytes (a control: a Sybil that trains honestly);
* ``all-x``: every target ``x`` (the s35 probe's poison);
* ``x10``: the text's next bytes with 10 % of them, drawn at random, replaced by ``x`` (poison kept small);
* ``random-acts``: random activations, every target ``x`` (what tests/test_pipeline_admission.py sends).

Printed: the answers' codes, block 1's screen counters, the chain's held-out CE (32 windows of the evaluation
split) and a generation before and after.

    OMP_NUM_THREADS=1 python docs/records/s36/sybil_poison_probe.py VARIANT SCREEN [N]   # SCREEN 0: off
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from blocktrain.blocks.data import resolve_data
from blocktrain.node.client import NetworkClient
from blocktrain.node.swarm.launcher import LocalSwarm

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_utils.wire_procs import NodeProc, stop_all   # noqa: E402

CORPUS = Path(__file__).resolve().parents[3] / "tests" / "data" / "lord-arthur-savile"
OUTSIDER = str(Path(__file__).resolve().parents[3] / "tests" / "test_utils" / "outsider.py")
SETS = ["d_model=64", "n_heads=2", "layers_per_block=1", "n_blocks=2", "seq_len=64", "target_dim=16",
        "batch_size=8", "warmup_steps=20", "lr=0.002", "objective=pipeline"]
STEPS, N_B, T, D = 150, 8, 64, 64


def batches(client, seed_peer: str, split, variant: str, n: int, out: Path) -> None:
    """``n`` (activations, targets) pairs as the attacker would make them, saved to ``out``."""
    obj = client.objective
    block0 = obj.build_block(0)
    _, state = client.hop_client.get_block_state_sync(seed_peer, 0, timeout=60)
    block0.load_state_dict(state)
    block0.eval()
    g = torch.Generator().manual_seed(1)
    train = torch.from_numpy(split.train.astype("int64"))
    pairs = []
    for _ in range(n):
        starts = torch.randint(0, len(train) - T - 1, (N_B,), generator=g)
        w = torch.stack([train[s:s + T + 1] for s in starts])
        ctx, y = w[:, :-1], w[:, 1:].clone()
        with torch.no_grad():
            h = obj.stage_forward(block0, 0, None, ctx)
        if variant == "random-acts":
            h = torch.randn(N_B, T, D, generator=g)
        if variant in ("all-x", "random-acts"):
            y[:] = ord("x")
        elif variant == "x10":
            y[torch.rand(y.shape, generator=g) < 0.1] = ord("x")
        pairs.append((h.detach().clone(), y.to(torch.uint8)))
    torch.save(pairs, out)


def main(variant: str, screen: float, n: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="bt-sybil-poison-"))
    sw = LocalSwarm(base, run_id="sybilpoison", overrides=SETS, data=str(CORPUS),
                    extra_args=["--device", "cpu", "--pipeline-loss-screen", str(screen), "--no-rebalance"])
    client, sybil = None, None
    try:
        seed = sw.start_seed(block=0, args=["--max-steps", str(STEPS)])
        b1 = sw.start_join(block=1)
        client = NetworkClient([sw.seed_maddr], "sybilpoison")
        split = resolve_data(str(CORPUS))
        t0 = time.monotonic()
        while seed.get("/v1/status")["self"]["step"] < STEPS:
            time.sleep(1.0)
        time.sleep(3.0)   # micro-batches in flight settle
        pipe = lambda: b1.get("/v1/status")["self"]["pipeline"]   # noqa: E731
        p0, step0 = pipe(), b1.get("/v1/status")["self"]["step"]
        ce0 = client.chain_ce(split.eval, n_windows=32, k=2)["chain_ce"]
        gen0 = client.generate(b"The ", 32, mode="autoregressive", seed=0)["text"]
        print(f"[{variant}, screen {screen}] honest: block 0 reached {STEPS} steps in {time.monotonic() - t0:.0f} s; "
              f"block 1 trained {p0['answered']} micro-batches, refused_outlier {p0['refused_outlier']}; "
              f"chain CE {ce0:.3f} nats/byte; generation {gen0!r}")
        f = base / "batches.pt"
        batches(client, seed.info["peer_id"], split, variant, n, f)
        sybil = NodeProc("sybil", ["--initial-peer", sw.seed_maddr], base, script=OUTSIDER)
        sybil.wait_ready(timeout=120)
        t1 = time.monotonic()
        codes = sybil.cmd("poison_upstream", run_id="sybilpoison", block=1, holder=b1.info["peer_id"], n=n,
                          shape=[N_B, T, D], config_hash=seed.get("/v1/status")["run"]["config_hash"],
                          batches_file=str(f), timeout=600)
        took = time.monotonic() - t1
        time.sleep(2.0)
        p1, step1 = pipe(), b1.get("/v1/status")["self"]["step"]
        ce1 = client.chain_ce(split.eval, n_windows=32, k=2)["chain_ce"]
        gen1 = client.generate(b"The ", 32, mode="autoregressive", seed=0)["text"]
        print(f"[{variant}, screen {screen}] Sybil: {n} micro-batches in {took:.1f} s, answers {codes}; block 1 step "
              f"{step0} -> {step1}, refused_outlier {p0['refused_outlier']} -> {p1['refused_outlier']}")
        print(f"[{variant}, screen {screen}] after: chain CE {ce1:.3f} nats/byte ({ce1 - ce0:+.3f}); generation {gen1!r}")
    finally:
        if sybil is not None:
            stop_all([sybil])
        if client is not None:
            client.close()
        sw.stop_all()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 100)
