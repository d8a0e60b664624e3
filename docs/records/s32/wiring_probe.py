"""Probe: how node0 (block 0) splits pipeline micro-batches between two holders of block 1 over time.

    OMP_NUM_THREADS=1 python docs/records/s32/wiring_probe.py WORKDIR SECONDS

bt-node swarm's layout (blocks 0,1,2,3,1; the replica of block 1 starts last), pipeline, tiny blocks,
WikiText-2 raw (protocol wt2-offline). Every 10 s: per node (block, state, step, received, completed),
then the two block-1 holders' pipeline counters. RELIABILITY.md "Gaps found" 7."""
import json, sys, time
from pathlib import Path
from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.node.swarm.run import SWARM_DEFAULTS

base = Path(sys.argv[1]); secs = float(sys.argv[2])
sw = LocalSwarm(base, run_id="wp", overrides=SWARM_DEFAULTS + ["objective=pipeline"], data="/work/shared/data/wikitext-2-raw",
                extra_args=["--device", "cpu", "--average-every", "10", "--average-clock", "5"])
try:
    sw.start_chain([0, 1, 2, 3, 1])
    t0 = time.time()
    while time.time() - t0 < secs:
        time.sleep(10)
        row = []
        for n in sw.nodes:
            st = n.get("/v1/status")
            p = st["self"]["pipeline"] or {}
            row.append((st["self"]["block"], st["self"]["state"], st["self"]["step"], p.get("received"), p.get("completed")))
        st0 = sw.nodes[0].get("/v1/status")
        hold1 = [(h.get("peer_id", "")[-6:], h.get("state")) for b in st0["blocks"] if b["block"] == 1 for h in b["holders"]]
        print(round(time.time() - t0), row, "node0 sees b1:", hold1, flush=True)
    for i in (1, 4):
        st = sw.nodes[i].get("/v1/status")
        print("node", i, json.dumps({k: v for k, v in (st["self"]["pipeline"] or {}).items() if k not in ("settings",)})[:3000])
        print("errors", st["errors"][-5:])
        print("averaging", {k: st["averaging"].get(k) for k in ("attempted", "succeeded", "rejected", "failed", "skipped_alone")})
finally:
    sw.stop_all()
