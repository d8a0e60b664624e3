import os, subprocess, sys, time, tempfile, json
def run(eager):
    d = tempfile.mkdtemp()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BT_EAGER_IMPORTS": eager}
    p = subprocess.Popen([sys.executable, "-m", "blocktrain.cli.main", "seed", "--run-id", "cpu", "--block", "0", "--device", "cpu",
                          "--checkpoint-dir", d + "/ck", "--ready-file", d + "/ready.json", "--quiet", "--objective", "paper",
                          "--data", "/work/shared/data/wikitext-2-raw", "--http-port", "0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        while not os.path.exists(d + "/ready.json"):
            time.sleep(0.05)
        with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / tck
    finally:
        p.send_signal(2); p.wait(60)
res = {"": [], "torch": []}
for i in range(5):
    for e in ("", "torch"):
        res[e].append(run(e))
print(json.dumps(res))
import statistics
for e, v in res.items(): print(e or "lean", "median", statistics.median(v), sorted(v))
