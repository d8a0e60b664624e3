"""A/B: what a test's node start costs with and without the suite's node template (tests/test_utils/zygote.py).

    python docs/records/s41/template_ab.py ROUNDS OUT.jsonl

Each round, for each arm (alternating which goes first), a fresh driver process starts a network of 4 tiny
nodes (the suite's LocalSwarm, SWARM_DEFAULTS, the test corpus, --max-steps 1), waits until all are ready,
stops them, twice, and exits; the arm's cost is the driver's whole process tree's CPU seconds
(RUSAGE_CHILDREN of this process around the driver: the driver, the template and everything they reaped).
"""
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DRIVER = r'''
import sys, tempfile
sys.path.insert(0, sys.argv[1] + "/tests")
from pathlib import Path
from blocktrain.node.swarm.launcher import LocalSwarm, ManagedProcess
from blocktrain.node.swarm.run import SWARM_DEFAULTS
from test_utils import zygote
from test_utils.configs import TEST_CORPUS
if sys.argv[2] == "template":
    ManagedProcess.popen = staticmethod(zygote.popen)
for r in range(2):
    with tempfile.TemporaryDirectory() as d:
        sw = LocalSwarm(d, run_id="ab", overrides=SWARM_DEFAULTS, data=str(TEST_CORPUS),
                        extra_args=["--device", "cpu", "--max-steps", "1"])
        try:
            sw.start_chain([0, 1, 2, 3])
        finally:
            sw.stop_all(60)
zygote.close()
'''


def cpu_children() -> float:
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return c.ru_utime + c.ru_stime


def main(rounds: int, out: str) -> None:
    for r in range(rounds):
        for arm in (("popen", "template") if r % 2 == 0 else ("template", "popen")):
            c0, t0 = cpu_children(), time.monotonic()
            subprocess.run([sys.executable, "-c", DRIVER, ROOT, arm], check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            row = {"round": r, "arm": arm, "node_starts": 8, "cpu_s": round(cpu_children() - c0, 2),
                   "wall_s": round(time.monotonic() - t0, 2)}
            print(json.dumps(row), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
