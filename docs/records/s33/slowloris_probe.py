"""Slowloris against a running node's HTTP API (session 33): N sockets from 127.0.0.1 that each send half
a request head and never finish it; then plain requests from 127.0.0.2 (another client) and 127.0.0.1 (the
attacker's address) at 1, 12 and 30 s. Usage: python slowloris_probe.py HTTP_PORT [N=200]

Before node/http/guard.py: every request 503 at 1, 10 and 30 s; all 200 sockets still open at 30 s.
After: 16 sockets kept (the per-address limit), 184 answered 503 at once; 127.0.0.2 served at 1 s; the
attacker's address served again at 12 s (its 16 closed by the 10 s head deadline)."""
import socket
import sys
import time
from collections import Counter

import httpx

port, n = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 200
t_start = time.monotonic()
socks = []
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.send(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
    socks.append(s)


def state(s):
    s.settimeout(0.01)
    try:
        d = s.recv(100)
        return "closed" if not d else d.split(b"\r\n")[0].decode()
    except socket.timeout:
        return "open"
    except OSError:
        return "closed"


time.sleep(0.3)
print("after 0.3 s:", dict(Counter(state(s) for s in socks)))
for t in (1, 12, 30):
    time.sleep(max(0.0, t - (time.monotonic() - t_start)))
    for src in ("127.0.0.2", "127.0.0.1"):
        t0 = time.monotonic()
        try:
            with httpx.Client(transport=httpx.HTTPTransport(local_address=src), timeout=5) as c:
                code = c.get(f"http://127.0.0.1:{port}/v1/status").status_code
        except httpx.HTTPError as e:
            code = type(e).__name__
        print(f"{t:>3} s  from {src}: {code} in {time.monotonic() - t0:.3f} s")
print("after 30 s:", dict(Counter(state(s) if state(s) in ("open", "closed") else "answered 503" for s in socks)))
