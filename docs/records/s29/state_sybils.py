"""Stalling Sybil holders against block state downloads (an export, a late join's fallback, a move, an
upstream snapshot): how long does a fresh client take to reach the honest holder?

A 2-block run of real node processes on 127.0.0.1 (block 0: the seed, block 1: one honest holder); an outsider
(tests/test_utils/outsider.py, a plain hivemind peer) announces N holders of block 1 under fresh keys, claiming
10^9 steps, STALL of them real daemons whose state handler takes the request and never answers. A fresh
NetworkClient then (1) downloads block 1 from two stallers only, (2) from every announced holder, each holder
given TIMEOUT seconds (an export's default is 60). Printed: the seconds each took, and who answered.

    OMP_NUM_THREADS=1 python docs/records/s29/state_sybils.py [--n 50] [--stall 5] [--timeout 60]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[3] / "tests"
sys.path.insert(0, str(TESTS))

from blocktrain.node.client import NetworkClient   # noqa: E402
from blocktrain.node.swarm.launcher import LocalSwarm   # noqa: E402

from test_utils.configs import TEST_CORPUS   # noqa: E402
from test_utils.reliability import MANUAL_AVG, TINY   # noqa: E402
from test_utils.wire_procs import NodeProc, stop_all   # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--stall", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="statesybil"))
    sw = LocalSwarm(base, run_id="statesybil", overrides=TINY, data=str(TEST_CORPUS),
                    extra_args=["--device", "cpu", *MANUAL_AVG, "--no-rebalance", "--max-steps", "5"])
    out = client = None
    try:
        seed = sw.start_seed(block=0)
        h1 = sw.start_join(block=1)
        out = NodeProc("outsider", ["--initial-peer", sw.seed_maddr], base, script=str(TESTS / "test_utils" / "outsider.py"))
        out.wait_ready(timeout=120)
        syb = out.cmd("sybils", run_id="statesybil", block=1, config_hash=seed.get("/v1/status")["run"]["config_hash"],
                      n=args.n, stall=args.stall, timeout=300)
        print(f"announced {syb['stored']} Sybil holders of block 1, {len(syb['stalling'])} stalling", flush=True)
        client = NetworkClient([sw.seed_maddr], "statesybil")
        t0 = time.monotonic()
        while True:
            holders = [h for h in client.holders().get(1, []) if h.state == "online"]
            if len(holders) >= args.n + 1 or time.monotonic() - t0 > 90:
                break
            time.sleep(1)
        print(f"the client lists {len(holders)} online holders of block 1", flush=True)
        two = [h for h in holders if h.peer_id in syb["stalling"][:2]]
        errors: list[str] = []
        t0 = time.monotonic()
        got = client.fetcher.fetch(1, two, errors=errors, timeout=args.timeout)
        print(f"(1) two stallers only: {time.monotonic() - t0:.1f} s, got {got is not None}; errors: "
              + " | ".join(e[-110:] for e in errors), flush=True)
        errors = []
        t0 = time.monotonic()
        got = client.fetcher.fetch(1, holders, errors=errors, timeout=args.timeout)
        stallers = sum(any(p in e for p in syb["stalling"]) for e in errors)
        print(f"(2) every holder: {time.monotonic() - t0:.1f} s, answered by "
              f"{'the honest holder' if got and got.peer == h1.info['peer_id'] else got and got.peer}; "
              f"{len(errors)} holders failed first, {stallers} of them stallers", flush=True)
    finally:
        if client is not None:
            client.close()
        if out is not None:
            stop_all([out])
        sw.stop_all()


if __name__ == "__main__":
    main()
