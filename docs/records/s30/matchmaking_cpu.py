"""CPU of a small idle-ish network, split into the nodes' Python processes and their p2pd daemons, with
each node's averaging rounds over the same window (BENCHMARKS.md "Matchmaking's DHT reads").

    OMP_NUM_THREADS=1 python docs/records/s30/matchmaking_cpu.py --nodes 6 --window 60

Real ``bt-node`` processes on 127.0.0.1: a seed and joins of a 2-block tiny ``paper`` run (blocks
alternate), ``--train-duty 0.1`` (the tests' quiet training), averaging at the node's defaults. Once
every node is ready and ``--settle`` seconds passed, CPU-seconds of every process of every node are
read twice, ``--window`` seconds apart, and each node's ``/v1/status`` averaging counters likewise.
Every node is stopped (SIGINT to its process group, SIGKILL after 30 s) on every exit path.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
from test_utils.configs import TEST_CORPUS  # noqa: E402
from test_utils.reliability import QUIET_TRAINING, TINY  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--objective", default="paper")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="mmcpu-"))
    sets = [x for kv in [f"objective={args.objective}", *TINY] for x in ("--set", kv)]
    common = ["--data", str(TEST_CORPUS), "--http-port", "0", "--device", "cpu", *QUIET_TRAINING, "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, infos = [], []

    def start(node_args: list[str], i: int) -> dict:
        d = base / f"n{i}"
        p = subprocess.Popen([sys.executable, "-m", "blocktrain.cli.main", *node_args, *common,
                              "--checkpoint-dir", str(d / "ckpt"), "--ready-file", str(d / "ready.json")],
                             env=env, stdout=subprocess.DEVNULL, stderr=open(base / f"log{i}", "w"),
                             start_new_session=True)
        procs.append(p)
        deadline = time.monotonic() + 180
        while not (d / "ready.json").exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit((base / f"log{i}").read_text()[-2000:])
            time.sleep(0.1)
        return json.loads((d / "ready.json").read_text())

    def cpu() -> dict[int, tuple[str, float]]:
        out = {}
        for p in procs:
            try:
                root = psutil.Process(p.pid)
                for q in [root, *root.children(recursive=True)]:
                    c = q.cpu_times()
                    out[q.pid] = (q.name(), c.user + c.system)
            except psutil.Error:
                pass
        return out

    def rounds() -> list[dict]:
        return [httpx.get(f"http://127.0.0.1:{i['http_port']}/v1/status", timeout=20).json()["averaging"]
                for i in infos]

    try:
        infos.append(start(["seed", "--run-id", "mmcpu", *sets, "--block", "0"], 0))
        for i in range(1, args.nodes):
            infos.append(start(["join", "--run", "mmcpu", "--block", str(i % 2),
                                "--initial-peers", infos[0]["maddrs"][0]], i))
        time.sleep(args.settle)
        a, ra = cpu(), rounds()
        time.sleep(args.window)
        b, rb = cpu(), rounds()
        by_kind: dict[str, float] = {}
        for pid, (name, v) in b.items():
            by_kind[name] = by_kind.get(name, 0.0) + v - a.get(pid, (name, 0.0))[1]
        keys = ("attempted", "succeeded", "rejected", "failed")
        print(json.dumps({
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "nodes": args.nodes, "objective": args.objective, "window_s": args.window,
            "cpu_s_per_s": {k: round(v / args.window, 3) for k, v in sorted(by_kind.items())},
            "cpu_s_per_s_total": round(sum(by_kind.values()) / args.window, 3),
            "rounds_in_window": {k: sum(y[k] - x[k] for x, y in zip(ra, rb)) for k in keys}}))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


if __name__ == "__main__":
    main()
