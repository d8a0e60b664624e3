# Session 26: does a unary request its caller gave up on stay in hivemind's ControlClient._handler_tasks?
# Usage: python leak_probe.py [patch] N   (N calls of 1 MB given up after 0.3 s; 'patch' installs p2p/unary_guard.py)
import asyncio, sys, threading, time
if "patch" in sys.argv:
    import blocktrain.p2p  # noqa
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

async def main():
    a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    started = []
    async def slow(req, ctx):
        started.append(1)
        await asyncio.sleep(5)
        return runtime_pb2.ExpertResponse(metadata=b"ok")
    await a.add_protobuf_handler("slow", slow, runtime_pb2.ExpertRequest)
    b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in await a.get_visible_maddrs()])
    big = runtime_pb2.ExpertRequest(metadata=b"x" * 1_000_000)
    import resource, gc
    def rss(): return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
    r0 = rss()
    for i in range(int(sys.argv[-1])):
        try:
            await asyncio.wait_for(b.call_protobuf_handler(a.peer_id, "slow", big, runtime_pb2.ExpertResponse), 0.3)
        except asyncio.TimeoutError:
            pass
    await asyncio.sleep(2)
    ht = a._client.control._handler_tasks
    gc.collect(); print("RSS grew MB", rss() - r0)
    print("handlers started", len(started), "left in _handler_tasks", len(ht), "done", sum(t.done() for t in ht.values()))
    await b.shutdown(); await a.shutdown()
asyncio.run(main())
