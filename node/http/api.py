"""The HTTP API every node serves (FastAPI): generate, score, status, metrics, and the web page.

The app talks to an ``ApiBackend`` (the running node) and never to the network directly. Limits:
request bodies are capped, concurrent heavy requests are capped (503 when full), and each client
address has a token-bucket rate limit (429). Bad requests get 4xx with a JSON ``detail``.
"""
from __future__ import annotations

import threading
import time
from typing import Literal, Protocol

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field

MAX_BODY_BYTES = 256 * 1024


class GenerateRequest(BaseModel):
    model_config = {"extra": "forbid"}
    prompt: str = Field("", max_length=4096, description="Text to continue (UTF-8).")
    max_bytes: int = Field(64, ge=1, le=1024, description="Bytes to generate.")
    mode: Literal["one_sweep", "autoregressive"] = "one_sweep"
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)


class HopInfo(BaseModel):
    block: int
    peer: str


class GenerateResponse(BaseModel):
    text: str
    bytes_generated: int
    mode: str
    route: list[HopInfo]
    traversals: int
    latency_ms: float
    failovers: int = 0
    bytes_out: int = 0
    bytes_in: int = 0


class ScoreRequest(BaseModel):
    model_config = {"extra": "forbid"}
    text: str = Field(..., min_length=2, max_length=65536, description="Text to score (UTF-8).")
    k: int = Field(2, ge=1, le=8, description="Chain samples averaged.")


class ScoreResponse(BaseModel):
    ce: float
    ce_kind: str
    bytes_scored: int
    k: int
    route: list[HopInfo]


class ApiBackend(Protocol):
    """What the API asks of the node (``node.Node`` is one)."""
    def generate(self, prompt: bytes, max_bytes: int, mode: str, seed: int | None,
                 temperature: float) -> dict: ...
    def score(self, text: bytes, k: int) -> dict: ...
    def evaluate(self) -> dict: ...
    def average_now(self) -> dict: ...
    def snapshot(self): ...   # a NodeStatus: .to_dict() for /v1/status, .metrics() for /metrics


class RequestRefused(Exception):
    """Raised by a backend for a request it cannot serve; carries an HTTP status."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


class _RateLimiter:
    def __init__(self, rate_per_s: float, burst: int):
        self.rate, self.burst = rate_per_s, burst
        self.buckets: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def allow(self, key: str) -> bool:
        now = time.monotonic()
        with self.lock:
            tokens, last = self.buckets.get(key, (float(self.burst), now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if len(self.buckets) > 10_000:   # bounded memory under many clients
                self.buckets.clear()
            if tokens < 1:
                self.buckets[key] = (tokens, now)
                return False
            self.buckets[key] = (tokens - 1, now)
            return True


class BodyLimitMiddleware:
    """Caps request bodies whatever their framing: reads at most ``max_bytes`` (chunked uploads
    without Content-Length included) before the app sees the request, else answers 413."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":   # the client went away
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                response = JSONResponse({"detail": f"request body over {self.max_bytes} bytes"}, status_code=413)
                return await response(scope, receive, send)
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def _validation_detail(exc: RequestValidationError) -> list[dict]:
    """FastAPI's default answer echoes the offending input, which fails to encode for non-UTF-8
    bytes or NaN tokens (a 500); answer with type, location and message only."""
    return [{"type": str(e.get("type", "")), "loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", ""))}
            for e in exc.errors()]


def create_app(backend: ApiBackend, *, max_concurrent: int = 4, rate_per_s: float = 5.0, burst: int = 20,
               static_dir: str | None = None) -> FastAPI:
    app = FastAPI(title="BlockTrain node", version="1", description=(
        "Ask this node for text generated by the whole chain of blocks, score text, or read the "
        "state of the run. Any node answers: it routes through live holders of every block."))
    heavy = threading.BoundedSemaphore(max_concurrent)
    limiter = _RateLimiter(rate_per_s, burst)
    counters = {"requests": 0, "rejected_rate": 0, "rejected_busy": 0, "errors": 0}

    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse({"detail": _validation_detail(exc)}, status_code=422)

    @app.middleware("http")
    async def limits(request: Request, call_next):
        counters["requests"] += 1
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return JSONResponse({"detail": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        if request.url.path.startswith("/v1/") and request.method == "POST":
            client = request.client.host if request.client else "?"
            if not limiter.allow(client):
                counters["rejected_rate"] += 1
                return JSONResponse({"detail": "rate limit exceeded; slow down"}, status_code=429)
        return await call_next(request)

    def run_heavy(fn):
        if not heavy.acquire(blocking=False):
            counters["rejected_busy"] += 1
            raise HTTPException(503, "node busy: too many requests in flight, retry shortly")
        try:
            return fn()
        except RequestRefused as e:
            raise HTTPException(e.status, e.detail) from None
        except (ValueError, LookupError) as e:
            raise HTTPException(422, str(e)) from None
        except (TimeoutError, ConnectionError, RuntimeError) as e:
            counters["errors"] += 1
            raise HTTPException(503, f"the network could not serve this request: {e}") from None
        finally:
            heavy.release()

    @app.post("/v1/generate", response_model=GenerateResponse, summary="Generate text through the chain")
    def generate(req: GenerateRequest):
        return run_heavy(lambda: backend.generate(req.prompt.encode("utf-8"), req.max_bytes, req.mode,
                                                  req.seed, req.temperature))

    @app.post("/v1/score", response_model=ScoreResponse, summary="Held-out nats/byte of a text")
    def score(req: ScoreRequest):
        return run_heavy(lambda: backend.score(req.text.encode("utf-8"), req.k))

    @app.post("/v1/eval", summary="Measure held-out chain CE through the network now")
    def evaluate():
        return run_heavy(backend.evaluate)

    @app.post("/v1/average", summary="Run one averaging round with same-block peers now")
    def average():
        return run_heavy(backend.average_now)

    @app.get("/v1/status", summary="Run, blocks, holders, steps, losses, averaging rounds")
    def status():
        return backend.snapshot().to_dict()

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    def metrics():
        values = {**backend.snapshot().metrics(), **{f"http_{k}_total": float(v) for k, v in counters.items()}}
        lines = []
        for name, v in sorted(values.items()):
            lines.append(f"# TYPE blocktrain_{name} {'counter' if name.endswith('_total') else 'gauge'}")
            lines.append(f"blocktrain_{name} {float(v)!r}")
        return "\n".join(lines) + "\n"

    if static_dir is not None:
        from fastapi.staticfiles import StaticFiles
        from fastapi.responses import FileResponse
        import os

        app.mount("/static", StaticFiles(directory=static_dir), name="static")

        @app.get("/", include_in_schema=False)
        def index():
            return FileResponse(os.path.join(static_dir, "index.html"))

    return app
