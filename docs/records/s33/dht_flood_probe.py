"""An outsider stores junk in a node's DHT (session 33): N keys of B bytes each, in batches of 500, sent
straight to the node with hivemind's store RPC, then reads the node's memory (RSS of the process that runs
its DHT). Usage: python dht_flood_probe.py MULTIADDR NODE_PID [N=20000] [B=2000] [TTL_S=3600]"""
import json
import os
import sys
import time

import psutil
import asyncio

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

maddr, pid = sys.argv[1], int(sys.argv[2])
n = int(sys.argv[3]) if len(sys.argv) > 3 else 20000
size = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
ttl = float(sys.argv[5]) if len(sys.argv) > 5 else 3600.0
proc = psutil.Process(pid)
rss = lambda: proc.memory_info().rss / 2**20  # noqa: E731
before = rss()
target = PeerID.from_base58(maddr.rsplit("/", 1)[1])


async def flood(node):
    stored = refused = 0
    for start in range(0, n, 500):
        keys = [DHTID.generate(source=f"junk-{os.getpid()}-{i}") for i in range(start, min(n, start + 500))]
        values = [os.urandom(size) for _ in keys]
        exp = [get_dht_time() + ttl] * len(keys)
        res = await node.protocol.call_store(target, keys, values, exp)
        if res is None:
            refused += len(keys)
        else:
            stored += sum(bool(r) for r in res)
            refused += sum(not r for r in res)
    return stored, refused

async def main():
    node = await DHTNode.create(initial_peers=[maddr], client_mode=True)
    try:
        t0 = time.monotonic()
        stored, refused = await flood(node)
        return stored, refused, time.monotonic() - t0
    finally:
        await node.shutdown()

stored, refused, took = asyncio.run(main())
time.sleep(2)
after = rss()
print(json.dumps({"keys": n, "value_bytes": size, "stored": stored, "refused": refused, "seconds": round(took, 1),
                  "rss_before_mib": round(before), "rss_after_mib": round(after)}))
