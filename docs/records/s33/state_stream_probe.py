"""Many concurrent block-state downloads that read only the first message, against a running node
(session 33). Usage: python state_stream_probe.py MULTIADDR RUN_ID NODE_PID [STREAMS=40] [HOLD_S=20]
Prints the node's main-process RSS before, while the streams are held, and after they are dropped."""
import asyncio
import json
import sys
import time

import psutil
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from blocktrain.node.client import NetworkClient
from blocktrain.p2p.hops import WIRE_VERSION, decode_meta, encode_meta, namespace
from blocktrain.p2p.rpc_server import BlockService

maddr, run, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
n = int(sys.argv[4]) if len(sys.argv) > 4 else 40
hold = float(sys.argv[5]) if len(sys.argv) > 5 else 20.0
proc = psutil.Process(pid)
rss = lambda: proc.memory_info().rss / 2**20  # noqa: E731
client = NetworkClient([maddr], run)
peer = PeerID.from_base58(maddr.rsplit("/", 1)[1])
stub = BlockService.get_stub(client.hop_client.p2p, peer, namespace=namespace(run, 0))
meta = encode_meta({"v": WIRE_VERSION, "request_id": "probe", "block_index": 0})
print(f"node RSS before: {rss():.0f} MiB", flush=True)


async def held():
    streams, heads = [], []
    for _ in range(n):
        s = await stub.rpc_state(runtime_pb2.ExpertRequest(metadata=meta))
        first = await s.__anext__()
        heads.append(decode_meta(first.metadata).get("code", "ok"))
        streams.append(s)
    return streams, heads

streams, heads = client.loop.run(held(), timeout=300)
print("answers:", {h: heads.count(h) for h in set(heads)}, flush=True)
peak = 0.0
t0 = time.monotonic()
while time.monotonic() - t0 < hold:
    peak = max(peak, rss())
    time.sleep(0.5)
print(f"node RSS while {n} streams are held unread: peak {peak:.0f} MiB", flush=True)


async def drop():
    for s in streams:
        await s.aclose()
client.loop.run(drop(), timeout=60)
time.sleep(5)
print(f"node RSS 5 s after they were closed: {rss():.0f} MiB", flush=True)
print(json.dumps({"streams": n, "answers": {h: heads.count(h) for h in set(heads)}, "peak_mib": round(peak)}))
client.close()
