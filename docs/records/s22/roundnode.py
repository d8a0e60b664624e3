"""A round's memory on real node processes: two `bt-node` nodes hold block 0 of a d_model-768
`pipeline` run (2 blocks x 3 layers: a block of 21.3M parameters, 81 MiB of fp32 weights), train
nothing (--max-steps 0), and average when told (POST /v1/average on both at once). Before each round
each node's VmHWM is reset to its VmRSS (/proc/PID/clear_refs); after it, VmHWM - VmRSS before is
the round's peak in that node's main process (hivemind runs in its threads; p2pd is apart). Three
rounds. Prints one JSON line.   python docs/records/s22/roundnode.py WORKDIR
"""
import json
import sys
import threading
import time

from blocktrain.node.swarm.launcher import LocalSwarm

BLOCK_MIB = None
SHAPE = ["objective=pipeline", "d_model=768", "n_heads=12", "layers_per_block=3", "n_blocks=2", "seq_len=256",
         "batch_size=16", "target_dim=16"]
ARGS = ["--max-steps", "0", "--average-period", "1e9", "--checkpoint-every", str(10**9)]


def kib(pid, key):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key):
            return int(line.split()[1])


sw = LocalSwarm(sys.argv[1], run_id="r22", overrides=SHAPE, data="tests/data/lord-arthur-savile",
                extra_args=ARGS)
out = {"rounds": []}
try:
    sw.start_seed(block=0, http_port=0)
    sw.start_join(block=0)
    time.sleep(20)                                   # both announced; the joiner's download settled
    a, b = sw.nodes
    pids = [n.proc.pid for n in sw.nodes]
    for k in range(3):
        before = []
        for pid in pids:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
            before.append(kib(pid, "VmRSS:"))
        res = {}

        def go(n, i):
            job = n.post("/v1/average", {}).json()
            while True:
                j = n.get(f"/v1/jobs/{job['job_id']}")
                if j["status"] != "running":
                    res[i] = j
                    return
                time.sleep(0.5)
        ths = [threading.Thread(target=go, args=(n, i)) for i, n in enumerate(sw.nodes)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        peaks = [round((kib(pid, "VmHWM:") - rss) / 1024, 1) for pid, rss in zip(pids, before)]
        out["rounds"].append({"utc": time.strftime("%H:%M:%S", time.gmtime()), "rss_before_mib":
                              [round(r / 1024, 1) for r in before], "peak_above_mib": peaks,
                              "results": [res.get(i, {}).get("result") for i in range(2)]})
        time.sleep(5)
    st = sw.nodes[0].get("/v1/status")
    out["params"] = st.get("self", {}).get("params") or st.get("params")
finally:
    sw.stop_all()
print(json.dumps(out))
