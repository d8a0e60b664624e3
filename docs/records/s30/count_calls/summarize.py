"""Sum the PREFIX.<pid> files the counting sitecustomize wrote: python summarize.py PREFIX"""
import glob, json, sys, collections
c = collections.Counter()
for f in glob.glob(sys.argv[1] + ".*"):
    for k, v in json.loads(open(f).read())["calls"].items():
        if k.startswith("DHT."):
            kind = k.split(" <- ")[0]
            where = ("matchmaking search" if "matchmaking.py:503" in k else "state offer (declare loop)" if "averager.py:609" in k
                     else "matchmaking declare" if "matchmaking.py:5" in k else "blocktrain discovery" if "discovery.py" in k else "other")
            c[f"{kind} {where}"] += v
        else:
            c[k] += v
for k, v in c.most_common(12): print(f"{v:7d} {k}")
