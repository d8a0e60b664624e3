"""The HTTP API every node serves (FastAPI): generate, score, status, metrics, operator jobs and the
web page.

The app talks to an ``ApiBackend`` (the running node) and never to the network directly. Limits:
request bodies are capped (413), concurrent heavy requests are capped (503 when full), and each
client address has a token-bucket rate limit on POSTs (429). Every status a route can answer is in
``/openapi.json`` with its body: errors are ``{"detail": "..."}`` (``ErrorBody``), except 422,
whose ``detail`` lists what is wrong where (``ValidationErrorBody``). Operator actions (averaging,
held-out eval) are local-only unless the node has an operator token (``operator.py``), and answer
at once with a job to poll (``jobs.py``).

No ``from __future__ import annotations`` here: the request model of ``/v1/generate`` is built per
run (its length limit depends on the objective and seq_len) and FastAPI must see it as a class.
"""
import threading
import time
from typing import Annotated, ClassVar, Literal, Protocol

from fastapi import Depends, FastAPI, HTTPException, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from ...blocks.objectives.base import MAX_GENERATE_BYTES, MODES
from .jobs import JOB_ID_PATTERN, JobTable
from .operator import operator_refusal

# every body the schema allows fits: 65,536 characters of text, each written as a 12-byte
# surrogate-pair escape, is 786,432 bytes (a 413 for a schema-valid request would break its promise)
MAX_BODY_BYTES = 1024 * 1024
DEFAULT_MODE = "one_sweep"


def _json_number(v):
    """JSON Schema's integer and number: 7 and 7.0 are integers, but true and "7" are not numbers
    (pydantic's lax mode would take them; its strict mode would refuse 7.0)."""
    if isinstance(v, (bool, str, bytes)):
        raise ValueError("must be a JSON number")
    return v


JsonInt = Annotated[int, BeforeValidator(_json_number)]


def _optional(schema: dict) -> None:
    """A field that may be left out (the server picks) but is never null: no "default" in its schema."""
    schema.pop("default", None)
JsonFloat = Annotated[float, BeforeValidator(_json_number)]


class ErrorBody(BaseModel):
    detail: str = Field(..., description="What went wrong, in words.")


class ValidationIssue(BaseModel):
    type: str
    loc: list[str] = Field(..., description='Where: e.g. ["body", "max_bytes"].')
    msg: str


class ValidationErrorBody(BaseModel):
    detail: list[ValidationIssue]


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limits: ClassVar[dict[str, int]] = {m: MAX_GENERATE_BYTES for m in MODES}

    prompt: str = Field("", max_length=4096, description="Text to continue (UTF-8).")
    mode: Literal["one_sweep", "autoregressive"] = DEFAULT_MODE
    max_bytes: JsonInt = Field(
        None, ge=1, le=MAX_GENERATE_BYTES, json_schema_extra=_optional,
        description="Bytes to generate. Absent: min(64, the most this run can emit in the mode). The "
                    "per-mode limit of this run is in this schema and in GET /v1/status (run.generate); "
                    "over it: 422.")
    seed: JsonInt = Field(None, ge=0, le=2**31 - 1, json_schema_extra=_optional,
                          description="Sampling seed. Absent: a fresh one.")
    temperature: JsonFloat = Field(0.0, ge=0.0, le=2.0)

    @field_validator("max_bytes")
    @classmethod
    def _within_mode_limit(cls, v: int, info: ValidationInfo) -> int:
        mode = info.data.get("mode")
        if v is not None and mode in cls.limits and v > cls.limits[mode]:
            raise ValueError(f"max_bytes {v} is over what {mode} generation can emit for this run "
                             f"(at most {cls.limits[mode]} bytes)")
        return v


def generate_request_model(limits: dict[str, int]) -> type[GenerateRequest]:
    """GenerateRequest for one run: ``limits`` maps each mode to its most bytes. When a mode is
    limited below MAX_GENERATE_BYTES the JSON schema says so with one alternative per mode (a
    request that names no mode is one_sweep), so a client (or schemathesis) knows the limit."""
    extra = None
    if any(limits[m] < MAX_GENERATE_BYTES for m in MODES):
        extra = {"anyOf": [{
            "properties": {"mode": {"const": m}, "max_bytes": {"type": "integer", "minimum": 1, "maximum": limits[m]}},
            **({} if m == DEFAULT_MODE else {"required": ["mode"]})} for m in MODES]}
    return type("GenerateRequest", (GenerateRequest,), {
        "__module__": __name__, "limits": dict(limits),
        "model_config": ConfigDict(extra="forbid", json_schema_extra=extra)})


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
    model_config = ConfigDict(extra="forbid")
    text: str = Field(..., min_length=2, max_length=65536, description="Text to score (UTF-8).")
    k: JsonInt = Field(2, ge=1, le=8, description="Chain samples averaged.")


class ScoreResponse(BaseModel):
    ce: float
    ce_kind: str
    bytes_scored: int
    k: int
    route: list[HopInfo]


class JobStatus(BaseModel):
    job_id: str
    kind: str
    status: Literal["running", "done", "failed"]
    poll: str = Field(..., description="GET this path until status is done or failed.")
    created_at: float
    finished_at: float | None
    result: dict | None = Field(..., description="The action's answer once done.")
    error: str | None = Field(..., description="Why it failed, when it did.")


class ApiBackend(Protocol):
    """What the API asks of the node (``node.Node`` is one)."""
    def generate(self, prompt: bytes, max_bytes: int, mode: str, seed: int | None,
                 temperature: float) -> dict: ...
    def generate_limits(self) -> dict[str, dict[str, int]]: ...   # {mode: {"max": n, "default": n}}
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


class _Invalid(Exception):
    """A request the schema let through but the backend found invalid: a 422 in the documented shape."""


_WHY = {400: "Malformed request.", 401: "Operator action from a non-local client without a token.",
        403: "Operator action refused: not local, and no or a wrong operator token.",
        404: "No such job (unknown, or dropped from the bounded job table).",
        413: f"Request body over {MAX_BODY_BYTES} bytes.", 429: "Rate limit: too many POSTs from this client.",
        503: "Node busy (too many requests in flight) or the network could not serve the request."}


def _documented(*codes: int) -> dict:
    """The ``responses=`` of a route: each error status with its model (422: ValidationErrorBody)."""
    out: dict = {c: {"model": ErrorBody, "description": _WHY[c]} for c in codes if c != 422}
    if 422 in codes:
        out[422] = {"model": ValidationErrorBody, "description": "Invalid request: what is wrong, and where."}
    return out


BODY_ROUTE = (400, 413, 422, 429, 503)
OPERATOR_ROUTE = (401, 403, 413, 429)
OPERATOR_SECURITY = {"security": [{}, {"operator_token": []}]}   # none from 127.0.0.1 / ::1, else the token


def create_app(backend: ApiBackend, *, max_concurrent: int = 4, rate_per_s: float = 5.0, burst: int = 20,
               static_dir: str | None = None, operator_token: bytes | None = None, keep_jobs: int = 32) -> FastAPI:
    app = FastAPI(title="BlockTrain node", version="1", description=(
        "Ask this node for text generated by the whole chain of blocks, score text, or read the "
        "state of the run. Any node answers: it routes through live holders of every block. "
        "Operator actions (POST /v1/average, POST /v1/eval) are for the node's own machine "
        "(127.0.0.1 / ::1) or a client with the node's operator token (Authorization: Bearer); "
        "they answer 202 with a job to poll at GET /v1/jobs/{job_id}."))
    heavy = threading.BoundedSemaphore(max_concurrent)
    # one address runs at most half the heavy slots at once: a client that keeps its share busy (within
    # its rate limit) leaves the rest to everybody else (before, one client could hold all of them)
    per_client_heavy = max(1, max_concurrent // 2)
    in_flight: dict[str, int] = {}
    flight_lock = threading.Lock()
    limiter = _RateLimiter(rate_per_s, burst)
    counters = {"requests": 0, "rejected_rate": 0, "rejected_busy": 0, "errors": 0, "rejected_operator": 0,
                "connections_closed_slow": 0, "connections_refused": 0}   # the last two: guard.py's
    app.state.bt_counters = counters
    jobs = JobTable(keep=keep_jobs)
    limits = backend.generate_limits()
    Generate = generate_request_model({m: int(v["max"]) for m, v in limits.items()})

    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse({"detail": _validation_detail(exc)}, status_code=422)

    @app.exception_handler(_Invalid)
    async def invalid(request: Request, exc: _Invalid):
        return JSONResponse({"detail": [{"type": "value_error", "loc": ["body"], "msg": str(exc)}]}, status_code=422)

    @app.middleware("http")
    async def caps(request: Request, call_next):
        counters["requests"] += 1
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return JSONResponse({"detail": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        if request.url.path.startswith("/v1/") and request.method == "POST":
            client = request.client.host if request.client else "?"
            if not limiter.allow(client):
                counters["rejected_rate"] += 1
                return JSONResponse({"detail": "rate limit exceeded; slow down"}, status_code=429,
                                    headers={"Retry-After": "1"})
        return await call_next(request)

    def operator(request: Request) -> None:
        """Dependency of operator routes: local clients, or the operator token (operator.py)."""
        refusal = operator_refusal(request.client.host if request.client else None,
                                   request.headers.get("authorization"), operator_token)
        if refusal is not None:
            counters["rejected_operator"] += 1
            raise HTTPException(refusal.status, refusal.detail, headers=refusal.headers or None)

    def run_heavy(request: Request, fn):
        client = request.client.host if request.client else "?"
        with flight_lock:
            if in_flight.get(client, 0) >= per_client_heavy:
                counters["rejected_busy"] += 1
                raise HTTPException(503, f"node busy for this address: it already has {per_client_heavy} requests in "
                                         "flight here (its share); send the next when one has finished")
            if not heavy.acquire(blocking=False):
                counters["rejected_busy"] += 1
                raise HTTPException(503, "node busy: too many requests in flight, retry shortly")
            in_flight[client] = in_flight.get(client, 0) + 1
        try:
            return fn()
        except RequestRefused as e:
            raise HTTPException(e.status if e.status in (400, 503) else 503, e.detail) from None
        except (ValueError, LookupError) as e:
            raise _Invalid(str(e)) from None
        except (TimeoutError, ConnectionError, RuntimeError) as e:
            counters["errors"] += 1
            raise HTTPException(503, f"the network could not serve this request: {e}") from None
        finally:
            with flight_lock:
                left = in_flight.pop(client) - 1
                if left:
                    in_flight[client] = left
                heavy.release()

    @app.post("/v1/generate", response_model=GenerateResponse, summary="Generate text through the chain",
              responses=_documented(*BODY_ROUTE))
    def generate(req: Generate, request: Request):
        n = req.max_bytes if req.max_bytes is not None else int(limits[req.mode]["default"])
        return run_heavy(request, lambda: backend.generate(req.prompt.encode("utf-8"), n, req.mode, req.seed,
                                                  req.temperature))

    @app.post("/v1/score", response_model=ScoreResponse, summary="Held-out nats/byte of a text",
              responses=_documented(*BODY_ROUTE))
    def score(req: ScoreRequest, request: Request):
        return run_heavy(request, lambda: backend.score(req.text.encode("utf-8"), req.k))

    def start_job(kind: str, fn) -> JSONResponse:
        job, _started = jobs.start(kind, fn)
        body = job.to_dict()
        return JSONResponse(body, status_code=202, headers={"Location": body["poll"]})

    job_doc = ("Answers at once (202) with a job; poll GET /v1/jobs/{job_id}. While a job of this kind "
               "runs, asking again answers with that job.")

    @app.post("/v1/eval", summary="Start a held-out chain CE measurement through the network (operator)",
              description=job_doc, status_code=202, response_model=JobStatus, dependencies=[Depends(operator)],
              responses=_documented(*OPERATOR_ROUTE), openapi_extra=OPERATOR_SECURITY)
    def evaluate():
        return start_job("eval", backend.evaluate)

    @app.post("/v1/average", summary="Start one averaging round with same-block peers (operator)",
              description=job_doc + " The result is the round's verdict: accepted, reason, relative_change.",
              status_code=202, response_model=JobStatus, dependencies=[Depends(operator)],
              responses=_documented(*OPERATOR_ROUTE), openapi_extra=OPERATOR_SECURITY)
    def average():
        return start_job("average", backend.average_now)

    @app.get("/v1/jobs/{job_id}", response_model=JobStatus, summary="An operator job: running, done or failed",
             responses=_documented(404, 422))
    def job(job_id: str = Path(..., pattern=JOB_ID_PATTERN, description="From the 202 of the action.")):
        found = jobs.get(job_id)
        if found is None:
            raise HTTPException(404, f"no job {job_id} (unknown, or older than the last {keep_jobs})")
        return found.to_dict()

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

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["operator_token"] = {
                "type": "http", "scheme": "bearer",
                "description": "The node's --operator-token-file; not needed from 127.0.0.1 / ::1."}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    if static_dir is not None:
        from fastapi.staticfiles import StaticFiles
        from fastapi.responses import FileResponse
        import os

        app.mount("/static", StaticFiles(directory=static_dir), name="static")

        @app.get("/", include_in_schema=False)
        def index():
            return FileResponse(os.path.join(static_dir, "index.html"))

    return app
