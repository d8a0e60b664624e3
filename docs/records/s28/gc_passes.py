"""Run bt-node in this process with the cycle collector's passes timed (gc.callbacks); at exit, or on
SIGTERM, write a JSON summary to $GC_LOG. BT_GC_FREEZE_PROBE=1 freezes after imports."""
import gc, json, os, sys, time, atexit, signal
events = []
stats = {g: {"n": 0, "total_ms": 0.0, "max_ms": 0.0, "collected": 0} for g in (0, 1, 2)}
t0 = [0.0]
def cb(phase, info):
    if phase == "start":
        t0[0] = time.perf_counter()
    else:
        ms = (time.perf_counter() - t0[0]) * 1000
        s = stats[info["generation"]]
        s["n"] += 1; s["total_ms"] += ms; s["max_ms"] = max(s["max_ms"], ms); s["collected"] += info["collected"]
        if info["generation"] == 2:
            import traceback
            who = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack(limit=6)[:-1]]
            events.append([round(time.monotonic() - start, 2), round(ms, 1), info["collected"], who])
gc.callbacks.append(cb)
start = time.monotonic()
def dump():
    with open(os.environ["GC_LOG"], "w") as f:
        json.dump({"wall_s": time.monotonic() - start, "stats": stats, "objects": len(gc.get_objects()),
                   "frozen": gc.get_freeze_count(), "gen2": events}, f)
atexit.register(dump)
from blocktrain.cli.main import main
import blocktrain.node.node, blocktrain.p2p.averager, blocktrain.node.http.server  # noqa: E401 (the node's imports)
if os.environ.get("BT_GC_FREEZE_PROBE") == "1":
    gc.collect(); gc.freeze()
sys.argv = ["bt-node", *sys.argv[1:]]
main()
