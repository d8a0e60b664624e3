"""Start and stop real node processes on 127.0.0.1 (used by ``bt-node swarm``, benchmarks, tests).

Each node is a separate ``bt-node seed|join`` process in its own session (process group), so a
stop kills its hivemind children too and nothing is left behind, even after SIGKILL.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NodeProc:
    name: str
    args: list[str]
    workdir: Path
    http_port: int
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    threads: int = 1
    entry: list[str] | None = None     # the program to run instead of ``python -m blocktrain.cli.main``

    @property
    def ready_file(self) -> Path:
        return self.workdir / "ready.json"

    @property
    def log_file(self) -> Path:
        return self.workdir / "node.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, env: dict | None = None) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            [*(self.entry or [sys.executable, "-m", "blocktrain.cli.main"]), *self.args, "--ready-file", str(self.ready_file),
             "--quiet", "--http-port", str(self.http_port), "--checkpoint-dir", str(self.workdir / "ckpt")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**self.thread_env(), **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        log.close()

    def thread_env(self) -> dict:
        """Several nodes share this machine: one torch/OpenMP thread each (``threads``), since
        more threads than cores only make them spin against each other. An OMP_NUM_THREADS /
        MKL_NUM_THREADS already in the environment wins."""
        n = str(self.threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}

    def wait_ready(self, timeout: float = 120.0) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self.info
            if not self.alive:
                raise RuntimeError(f"node {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"node {self.name} not ready after {timeout:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def get(self, path: str, timeout: float = 30.0) -> dict:
        r = httpx.get(self.url + path, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict, timeout: float = 300.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                if sig == signal.SIGKILL:
                    os.killpg(self.proc.pid, sig)   # the node and all its hivemind children
                else:
                    os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 40.0) -> int | None:
        """SIGTERM (graceful leave), then SIGKILL the whole process group if it lingers."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # children (DHT, averager, p2pd) too
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.returncode


class LocalSwarm:
    def __init__(self, base_dir: str | Path, *, run_id: str = "swarm", overrides: list[str] = (),
                 data: str = "auto", extra_args: list[str] = ()):
        self.base = Path(base_dir)
        self.run_id = run_id
        self.overrides = list(overrides)
        self.data = data
        self.extra = list(extra_args)
        self.nodes: list[NodeProc] = []

    @property
    def seed_maddr(self) -> str:
        return self.nodes[0].info["maddrs"][0]

    def start_seed(self, block: int = 0, args: list[str] = (), http_port: int | None = None) -> NodeProc:
        sets = [x for kv in self.overrides for x in ("--set", kv)]
        n = NodeProc("node0", ["seed", "--run-id", self.run_id, "--data", self.data, "--block", str(block),
                               *sets, *self.extra, *args], self.base / "node0", http_port or free_port())
        self.nodes.append(n)
        n.start()
        n.wait_ready()
        return n

    def start_join(self, block: int | None = None, args: list[str] = (), wait: bool = True,
                   name: str | None = None, workdir: Path | None = None) -> NodeProc:
        name = name or f"node{len(self.nodes)}"
        a = ["join", "--initial-peers", self.seed_maddr, "--run-id", self.run_id, "--data", self.data,
             *self.extra, *args]
        if block is not None:
            a += ["--block", str(block)]
        n = NodeProc(name, a, workdir or self.base / name, free_port())
        self.nodes.append(n)
        n.start()
        if wait:
            n.wait_ready()
        return n

    def live(self) -> list[NodeProc]:
        return [n for n in self.nodes if n.alive]

    def stop_all(self) -> None:
        for n in self.nodes:
            n.signal(signal.SIGTERM)
        for n in self.nodes:
            n.stop()
