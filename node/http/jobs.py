"""Long operator actions run as jobs: the request that starts one is answered at once (202) and
the client polls ``GET /v1/jobs/{job_id}``. At most one job of a kind runs at a time (asking again
while it runs returns that job), and the table keeps only the last ``keep`` finished jobs (plus
at most one running job per kind), so memory stays bounded however often a job is started.

``run_job`` is the client side (tests, benchmarks): start a job over HTTP and wait for its end.
"""
from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

JOB_ID_PATTERN = r"^[0-9a-f]{16}$"


@dataclass
class Job:
    job_id: str
    kind: str
    status: str = "running"            # running | done | failed
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    result: dict | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return {"job_id": self.job_id, "kind": self.kind, "status": self.status, "poll": f"/v1/jobs/{self.job_id}",
                "created_at": self.created_at, "finished_at": self.finished_at, "result": self.result,
                "error": self.error}


class JobTable:
    def __init__(self, keep: int = 32):
        self.keep = keep
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.lock = threading.Lock()

    def start(self, kind: str, fn: Callable[[], dict]) -> tuple[Job, bool]:
        """Start ``fn`` in a thread as a job of ``kind``; (the job, True), or (the job of this kind
        already running, False)."""
        with self.lock:
            for job in self.jobs.values():
                if job.kind == kind and job.status == "running":
                    return job, False
            job = Job(secrets.token_hex(8), kind)
            self.jobs[job.job_id] = job
        threading.Thread(target=self._run, args=(job, fn), name=f"bt-job-{kind}", daemon=True).start()
        return job, True

    def _run(self, job: Job, fn: Callable[[], dict]) -> None:
        try:
            result, status, error = fn(), "done", None
        except Exception as e:   # the job failed, the node serves on: the poller reads why
            result, status, error = None, "failed", f"{type(e).__name__}: {e}"
        with self.lock:
            job.result, job.error, job.finished_at, job.status = result, error, time.time(), status
            finished = [j for j in self.jobs.values() if j.status != "running"]   # oldest first
            for old in finished[:max(0, len(finished) - self.keep)]:
                del self.jobs[old.job_id]

    def get(self, job_id: str) -> Job | None:
        with self.lock:
            return self.jobs.get(job_id)


def run_job(base_url: str, path: str, *, timeout: float = 300.0, headers: dict | None = None,
            poll_s: float = 0.5, client=None) -> dict:
    """POST ``path`` (an operator action), then poll its job until it ends; returns the job (its
    ``status`` is done or failed, ``result`` the action's answer). Raises on refusal or timeout.
    ``client``: an ``httpx.Client`` to send with (default: a fresh one)."""
    import httpx
    base = base_url.rstrip("/")
    deadline = time.monotonic() + timeout
    with (httpx.Client(timeout=timeout) if client is None else contextlib.nullcontext(client)) as c:
        r = c.post(base + path, headers=headers, timeout=timeout)
        if r.status_code != 202:
            raise RuntimeError(f"{base}{path} answered {r.status_code}: {r.text[:300]}")
        job = r.json()
        while job["status"] == "running":
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job['job_id']} ({path}) still running after {timeout:.0f}s")
            time.sleep(poll_s)
            r = c.get(base + job["poll"], timeout=30)
            r.raise_for_status()
            job = r.json()
    return job
