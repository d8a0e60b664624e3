# Session 26: hivemind 1.1.12's unary-call race, reproduced outside the test suite (tests/test_unary_guard.py is
# the kept test). Usage: python race_probe.py K [patch]   (K: yields before the loop is held; 'patch' imports
# blocktrain.p2p first, which installs p2p/unary_guard.py). Unpatched, the first raced call kills the reader.
import asyncio, sys, threading, time
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

K = int(sys.argv[1]); PATCH = len(sys.argv) > 2
if PATCH:
    import blocktrain.p2p  # noqa

def server(ready):
    async def run():
        a = await P2P.create()
        async def handler(req, ctx):
            return runtime_pb2.ExpertResponse(metadata=b"ok")
        await a.add_protobuf_handler("echo", handler, runtime_pb2.ExpertRequest)
        ready.append((a.peer_id, [str(m) for m in await a.get_visible_maddrs()]))
        await asyncio.sleep(1e6)
    asyncio.run(run())

async def main():
    ready = []
    threading.Thread(target=server, args=(ready,), daemon=True).start()
    while not ready:
        await asyncio.sleep(0.1)
    pid, maddrs = ready[0]
    b = await P2P.create(initial_peers=maddrs)
    call = lambda: b.call_protobuf_handler(pid, "echo", runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse)
    print("warm call ok", (await call()).metadata)
    loop = asyncio.get_running_loop()
    outcome = {}
    for i in range(20):
        task = asyncio.create_task(call())
        for _ in range(K):
            await asyncio.sleep(0)
        loop.call_at(loop.time() + 0.05, task.cancel)
        loop.call_soon(time.sleep, 0.3)
        try:
            await task
            outcome["answered"] = outcome.get("answered", 0) + 1
        except asyncio.CancelledError:
            outcome["cancelled"] = outcome.get("cancelled", 0) + 1
        try:
            await asyncio.wait_for(call(), 3)
        except asyncio.TimeoutError:
            print(i, "next call: NO ANSWER in 3 s (the reader died)", outcome)
            return
    print("survived 20", outcome)

asyncio.run(main())
