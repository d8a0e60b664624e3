"""Does a middle block whose next block fails every micro-batch keep memory per failed micro-batch?
(BENCHMARKS "Not done": block 1's worker of run 9 peaked at 649 MiB while failing 697 micro-batches
downstream, ~23 per second.)

One process, two real libp2p daemons on 127.0.0.1: the node's (its own engine of block 1 of a 3-block
`pipeline` run, from `start_pipeline`, its train loop `Node._run_pipeline`) and a stand-in block-2 holder
whose rpc_train answers every call `busy` (or, with `--mode absent`, is not registered: no handler). A raw
caller sends N micro-batches into block 1 (CONCURRENCY at a time); every one fails downstream. Printed
every 250: the process RSS, the torch tensors alive (gc), the engine's held / open-graph / weight-copy counts.

    OMP_NUM_THREADS=1 python docs/records/s28/failed_downstream_memory.py [--n 2000] [--mode busy|absent]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from hivemind.p2p import P2P

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from blocktrain.blocks.config import ModelConfig   # noqa: E402
from blocktrain.node.node import Node   # noqa: E402
from blocktrain.node.options import NodeOptions   # noqa: E402
from blocktrain.node.pipeline.compose import start_pipeline   # noqa: E402
from blocktrain.node.trainer import BlockTrainer   # noqa: E402
from blocktrain.p2p.aioloop import LoopThread   # noqa: E402
from blocktrain.p2p.errors import HopRequestError   # noqa: E402
from blocktrain.p2p.hops import decode_meta   # noqa: E402
from blocktrain.p2p.pipeline_rpc import PipelineServer, PipelineTraffic   # noqa: E402
from blocktrain.p2p.pipeline_wire import PipelineLimits, StageRequest, request_message   # noqa: E402

from test_utils.raw_pipeline import raw_train_call   # noqa: E402

RUN = "leakprobe"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def tensors_alive() -> tuple[int, float]:
    n, b = 0, 0
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o):
                n += 1
                b += o.numel() * o.element_size()
        except Exception:
            pass
    return n, b / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--mode", choices=("busy", "absent"), default="busy")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--deadline", type=float, default=10.0)
    ap.add_argument("--referrers", action="store_true", help="print what holds the tensors left at the end")
    args = ap.parse_args()
    torch.set_num_threads(1)
    D, T, N = args.d_model, 64, 8
    cfg = ModelConfig(objective="pipeline", n_blocks=3, d_model=D, n_heads=4, layers_per_block=1, seq_len=T,
                      batch_size=N, warmup_steps=0)
    data = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 400, dtype=np.uint8)
    loop, stop = LoopThread(name="leak"), threading.Event()
    node_p2p = loop.run(P2P.create(host_maddrs=LOCAL), timeout=60)
    maddrs = [str(a) for a in loop.run(node_p2p.get_visible_maddrs(), timeout=10)]
    other = loop.run(P2P.create(host_maddrs=LOCAL, initial_peers=maddrs), timeout=60)
    if args.mode == "busy":
        async def refuse(req):
            raise HopRequestError("busy", "stand-in block 2: always busy")
        limits = PipelineLimits(allowed_blocks={2}, n_blocks=3, mode="backprop", max_batch=64, max_seq=T, d_model=D,
                                vocab_size=cfg.vocab_size)
        stand_in = PipelineServer(other, RUN, limits, refuse, traffic=PipelineTraffic())
        loop.run(stand_in.add_block(2), timeout=30)
    holder = SimpleNamespace(peer_id=str(other.peer_id), state="online", serving=True)
    node = SimpleNamespace(
        opts=NodeOptions(checkpoint_dir=Path("/tmp/leakprobe"), run_id=RUN), cfg=cfg, run_id=RUN, p2p=node_p2p,
        peer_id=str(node_p2p.peer_id), loop=loop, router=SimpleNamespace(holders=lambda fresh: {2: [holder]}),
        auth=SimpleNamespace(restricted=False), duty=None, _after_step=lambda: None, _idle=lambda: False,
        teardown=SimpleNamespace(push=lambda *a, **k: None), trainer=BlockTrainer(cfg, 1, data, data), block_index=1)
    engine = start_pipeline(node)
    threading.Thread(target=Node._run_pipeline, args=(node, stop), daemon=True).start()
    while not engine.accepting:
        time.sleep(0.05)
    g = torch.Generator().manual_seed(0)

    def message(i):
        req = StageRequest(1, torch.randn(N, T, D, generator=g) * 0.1, torch.randint(0, 256, (N, T), generator=g),
                           "backprop", "fp32", deadline_s=args.deadline, request_id=f"m{i}")
        meta, pbs, _, _ = request_message(req)
        return decode_meta(meta), pbs

    async def one(i):
        ans, _ = await raw_train_call(other, node.peer_id, RUN, 1, *message(i))
        return ans["code"] if ans and not ans["ok"] else "ok"

    codes: dict[str, int] = {}
    t0 = time.monotonic()
    print(f"mode {args.mode}, d_model {D}, a micro-batch's state {N * T * D * 4 / 2**20:.2f} MiB; "
          f"start: rss {rss_mb():.1f} MiB, tensors {tensors_alive()}", flush=True)
    for start in range(0, args.n, args.concurrency):
        async def batch():
            return await asyncio.gather(*(one(i) for i in range(start, min(args.n, start + args.concurrency))))
        for c in loop.run(batch(), timeout=120):
            codes[c] = codes.get(c, 0) + 1
        done = min(args.n, start + args.concurrency)
        if done % 250 < args.concurrency:
            n, mb = tensors_alive()
            st = engine.stats.snapshot()
            print(f"{done:5d} sent, {time.monotonic() - t0:6.1f} s: rss {rss_mb():7.1f} MiB, tensors {n} ({mb:.1f} MiB), "
                  f"held {engine._held}, open graphs {engine._open}, weight copies {len(engine._copies)}, "
                  f"failed_downstream {st.get('failed_downstream')}, answers {codes}", flush=True)
    if args.referrers:   # what the cycle collector frees: the cycles' exceptions and frames
        gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    if args.referrers:
        kinds: dict[str, int] = {}
        for o in gc.garbage:
            k = type(o).__name__
            if isinstance(o, BaseException):
                k = f"exception {type(o).__name__}"
            elif type(o).__name__ == "frame":
                k = f"frame {o.f_code.co_name} ({o.f_code.co_filename.rsplit('/', 2)[-1]}:{o.f_lineno})"
            elif torch.is_tensor(o):
                k = f"tensor {tuple(o.shape)}"
            kinds[k] = kinds.get(k, 0) + 1
        for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]):
            if k.startswith(("exception", "frame", "tensor")):
                print(f"   in cycles: {v:4d} x {k}")
        gc.set_debug(0)
        gc.garbage.clear()
    n, mb = tensors_alive()
    print(f"after gc.collect: rss {rss_mb():.1f} MiB, tensors {n} ({mb:.1f} MiB), open graphs {engine._open}")
    if args.referrers:
        left = [o for o in gc.get_objects() if torch.is_tensor(o) and tuple(o.shape) == (N, T, D)]
        print(f"{len(left)} tensors of a state's shape alive")
        for o in left[:3]:
            for r in gc.get_referrers(o):
                if r is left:
                    continue
                desc = type(r).__name__
                if isinstance(r, dict):
                    owners = [type(x).__name__ for x in gc.get_referrers(r) if x is not left][:4]
                    desc += f" keys {list(r)[:6]} held by {owners}"
                elif isinstance(r, (list, tuple)):
                    desc += f" len {len(r)} held by {[type(x).__name__ for x in gc.get_referrers(r)][:4]}"
                print("   referrer:", desc[:300])
    stop.set()
    engine.close()
    loop.run(node_p2p.shutdown(), timeout=10)
    loop.run(other.shutdown(), timeout=10)
    loop.stop()


if __name__ == "__main__":
    main()
