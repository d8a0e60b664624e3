"""Summarise docs/records/s35/proc_acct_sitecustomize.py logs by kind of process (session 35):
python docs/records/s35/proc_acct_report.py DIR."""
import json, glob, sys, collections, os
D = sys.argv[1]   # the BT_PROC_ACCT folder (its .stat0/.stat1: /proc/stat before and after, optional)
rows = []
for p in glob.glob(f"{D}/*.json"):
    try: rows.append(json.load(open(p)))
    except Exception: pass
def kind(r):
    a = r["argv"]; s = " ".join(a)
    if "xdist" in s or "execnet" in s or "exec(eval" in s: return "pytest-worker"
    if "pytest" in s: return "pytest-main"
    if " pip " in s or s.endswith(" pip"): return "pip"
    for i, x in enumerate(a):
        if x.endswith("bt-node") or x.endswith("blocktrain.cli.main"):
            return "bt-node " + (a[i+1] if i+1 < len(a) else "")
        if x.endswith(".py"):
            return "script " + os.path.basename(x)
        if x == "-m" and i+1 < len(a): return "-m " + a[i+1]
        if x == "-c": return "-c " + (a[i+1][:40] if i+1 < len(a) else "")
    return s[:60]
by = collections.defaultdict(lambda: [0, 0.0, 0.0])
for r in rows:
    k = kind(r); by[k][0] += 1; by[k][1] += r["cpu"]; by[k][2] += r["t1"] - r["t0"]
tot = sum(v[1] for v in by.values())
print(f"python processes {len(rows)}, cpu {tot:.0f} s")
for k, (n, c, w) in sorted(by.items(), key=lambda kv: -kv[1][1])[:40]:
    print(f"{c:8.1f} cpu  {n:5d} procs  {c/n:6.2f}/proc  {w/n:7.1f} s alive/proc  {k}")
try:
    s0 = list(map(int, open(f"{D}.stat0").read().split()[1:])); s1 = list(map(int, open(f"{D}.stat1").read().split()[1:]))
    d = [b - a for a, b in zip(s0, s1)]
    busy = (sum(d) - d[3] - d[4]) / os.sysconf("SC_CLK_TCK")
    print(f"machine busy cpu {busy:.0f} s (idle {d[3]/100:.0f}, iowait {d[4]/100:.0f})")
except Exception as e: print(e)
