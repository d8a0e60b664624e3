"""Runs the FastAPI app (``api.py``) with uvicorn in a background thread of the node."""
from __future__ import annotations

import threading
import time
from importlib import resources

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from blocktrain.node.http.api import create_app
from blocktrain.node.http.guard import guarded


def static_dir() -> str | None:
    d = resources.files("blocktrain.node.http") / "static"
    return str(d) if d.is_dir() else None


class HttpServer:
    def __init__(self, backend, host: str, port: int, operator_token: bytes | None = None):
        app = create_app(backend, static_dir=static_dir(), operator_token=operator_token)
        # X-Forwarded-For is believed from a proxy on 127.0.0.1 only: the client behind such a proxy
        # is then who operator.py judges (remote, unless it sends the token), and nobody else can
        # claim an address they do not connect from
        # AutoHTTPProtocol: the class uvicorn's http="auto" picks (httptools if installed, else h11), with
        # a deadline for each request's head and a per-address connection limit (guard.py: slowloris)
        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                     http=guarded(AutoHTTPProtocol, app.state.bt_counters),
                                     timeout_graceful_shutdown=3, limit_concurrency=64,
                                     proxy_headers=True, forwarded_allow_ips="127.0.0.1")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="bt-http", daemon=True)

    def start(self, timeout: float = 15.0) -> None:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive():
                raise OSError(f"HTTP server could not start on {self.config.host}:{self.config.port} "
                              "(port in use?)")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("HTTP server did not start in time")
            time.sleep(0.05)

    @property
    def port(self) -> int:
        for s in self.server.servers:
            for sock in s.sockets:
                return sock.getsockname()[1]
        return self.config.port

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
