# Session 25 scratch probe: 8 pipeline nodes (2 per block, the churn test's args); SIGKILL one holder of
# block 1 with its process group; do generations still get through, and how fast?
import sys, time
sys.path.insert(0, "/work/main/tests")
from pathlib import Path
from blocktrain.node.client import NetworkClient
from test_utils.configs import TEST_CORPUS
from test_utils.reliability import QUIET_TRAINING, TINY, RelSwarm, stop_swarm, kill9
ARGS = ["--device", "cpu", "--average-every", "30", "--checkpoint-every", "50", "--rebalance-dwell", "120", *QUIET_TRAINING]
OBJ = sys.argv[1] if len(sys.argv) > 1 else "pipeline"
sw = RelSwarm(Path(f"/tmp/p16/w{OBJ}"), run_id="pk", overrides=[*TINY, "n_blocks=4", f"objective={OBJ}"],
              data=str(TEST_CORPUS), extra_args=ARGS)
client = None
def gen(tag):
    t = time.monotonic()
    try:
        client.generate(b"The ", 4)
        print(tag, "gen ok", round(time.monotonic() - t, 2), flush=True)
    except Exception as e:
        print(tag, "gen FAIL", round(time.monotonic() - t, 2), type(e).__name__, str(e)[:160], flush=True)
try:
    sw.start_seed(block=0)
    group = [sw.join(i % 4, name=f"n{i:02d}") for i in range(1, 8)]
    for n in group:
        n.wait_ready(timeout=300)
    client = NetworkClient([sw.seed_maddr], "pk")
    gen("before")
    victim = sw.nodes[int(sys.argv[2]) if len(sys.argv) > 2 else 1]
    kill9(victim)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 75:
        gen(f"t+{time.monotonic() - t0:5.1f}")
        time.sleep(2)
finally:
    if client is not None:
        client.close()
    stop_swarm(sw)
    print("stopped", flush=True)
