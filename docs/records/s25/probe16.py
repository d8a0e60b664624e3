# Session 25 scratch probe: 16 pipeline nodes (the churn test's setup, no churn): do generations fail
# without churn, and where does a middle node's time go?
import sys, time, json
sys.path.insert(0, "/work/main/tests")
from pathlib import Path
from blocktrain.node.client import NetworkClient
from test_utils.configs import TEST_CORPUS
from test_utils.reliability import QUIET_TRAINING, TINY, RelSwarm, stop_swarm
ARGS = ["--device", "cpu", "--average-every", "30", "--checkpoint-every", "50", "--rebalance-dwell", "120", *QUIET_TRAINING]
N = int(sys.argv[1]) if len(sys.argv) > 1 else 16
sw = RelSwarm(Path("/tmp/p16/w"), run_id="p16", overrides=[*TINY, "n_blocks=4"], data=str(TEST_CORPUS), extra_args=ARGS)
client = None
try:
    t0 = time.monotonic()
    sw.start_seed(block=0)
    for batch in range(1, N, 5):
        group = [sw.join(i % 4, name=f"n{i:02d}") for i in range(batch, min(batch + 5, N))]
        for n in group:
            n.wait_ready(timeout=300)
    print("up", N, round(time.monotonic() - t0, 1), flush=True)
    client = NetworkClient([sw.seed_maddr], "p16")
    for k in range(6):
        t = time.monotonic()
        try:
            out = client.generate(b"The ", 4)
            print("gen ok", round(time.monotonic() - t, 2), flush=True)
        except Exception as e:
            print("gen FAIL", round(time.monotonic() - t, 2), type(e).__name__, str(e)[:200], flush=True)
        for n in sw.nodes[1:3]:
            st = n.get("/v1/status", timeout=10)
            p = st["self"].get("pipeline") or {}
            print("  ", n.name, "block", st["self"]["block"], "pipeline times", json.dumps(p.get("times_s"))[:300],
                  "counts", json.dumps({k: v for k, v in (p.get("counts") or {}).items()})[:300], flush=True)
    print("load", open("/proc/loadavg").read().strip())
finally:
    if client is not None:
        client.close()
    stop_swarm(sw)
    print("stopped", flush=True)
