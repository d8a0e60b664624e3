"""Per node: CPU seconds of a tiny seed's main process and its p2pd when its ready file appears, started by
subprocess.Popen and forked from the node template (tests/test_utils/zygote.py), alternating, 3 each.

    python docs/records/s41/template_ready.py
"""
import sys, os, time, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
import psutil
from blocktrain.node.swarm.launcher import LocalSwarm, ManagedProcess
from blocktrain.node.swarm.run import SWARM_DEFAULTS
from test_utils import zygote
from test_utils.configs import TEST_CORPUS
import subprocess
def cpu(p):
    t = p.cpu_times(); return t.user + t.system
for r in range(3):
    for arm in ("popen", "template"):
        ManagedProcess.popen = staticmethod(zygote.popen if arm == "template" else subprocess.Popen)
        with tempfile.TemporaryDirectory() as d:
            sw = LocalSwarm(d, run_id="ab", overrides=SWARM_DEFAULTS, data=str(TEST_CORPUS), extra_args=["--device", "cpu", "--max-steps", "1"])
            t0 = time.monotonic()
            n = sw.start_seed(0)
            t1 = time.monotonic()
            p = psutil.Process(n.proc.pid)
            kids = p.children(recursive=True)
            print(arm, f"ready {t1-t0:.2f}s main {cpu(p):.2f} kids {sum(cpu(k) for k in kids):.2f} {[k.name() for k in kids]} rss {p.memory_info().rss/2**20:.0f}MiB", flush=True)
            sw.stop_all(30)
zygote.close()
