"""Connections that hold the HTTP server without asking anything (slowloris) or too many from one address.

uvicorn answers 503 to every request once ``limit_concurrency`` connections are open, and it has no
deadline for a request's head: 64 sockets that each sent half a request line kept every other client
of a node out for as long as they stayed open (RELIABILITY.md). :func:`guarded` wraps the HTTP
protocol class uvicorn would use with two rules:

- a connection must complete a request's head within ``head_timeout_s`` of opening, and within that
  long of its previous response (a keep-alive connection dribbling its next request); else it is
  closed. A request whose head has arrived is never cut (a long generation, a slow body: the API's
  body limit and rate limiter deal with those);
- one client address holds at most ``per_client`` open connections; a further one is answered 503
  with the reason and closed at once. (Behind a reverse proxy on 127.0.0.1 every client is the
  proxy's address: its pool of upstream connections must stay under the limit.)

Both count into the API's counters (``/metrics``: ``blocktrain_http_connections_closed_slow_total``,
``blocktrain_http_connections_refused_total``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0
PER_CLIENT_CONNECTIONS = 16
WARN_EVERY_S = 60.0


def _refusal(limit: int) -> bytes:
    body = json.dumps({"detail": f"too many open connections from this address (at most {limit})"}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def guarded(base: type[asyncio.Protocol], counters: dict, *, head_timeout_s: float = HEAD_TIMEOUT_S,
            per_client: int = PER_CLIENT_CONNECTIONS) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol class ``base`` (h11 or httptools: both keep the request in
    progress as ``self.cycle`` and call ``on_response_complete``) enforcing the two rules above."""
    open_by_client: dict[str, int] = {}   # one server's protocols all run on its one event loop
    warned: dict[str, float] = {}         # address -> when its refusal was last logged

    class GuardedHTTP(base):   # type: ignore[misc, valid-type]
        _bt_client: str | None = None
        _bt_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:   # type: ignore[override]
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._bt_client = peer[0] if isinstance(peer, (tuple, list)) and peer else str(peer)
            n = open_by_client.get(self._bt_client, 0) + 1
            open_by_client[self._bt_client] = n
            if n > per_client:
                counters["connections_refused"] = counters.get("connections_refused", 0) + 1
                now = time.monotonic()
                if now - warned.get(self._bt_client, -1e9) > WARN_EVERY_S:   # a reconnecting client: once a minute
                    warned[self._bt_client] = now
                    if len(warned) > 1024:
                        warned.clear()
                    log.warning("HTTP: %s holds %d connections, the limit; refusing more", self._bt_client, per_client)
                transport.write(_refusal(per_client))
                transport.close()
                return
            self._bt_arm(None)

        def connection_lost(self, exc) -> None:
            self._bt_disarm()
            if self._bt_client is not None:
                left = open_by_client.get(self._bt_client, 1) - 1
                if left > 0:
                    open_by_client[self._bt_client] = left
                else:
                    open_by_client.pop(self._bt_client, None)
                self._bt_client = None
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._bt_arm(self.cycle)   # the next request's head has the same deadline

        def _bt_arm(self, cycle) -> None:
            self._bt_disarm()
            loop = asyncio.get_running_loop()
            self._bt_timer = loop.call_later(head_timeout_s, self._bt_expired, cycle)

        def _bt_disarm(self) -> None:
            if self._bt_timer is not None:
                self._bt_timer.cancel()
                self._bt_timer = None

        def _bt_expired(self, cycle) -> None:
            self._bt_timer = None
            idle = cycle is None or getattr(cycle, "response_complete", True)   # a request in progress is never cut
            if self.cycle is cycle and idle and not self.transport.is_closing():   # no new request's head since
                counters["connections_closed_slow"] = counters.get("connections_closed_slow", 0) + 1
                self.transport.close()

    GuardedHTTP.__name__ = GuardedHTTP.__qualname__ = f"Guarded{base.__name__}"
    return GuardedHTTP
