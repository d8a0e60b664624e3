"""Loopback micro-benchmark of the wire: DHT lookup latency, RPC round trip, streamed throughput.

    python -m blocktrain.bench.p2p [--json] [--lookups 20] [--hops 30]     (or: bt-node bench p2p)

Topology (all on 127.0.0.1): node A is a separate process (this module with ``--serve``: DHT + RPC
server for block 0, D=64, a deterministic hop); nodes B and C are DHT nodes of this process (each
DHT runs in its own child process with its own p2pd); C knows only B. C looks up A's
announcement; C's p2pd calls A's RPC service. Every figure is a median; throughput counts payload
bytes in both directions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blocktrain.node.swarm.launcher import ManagedProcess
from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.discovery import Discovery
from blocktrain.p2p.hops import HopLimits, HopRequest, HopResponse
from blocktrain.p2p.records import BlockAnnouncement
from blocktrain.p2p.rpc_client import HopClient
from blocktrain.p2p.rpc_server import BlockRPCServer

RUN = "microbench"
HASH = "00000000deadbeef"
D = 64
BIG_N, BIG_T = 32, 2048  # 32*2048*64*4 B = 16 MiB of state
STATE_FLOATS = 4 << 20   # the served block state: 16 MiB of float32


def _timed(fn: Callable[[], Any], n: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- node A: the server process (--serve) -----------------------------------------------------------
def _serve_hop(req: HopRequest) -> HopResponse:
    """Deterministic and cheap, so the figures time the wire: ``state * 0.5 + sigma`` (sigma = the
    first noise level of each row), logits one-hot of the context."""
    sigma = req.sigmas.reshape(-1, 2)[:, 0].to(torch.float32)
    n = req.state.shape[0]
    out = req.state.float() * 0.5 + sigma.expand(n).reshape(n, 1, 1)
    logits = torch.nn.functional.one_hot(req.context.long(), 256).float() if req.want_logits else None
    return HopResponse(req.request_id, out.to(req.state.dtype), logits)


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve() -> None:
    """Node A: print ``{"event": "ready", "peer_id", "maddrs"}``, then answer JSON-line commands on
    stdin (``{"cmd": "announce", "block_index": 0, "config_hash": H}``, ``{"cmd": "quit"}``)."""
    disc = Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=[RUN])
    loop = LoopThread()
    server = None
    try:
        p2p = loop.run(disc.dht.replicate_p2p())
        limits = HopLimits(allowed_blocks=frozenset({0}), max_batch=BIG_N, max_seq=BIG_T, state_dim=D, vocab_size=256)
        server = BlockRPCServer(p2p, RUN, limits, _serve_hop,
                                lambda b: ({"block": b, "step": 7},
                                           {"weight": torch.arange(STATE_FLOATS, dtype=torch.float32),
                                            "bias": torch.ones(3)}))
        loop.run(server.add_block(0))
        _reply({"event": "ready", "peer_id": disc.peer_id, "maddrs": disc.visible_maddrs()})
        for line in sys.stdin:
            c = json.loads(line) if line.strip() else {}
            if c.get("cmd") == "quit":
                _reply({"ok": True, "result": None})
                break
            if c.get("cmd") == "announce":
                ann = BlockAnnouncement(
                    peer_id=disc.peer_id, block_index=c["block_index"], state="online", step=0, samples_seen=0,
                    throughput=1.0, serving=True, addresses=disc.visible_maddrs(),
                    software_version="bench", config_hash=c["config_hash"], run_id=RUN)
                _reply({"ok": True, "result": disc.announce(ann)})
            elif c:
                _reply({"ok": False, "error": "ValueError", "message": f"unknown command {c.get('cmd')!r}"})
    finally:
        if server is not None:
            try:
                loop.run(server.close(), timeout=5)
            except Exception:
                pass
        loop.stop()
        disc.shutdown(withdraw=False)


# -- the client side --------------------------------------------------------------------------------
def _start_server(log_dir: Path) -> tuple[ManagedProcess, dict[str, Any]]:
    server = ManagedProcess("bench-p2p-server", log_dir / "server.log")
    server.start_process([sys.executable, "-m", "blocktrain.bench.p2p", "--serve"], pipe_stdio=True)
    ready = json.loads(server.proc.stdout.readline() or "{}")
    if ready.get("event") != "ready":
        _stop(server)
        raise RuntimeError(f"benchmark server failed to start: {ready}; log: {server.tail()}")
    return server, ready


def _cmd(server: ManagedProcess, **c: Any) -> Any:
    server.proc.stdin.write(json.dumps(c) + "\n")
    server.proc.stdin.flush()
    reply = json.loads(server.proc.stdout.readline() or "{}")
    if not reply.get("ok"):
        raise RuntimeError(f"server command {c['cmd']} failed: {reply}")
    return reply["result"]


def _stop(server: ManagedProcess) -> None:
    try:
        server.proc.stdin.write('{"cmd": "quit"}\n')
        server.proc.stdin.flush()
    except (BrokenPipeError, OSError):
        pass
    server.wait(5)
    server.stop(timeout=0.2)


def _hop(n: int, t: int) -> HopRequest:
    return HopRequest(block_index=0, state=torch.randn(n, t, D),
                      context=torch.randint(0, 256, (n, t), dtype=torch.uint8), sigmas=torch.tensor([1.0, 0.5]))


def run(lookups: int = 20, hops: int = 30, big: int = 3) -> dict[str, Any]:
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bt-bench-p2p-") as logs:
        proc, ready = _start_server(Path(logs))
        b = c = None
        loop = None
        try:
            b = Discovery.start(initial_peers=ready["maddrs"], run_ids=[RUN])
            c = Discovery.start(initial_peers=b.visible_maddrs(), run_ids=[RUN])
            _cmd(proc, cmd="announce", block_index=0, config_hash=HASH)
            deadline = time.monotonic() + 10
            while not c.list_holders(RUN, HASH).get(0) and time.monotonic() < deadline:
                time.sleep(0.2)
            lookup_s = _timed(lambda: c.list_holders(RUN, HASH), lookups)

            loop = LoopThread()
            p2p = loop.run(c.dht.replicate_p2p())
            client = HopClient(p2p, RUN, loop=loop, default_timeout=60)
            small = _hop(1, 256)
            rtt_s = _timed(lambda: client.forward_sync(ready["peer_id"], small), hops, warmup=3)

            large = _hop(BIG_N, BIG_T)
            before = client.traffic.snapshot()
            big_s = _timed(lambda: client.forward_sync(ready["peer_id"], large), big, warmup=1)
            after = client.traffic.snapshot()
            per_call = (after.bytes_sent + after.bytes_received - before.bytes_sent - before.bytes_received) / big
            state_s = _timed(lambda: client.get_block_state_sync(ready["peer_id"], 0), big, warmup=1)
            state_bytes = STATE_FLOATS * 4

            return {
                "dht_lookup_ms_median": 1e3 * statistics.median(lookup_s),
                "dht_lookup_ms_p90": 1e3 * sorted(lookup_s)[int(0.9 * (len(lookup_s) - 1))],
                "rpc_small_hop_shape": [1, 256, D],
                "rpc_rtt_ms_median": 1e3 * statistics.median(rtt_s),
                "rpc_rtt_ms_p90": 1e3 * sorted(rtt_s)[int(0.9 * (len(rtt_s) - 1))],
                "rpc_large_hop_MiB_each_way": large.state.numel() * 4 / 2**20,
                "rpc_large_hop_s_median": statistics.median(big_s),
                "rpc_large_hop_MBps_both_ways": per_call / statistics.median(big_s) / 1e6,
                "state_download_MiB": state_bytes / 2**20,
                "state_download_MBps": state_bytes / statistics.median(state_s) / 1e6,
                "samples": {"lookups": lookups, "hops": hops, "large": big},
                "total_s": time.perf_counter() - t_start,
            }
        finally:
            if loop is not None:
                loop.stop()
            for d in (c, b):
                if d is not None:
                    d.shutdown(withdraw=False)
            _stop(proc)


def table(r: dict[str, Any]) -> str:
    rows = [
        ("DHT lookup (list_holders, C via B)", f"{r['dht_lookup_ms_median']:.1f} ms",
         f"p90 {r['dht_lookup_ms_p90']:.1f} ms"),
        ("RPC round trip, hop (1,256,64) fp32", f"{r['rpc_rtt_ms_median']:.1f} ms",
         f"p90 {r['rpc_rtt_ms_p90']:.1f} ms"),
        (f"RPC streamed hop, {r['rpc_large_hop_MiB_each_way']:.0f} MiB each way",
         f"{r['rpc_large_hop_s_median']:.2f} s", f"{r['rpc_large_hop_MBps_both_ways']:.0f} MB/s both ways"),
        (f"block state download, {r['state_download_MiB']:.0f} MiB", f"{r['state_download_MBps']:.0f} MB/s", ""),
    ]
    w = max(len(a) for a, _, _ in rows)
    lines = [f"{'measure (medians, loopback)':<{w}}  {'value':>12}  note", "-" * (w + 40)]
    lines += [f"{a:<{w}}  {b:>12}  {c}" for a, b, c in rows]
    lines.append(f"(total {r['total_s']:.1f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--lookups", type=int, default=20)
    p.add_argument("--hops", type=int, default=30)
    p.add_argument("--large", type=int, default=3)
    p.add_argument("--serve", action="store_true", help="run node A (the benchmark starts it itself)")
    a = p.parse_args(argv)
    if a.serve:
        serve()
        return
    result = run(a.lookups, a.hops, a.large)
    if not a.json:
        print(table(result))
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
