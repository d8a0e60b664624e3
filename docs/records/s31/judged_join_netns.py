"""A judged late join over slow links (BENCHMARKS.md "Judged state downloads"): a joiner of a real-size block
with ``--state-sources 1`` and ``2`` when two holders, on hosts of their own, hold the block, each host's
link limited to 20 Mbit/s both ways (``tc tbf``; the network-namespace harness of the tests), and again with
the joiner's download left unlimited (a home member: fast downlink; the holders' 20 Mbit/s uplinks limit).

    OMP_NUM_THREADS=1 python docs/records/s31/judged_join_netns.py --d-model 512 --layers 4

A ``paper`` run of one block (d_model 512 x 4 layers, 58.7 MB), the seed on host a and a second holder on
host b (its own late join from a); joiners on host c one after another, each stopped before the next. Every
node and namespace is removed on every exit path (the harness's own cleanup).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
from test_move_time import block_config  # noqa: E402
from test_utils.netns import NetLab, sh  # noqa: E402
from test_utils.ns_nodes import DATA, NODE_ARGS, NsNode, start_join, start_seed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="judged-ns-"))
    run = "nsjudge"
    rows, nodes = [], []
    with NetLab(rate_mbit=20) as lab:
        try:
            a, b = lab.host("a"), lab.host("b")
            c = lab.host("c")
            c_port = f"p{lab._n_bridge}"   # the bridge's side of host c's link: what limits c's download
            nodes.append(start_seed(a, work, run, block_config(args.d_model, args.layers)))
            nodes.append(start_join(b, work, nodes[0], run, block=0))
            nodes[1].wait_ready(timeout=900)
            rows.append({"holder_b_late_join": nodes[1].info["late_join"]})
            for downlink in ("20 Mbit/s", "unlimited"):
                if downlink == "unlimited":
                    sh("tc", "-n", lab.switch_ns, "qdisc", "del", "dev", c_port, "root")
                for sources in (1, 2):
                    j = NsNode(c, f"c-{sources}-{downlink[:2]}",
                               ["join", "--initial-peers", nodes[0].maddr, "--run-id", run, "--data", DATA, *NODE_ARGS,
                                "--block", "0", "--state-sources", str(sources)],
                               work / f"c-{sources}-{downlink[:2]}")
                    j.start()
                    nodes.append(j)
                    j.wait_ready(timeout=900)
                    late = j.info["late_join"]
                    rows.append({"joiner_downlink": downlink, "sources": sources, "late_join_s": late["s"],
                                 "mb": late["mb"], "mb_per_s_per_state": round(late["mb"] * len(late["compared"]) / late["s"], 2),
                                 "compared": late["compared"]})
                    print(json.dumps(rows[-1]), flush=True)
                    j.stop(timeout=10)
            print(json.dumps({"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "rows": rows}))
        finally:
            for n in nodes:
                n.stop(timeout=10)


if __name__ == "__main__":
    main()
