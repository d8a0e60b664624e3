"""Asking a node's HTTP API from outside (``bt-node generate --http``, ``bt-node status --http``).

The node asked may be anyone's, so its answer is untrusted input: it is read with a deadline for
the whole answer (not only between bytes: a node trickling a byte a second is cut off) and a size
limit, must be JSON of the documented shape (pydantic models below, the same field names and types
as the API's), and anything else is one clear :class:`NodeAnswerError`, never a traceback.
Printing the strings it carries safely is the caller's part (``cli/render.py``).
"""
from __future__ import annotations

import json
import time

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

MAX_ANSWER_BYTES = 8 * 1024 * 1024   # /v1/status of a big run is well under 1 MB


class NodeAnswerError(RuntimeError):
    """The node could not be reached, refused, or answered something that is not the API's answer."""


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class HopInfo(_Answer):
    block: int
    peer: str


class GenerateAnswer(_Answer):
    text: str
    bytes_generated: int
    mode: str
    route: list[HopInfo]
    traversals: int


class HolderInfo(_Answer):
    peer_id: str
    state: str
    step: int
    throughput: float


class BlockHolders(_Answer):
    block: int
    holders: list[HolderInfo]


class RunInfo(_Answer):
    run_id: str
    objective: str
    config_hash: str
    n_blocks: int


class StatusAnswer(_Answer):
    run: RunInfo
    blocks: list[BlockHolders]


def call(url: str, path: str, body: dict | None = None, *, timeout: float = 120.0,
         max_answer_bytes: int = MAX_ANSWER_BYTES) -> dict:
    """POST ``body`` (or GET) ``url + path``; the answer's JSON object, read within ``timeout`` seconds
    in all and at most ``max_answer_bytes`` bytes. Errors (unreachable, an error status, too slow, too big, not
    a JSON object) raise :class:`NodeAnswerError` naming the node and what was wrong."""
    target = url.rstrip("/") + path
    deadline = time.monotonic() + timeout
    chunks, size = [], 0
    try:
        with httpx.Client(timeout=min(timeout, 30.0)) as client:
            with client.stream("POST" if body is not None else "GET", target, json=body) as r:
                for chunk in r.iter_bytes():
                    size += len(chunk)
                    if size > max_answer_bytes:
                        raise NodeAnswerError(f"{url} answered more than {max_answer_bytes} bytes; not reading it")
                    if time.monotonic() > deadline:
                        raise NodeAnswerError(f"{url} did not finish its answer within {timeout:.0f} s")
                    chunks.append(chunk)
                status = r.status_code
    except httpx.HTTPError as e:
        raise NodeAnswerError(f"cannot reach {url}: {e or type(e).__name__}") from None
    raw = b"".join(chunks)
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):
        answer = None
    if status >= 400:
        detail = answer.get("detail") if isinstance(answer, dict) else raw[:200].decode("utf-8", "replace")
        raise NodeAnswerError(f"{url} answered {status}: {detail}")
    if not isinstance(answer, dict):
        raise NodeAnswerError(f"{url} answered {status} with something that is not a JSON object "
                              f"({len(raw)} bytes): not a BlockTrain node's API?")
    return answer


def _checked(model: type[BaseModel], answer: dict, url: str, path: str) -> dict:
    try:
        model.model_validate(answer)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top)"
        raise NodeAnswerError(f"{url} answered {path} in an unexpected shape ({where}: {first['msg']}; "
                              f"{e.error_count()} problem(s)): not a BlockTrain node's API, or another version") from None
    return answer


def generate(url: str, body: dict, timeout: float = 120.0) -> dict:
    return _checked(GenerateAnswer, call(url, "/v1/generate", body, timeout=timeout), url, "/v1/generate")


def status(url: str, timeout: float = 60.0) -> dict:
    return _checked(StatusAnswer, call(url, "/v1/status", timeout=timeout), url, "/v1/status")
