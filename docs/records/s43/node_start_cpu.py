"""Session 43: what a node forked from the test template spends from its start to its ready file, with the
template's old preloads (our CLI, torch the lean way, the node) and with the node's HTTP API and rebalancing
loop preloaded too (``tests/test_utils/zygote.py`` PRELOAD since session 43).

    python docs/records/s43/node_start_cpu.py [PAIRS]      # from the repository root; default 4 pairs

Each measurement is a fresh process that imports what the template imports (old or new list), then starts a
tiny ``bt-node seed`` in-process (as a forked node runs the CLI) and reports the CPU-seconds of all its threads
from the command's start to its ready file (the p2p daemon, a separate process, not counted). The two kinds
alternate. Prints one JSON line per measurement and the means.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OLD = ["blocktrain.cli.node_cmds", "blocktrain.node.node"]
NEW = OLD + ["blocktrain.node.http.server", "blocktrain.node.rebalance"]
CHILD = r"""
import importlib, os, sys, threading, time
from blocktrain.cli.main import NODE_COMMANDS  # noqa: F401
from blocktrain.node.memory import import_torch_lean
import_torch_lean()
for name in sys.argv[1].split(","):
    importlib.import_module(name)
import runpy
ready = sys.argv[2]
def cpu():
    t = os.times()
    return t.user + t.system
c0 = cpu()
def watch():
    while not os.path.exists(ready):
        time.sleep(0.02)
    print("CPU_TO_READY", round(cpu() - c0, 3), file=sys.stderr, flush=True)
    os.kill(os.getpid(), 2)
threading.Thread(target=watch, daemon=True).start()
sys.argv = ["bt-node"] + sys.argv[3:]
runpy.run_module("blocktrain.cli.main", run_name="__main__", alter_sys=True)
"""
SEED = ["seed", "--run-id", "startcpu", "--set", "objective=paper", "--set", "d_model=32", "--set", "n_heads=2",
        "--set", "layers_per_block=1", "--set", "n_blocks=2", "--set", "seq_len=32", "--set", "target_dim=16",
        "--set", "batch_size=4", "--block", "0", "--data", str(ROOT / "tests/data/lord-arthur-savile"),
        "--http-port", "0", "--max-steps", "0", "--device", "cpu", "--quiet"]


def measure(preload: list[str]) -> float:
    with tempfile.TemporaryDirectory() as d:
        ready = os.path.join(d, "ready.json")
        cmd = [sys.executable, "-c", CHILD, ",".join(preload), ready, *SEED, "--checkpoint-dir",
               os.path.join(d, "ckpt"), "--ready-file", ready]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((ln for ln in p.stderr.splitlines() if ln.startswith("CPU_TO_READY")), None)
        if line is None:
            raise RuntimeError(p.stderr[-2000:])
        return float(line.split()[1])


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    got: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(pairs):
        for kind, preload in (("old", OLD), ("new", NEW)):
            s = measure(preload)
            got[kind].append(s)
            print(json.dumps({"pair": i, "preload": kind, "cpu_s_to_ready": s,
                              "utc": time.strftime("%H:%M:%S", time.gmtime())}), flush=True)
    means = {k: round(sum(v) / len(v), 3) for k, v in got.items()}
    print(json.dumps({"means": means, "new_over_old": round(means["new"] / means["old"], 3)}))


if __name__ == "__main__":
    main()
