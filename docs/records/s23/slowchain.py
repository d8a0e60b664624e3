"""Session 23: tests/test_pipeline_slow_chain.py's network (3 tiny pipeline workers, every hop delayed
300 ms each way, --pipeline-timeout 1) for 60 s with a fixed budget (--pipeline-timeout-max 1: what
the node did before the adaptive budget) and with the adaptive one (--pipeline-timeout-max 60).
Prints one JSON line per arm: block 0's micro-batches, every worker's steps, block 0's weight change.
Usage: python slowchain.py OUT.jsonl [ARMS...]   (arms: fixed adaptive; run from the repo root)"""
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, "tests")
from blocktrain.node.swarm.launcher import LocalSwarm  # noqa: E402
from test_pipeline_slow_chain import TINY  # noqa: E402
from test_utils.configs import TEST_CORPUS  # noqa: E402
from test_utils.reliability import stop_swarm  # noqa: E402

BASE = ["--device", "cpu", "--average-every", "1000000", "--inject-delay-ms", "300", "--pipeline-timeout", "1"]
out = Path(sys.argv[1])
for arm in sys.argv[2:] or ["fixed", "adaptive"]:
    extra = [*BASE, "--pipeline-timeout-max", "1" if arm == "fixed" else "60"]
    sw = LocalSwarm(Path(tempfile.mkdtemp()), run_id="slowchain", data=str(TEST_CORPUS),
                    overrides=["objective=pipeline", *TINY], extra_args=extra)
    try:
        b2 = sw.start_seed(block=2)
        b1 = sw.start_join(block=1, name="b1")
        b0 = sw.start_join(block=0, name="b0")
        t0 = time.time()
        time.sleep(60)
        sts = [n.get("/v1/status")["self"] for n in (b0, b1, b2)]
        p0 = sts[0]["pipeline"]
        rec = {"arm": arm, "seconds": round(time.time() - t0, 1), "started": p0["started"],
               "completed": p0["completed"], "lost_by_reason": p0["lost_by_reason"], "budget": p0["budget"],
               "steps": [s["step"] for s in sts], "samples_seen": [s["samples_seen"] for s in sts],
               "expired_in_queue": [s["pipeline"]["expired_in_queue"] for s in sts],
               "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    finally:
        stop_swarm(sw)
    print(json.dumps(rec), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
