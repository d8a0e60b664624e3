"""Stalling Sybil holders in a live `pipeline` run: how much training do they cost?

A 2-block `pipeline` run of real node processes on 127.0.0.1 (block 1: the seed, block 0: a joiner that drives
micro-batches); then an outsider (tests/test_utils/outsider.py, a plain hivemind peer) announces N holders of
block 1 under fresh keys, STALL of them real daemons whose rpc_train takes a micro-batch and never answers (the
rest name an address nobody listens on). Printed every 10 s: block 0's completed / lost micro-batches, the
honest block 1's steps, block 0's micro-batch budget.

    OMP_NUM_THREADS=1 python docs/records/s28/pipeline_sybils.py [--n 30] [--stall 3] [--seconds 120]
        [--timeout 60]   (block 0's --pipeline-timeout)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[3] / "tests"
sys.path.insert(0, str(HERE))

from blocktrain.node.swarm.launcher import LocalSwarm   # noqa: E402

from test_utils.configs import TEST_CORPUS   # noqa: E402
from test_utils.reliability import MANUAL_AVG   # noqa: E402
from test_utils.wire_procs import NodeProc, stop_all   # noqa: E402

PIPE = ["objective=pipeline", "n_blocks=2", "d_model=32", "n_heads=2", "layers_per_block=1", "seq_len=32",
        "target_dim=16", "batch_size=4", "warmup_steps=0", "lr=0.003"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--stall", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="pipesybil"))
    sw = LocalSwarm(base, run_id="pipesybil", overrides=PIPE, data=str(TEST_CORPUS),
                    extra_args=["--device", "cpu", *MANUAL_AVG, "--no-rebalance"])
    out = None
    try:
        b1 = sw.start_seed(block=1)
        b0 = sw.start_join(block=0, args=["--pipeline-timeout", str(args.timeout)])
        pipe = lambda n: n.get("/v1/status")["self"]["pipeline"]   # noqa: E731
        t0 = time.monotonic()
        while pipe(b0)["completed"] < 20:
            time.sleep(0.5)
        out = NodeProc("outsider", ["--initial-peer", sw.seed_maddr], base, script=str(HERE / "test_utils" / "outsider.py"))
        out.wait_ready(timeout=120)
        cfg_hash = b0.get("/v1/status")["run"]["config_hash"]
        clean = pipe(b0)["completed"], time.monotonic()
        time.sleep(10)
        rate = (pipe(b0)["completed"] - clean[0]) / (time.monotonic() - clean[1])
        print(f"before the Sybils: {rate:.1f} micro-batches/s completed (10 s)", flush=True)
        syb = out.cmd("sybils", run_id="pipesybil", block=1, config_hash=cfg_hash, n=args.n, stall=args.stall,
                      stall_kind="train", timeout=300)
        print(f"announced {syb['stored']} Sybil holders of block 1, {len(syb['stalling'])} stalling", flush=True)
        while sum(len(b["holders"]) for b in b0.get("/v1/status")["blocks"] if b["block"] == 1) < args.n + 1:
            time.sleep(0.5)
        t1, s0 = time.monotonic(), pipe(b0)
        st0 = b1.get("/v1/status")["self"]["step"]
        while time.monotonic() - t1 < args.seconds:
            time.sleep(10)
            s = pipe(b0)
            print(f"{time.monotonic() - t1:5.0f} s: completed +{s['completed'] - s0['completed']}, lost "
                  f"+{s['lost'] - s0['lost']}, failed calls +{s['failed_calls'] - s0['failed_calls']}, "
                  f"block 1 steps +{b1.get('/v1/status')['self']['step'] - st0}, budget "
                  f"{(s.get('budget') or {}).get('budget_s')} s", flush=True)
        print("block 0's bans:", b0.get("/v1/status")["self"].get("bans"), flush=True)
    finally:
        if out is not None:
            stop_all([out])
        sw.stop_all()


if __name__ == "__main__":
    main()
