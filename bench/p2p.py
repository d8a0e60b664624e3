"""Loopback micro-benchmark of the wire: DHT lookup latency, RPC round trip, streamed throughput.

    python -m blocktrain.bench.p2p [--json] [--lookups 20] [--hops 30]

Topology (all on 127.0.0.1): node A is a separate process (``_testnode``: DHT + RPC server for
block 0, D=64); nodes B and C are DHT nodes of this process (each DHT runs in its own child
process with its own p2pd); C knows only B. C looks up A's announcement; C's p2pd calls A's RPC
service. Every figure is a median; throughput counts payload bytes in both directions.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.discovery import Discovery
from blocktrain.p2p.hops import HopRequest
from blocktrain.p2p.rpc_client import HopClient

RUN = "microbench"
HASH = "00000000deadbeef"
D = 64
BIG_N, BIG_T = 32, 2048  # 32*2048*64*4 B = 16 MiB of state


def _timed(fn: Callable[[], Any], n: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _start_server() -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "blocktrain.p2p._testnode", "--run-id", RUN, "--serve-rpc", "--blocks", "0",
         "--dim", str(D), "--max-batch", str(BIG_N), "--max-seq", str(BIG_T), "--state-floats", str(4 << 20)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
        start_new_session=True,
    )
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline() or "{}")
    if ready.get("event") != "ready":
        _kill(proc)
        raise RuntimeError(f"benchmark server failed to start: {ready}")
    return proc, ready


def _cmd(proc: subprocess.Popen[str], **c: Any) -> Any:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(c) + "\n")
    proc.stdin.flush()
    reply = json.loads(proc.stdout.readline())
    if not reply.get("ok"):
        raise RuntimeError(f"server command {c['cmd']} failed: {reply}")
    return reply["result"]


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        if proc.stdin is not None:
            proc.stdin.write('{"cmd": "quit"}\n')
            proc.stdin.flush()
        proc.wait(5)
    except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            time.sleep(0.2)
        except ProcessLookupError:
            break


def _hop(n: int, t: int) -> HopRequest:
    return HopRequest(block_index=0, state=torch.randn(n, t, D),
                      context=torch.randint(0, 256, (n, t), dtype=torch.uint8), sigmas=torch.tensor([1.0, 0.5]))


def run(lookups: int = 20, hops: int = 30, big: int = 3) -> dict[str, Any]:
    t_start = time.perf_counter()
    proc, ready = _start_server()
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
        state_bytes = (4 << 20) * 4

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
        _kill(proc)


def _table(r: dict[str, Any]) -> str:
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
    a = p.parse_args(argv)
    result = run(a.lookups, a.hops, a.large)
    if not a.json:
        print(_table(result))
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
