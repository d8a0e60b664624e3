"""What judging a late joiner's download costs (BENCHMARKS.md "Judged state downloads"): the same joiner of a
real-size block with ``--state-sources 1`` (the first acceptable state) and ``2`` (the default: two holders'
states compared by the chain's held-out CE), alternately, on 127.0.0.1.

    OMP_NUM_THREADS=1 python docs/records/s31/judged_join_cost.py --d-model 512 --layers 4 --repeats 2

Real ``bt-node`` processes (``LocalSwarm``): a ``pipeline`` run of 2 blocks, the seed on block 0 and two
holders of block 1, none training (``--max-steps 0``: the measure is the join, not a machine busy with
training). Each joiner of block 1 reports its late join (``/v1/status`` ``self.late_join``: seconds from the
first download to the adopted state, MB per state, what it compared) and its main process's peak resident
memory (``VmHWM``); it is stopped before the next starts. Every node is stopped on every exit path.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil

from blocktrain.node.swarm.launcher import LocalSwarm

REPO = Path(__file__).resolve().parents[3]
CORPUS = REPO / "tests" / "data" / "lord-arthur-savile"


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    heads = max(2, args.d_model // 64)
    overrides = ["objective=pipeline", f"d_model={args.d_model}", f"n_heads={heads}",
                 f"layers_per_block={args.layers}", "n_blocks=2", "seq_len=64", "target_dim=16", "batch_size=4"]
    base = Path(tempfile.mkdtemp(prefix="judged-join-"))
    sw = LocalSwarm(base, run_id="judged", overrides=overrides, data=str(CORPUS),
                    extra_args=["--average-every", "1000000", "--average-period", "1000000", "--average-clock", "0",
                                "--device", "cpu", "--no-rebalance", "--max-steps", "0"])
    rows = []
    try:
        sw.start_seed(block=0)
        sw.start_join(block=1)
        sw.start_join(block=1)
        for r in range(args.repeats):
            for sources in (1, 2):
                j = sw.start_join(block=1, args=["--state-sources", str(sources)], name=f"j{r}s{sources}")
                pid = j.info["pid"]
                late = j.get("/v1/status")["self"]["late_join"]
                rows.append({"sources": sources, "repeat": r, "late_join_s": late["s"], "mb": late["mb"],
                             "compared": len(late["compared"]), "from": late["from"] is not None,
                             "scores": [c.get("score") for c in late["compared"]], "fresh": late["fresh"],
                             "main_peak_rss_mb": round(vm_hwm_mb(pid), 1),
                             "main_rss_mb": round(psutil.Process(pid).memory_info().rss / 2**20, 1)})
                print(json.dumps(rows[-1]), flush=True)
                j.stop()
                sw.nodes.remove(j)
        print(json.dumps({"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "d_model": args.d_model,
                          "layers_per_block": args.layers, "summary": {
                              s: {"late_join_s": [x["late_join_s"] for x in rows if x["sources"] == s],
                                  "main_peak_rss_mb": [x["main_peak_rss_mb"] for x in rows if x["sources"] == s]}
                              for s in (1, 2)}}))
    finally:
        sw.stop_all()


if __name__ == "__main__":
    main()
