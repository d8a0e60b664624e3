"""A process holding one Discovery (its hivemind DHT process and p2pd) whose own main thread shrugs
off SIGINT and SIGTERM, as a node's stop handler does while it leaves: for tests/test_lifecycle.py,
which signals this process's whole group and then asks whether the DHT still answers.

JSON lines: prints ``{"event": "ready", "maddrs": [...]}``; on ``{"cmd": "check"}`` prints
``{"ok": true, "result": {"answers": bool, "error": str|null}}``; on ``{"cmd": "quit"}`` stops.
"""
from __future__ import annotations

import concurrent.futures
import json
import signal
import sys

from blocktrain.p2p.discovery import Discovery


def main() -> None:
    got: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _f: got.append(signum))
    disc = Discovery.start(run_ids=["probe"])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    print(json.dumps({"event": "ready", "maddrs": disc.visible_maddrs()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "quit":
            break
        try:   # a dead DHT process never answers, a dead p2pd answers with an error: bounded either way
            answers, error = bool(pool.submit(disc.visible_maddrs).result(timeout=10)), None
        except Exception as e:
            answers, error = False, f"{type(e).__name__}: {e}"
        print(json.dumps({"ok": True, "result": {"answers": answers, "error": error, "signals": got}}), flush=True)
    pool.shutdown(wait=False)
    disc.shutdown(withdraw=False)


if __name__ == "__main__":
    main()
