"""Start and stop real node processes on 127.0.0.1 (used by ``bt-node swarm``, benchmarks, tests).

:class:`ManagedProcess` is the one process handle: a child in its own session (process group)
with its output in a log file, stopped with SIGTERM and then SIGKILL of its whole group, so a stop
takes its hivemind children (DHT, averager, p2pd) too and nothing is left behind, even after
SIGKILL. A child started from the main thread also gets SIGTERM when this process dies, however
it dies (``PR_SET_PDEATHSIG``; the signal fires when the *thread* that started the child ends,
so children started from other threads go without it). :class:`NodeProc` runs one
``bt-node seed|join`` with it; the tests' drivers of their own test processes build on it too.

No ports are chosen here: a node binds port 0 (HTTP and p2p) itself and reports the ports it got
in its ready file, so no other program can take a port between choosing and binding it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from blocktrain.blocks.config import ModelConfig
from blocktrain.p2p.process import parent_death_preexec

STOP_TIMEOUT = 130.0  # seconds a node gets to leave after SIGTERM before SIGKILL: it needs under 10, or, for a
#                      block whose step or save is slow, up to 2 minutes for its final checkpoint (node.py)
_started: "set[ManagedProcess]" = set()   # every child started here (pruned once it has exited)


def _running() -> "list[ManagedProcess]":
    for p in [p for p in _started if not p.alive]:
        _started.discard(p)
    return list(_started)


def kill_all() -> None:
    """SIGKILL the process group of every child this process started here and that still runs
    (a second Ctrl-C: no more waiting)."""
    for p in _running():
        p.signal(signal.SIGKILL)


def stop_together(procs, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM every process at once (each leaves gracefully), then wait; SIGKILL the process group
    of any that is not gone within ``timeout`` s."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.stop(timeout=max(0.5, deadline - time.monotonic()))


def stop_running(timeout: float = STOP_TIMEOUT) -> None:
    """Stop (as :func:`stop_together`) every child this process started here that still runs."""
    stop_together(_running(), timeout)


class ManagedProcess:
    """A child process in its own session (process group), its output appended to ``log_file``.

    ``start`` may be called again once the previous process has stopped (a restart). With
    ``pipe_stdio`` the child's stdin and stdout are text pipes (``proc.stdin`` / ``proc.stdout``,
    line-buffered) and only stderr goes to the log; otherwise stdout and stderr go to the log.
    """

    popen = staticmethod(subprocess.Popen)   # how a child is started (the test suite forks its nodes from a
    #                                          template process that has imported torch once: tests/test_utils/zygote.py)

    def __init__(self, name: str, log_file: Path):
        self.name = name
        self.log_file = Path(log_file)
        self.proc: subprocess.Popen | None = None   # or what ``popen`` returns in its place
        self._terminated = False

    def start_process(self, cmd: list[str], *, env: dict | None = None, pipe_stdio: bool = False,
                      append: bool = True) -> subprocess.Popen:
        """Start ``cmd`` (``env`` None = this process's environment)."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        # dies with this process; only when started from the main thread (see the module docstring)
        preexec = parent_death_preexec(signal.SIGTERM) if threading.current_thread() is threading.main_thread() \
            else None
        with open(self.log_file, "ab" if append else "wb") as log:   # the child keeps its own descriptor
            if pipe_stdio:
                self.proc = self.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                       text=True, bufsize=1, start_new_session=True, env=env,
                                       preexec_fn=preexec)
            else:
                self.proc = self.popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, env=env, preexec_fn=preexec)
        self._terminated = False
        _started.add(self)
        return self.proc

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the log."""
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process; SIGKILL goes to its whole process group (its children too)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                if sig == signal.SIGKILL:
                    os.killpg(self.proc.pid, sig)
                else:
                    os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM, once per start: a node leaves gracefully on the first and exits at once on a
        second, so a stop that is asked for twice must not send two."""
        if not self._terminated:
            self._terminated = True
            self.signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the process to exit; its exit code, or None if it still runs."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM (a graceful exit, :meth:`terminate`) and up to ``timeout`` s to take it, then
        SIGKILL the whole process group whatever the process did (children that outlive it go too).
        Returns the exit code."""
        if self.proc is None:
            return None
        self.terminate()
        self.wait(timeout)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.wait(10)
        return self.proc.returncode


class NodeProc(ManagedProcess):
    """One ``bt-node`` process (``args`` = ``seed ...`` or ``join ...``) in ``workdir``, serving HTTP
    on ``http_port`` (0: a port the node picks and binds itself, known once it is ready); ready once
    it has written ``workdir/ready.json``."""

    def __init__(self, name: str, args: list[str], workdir: Path, http_port: int = 0, *, threads: int = 1,
                 entry: list[str] | None = None):
        super().__init__(name, Path(workdir) / "node.log")
        self.entry = entry   # the program to run instead of ``python -m blocktrain.cli.main`` (tests wrap it)
        self.args = list(args)
        self.workdir = Path(workdir)
        self.http_port = http_port
        self.threads = threads
        self.info: dict = {}

    @property
    def ready_file(self) -> Path:
        return self.workdir / "ready.json"

    @property
    def bound_http_port(self) -> int:
        """The HTTP port the node serves on (as its ready file reports it)."""
        port = self.info.get("http_port") or self.http_port
        if not port:
            raise RuntimeError(f"node {self.name} has not reported its HTTP port yet (wait_ready first)")
        return int(port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.bound_http_port}"

    def start(self, env: dict | None = None) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        self.info = {}
        self.start_process(
            [*(self.entry or [sys.executable, "-m", "blocktrain.cli.main"]), *self.args,
             "--ready-file", str(self.ready_file),
             "--quiet", "--http-port", str(self.http_port), "--checkpoint-dir", str(self.workdir / "ckpt")],
            env={**self.thread_env(), **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def thread_env(self) -> dict:
        """Several nodes share this machine: one torch/OpenMP thread each (``threads``), and as many
        for NumPy's OpenBLAS (which otherwise starts a thread per core as it loads), since more
        threads than cores only make them spin against each other. A count already in the
        environment wins."""
        n = str(self.threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}

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

    def get(self, path: str, timeout: float = 30.0) -> dict:
        r = httpx.get(self.url + path, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict, timeout: float = 300.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)


class LocalSwarm:
    """A local network of node processes: a seed, then joiners. Its run trains the objective its
    ``overrides`` name (``objective=...``), else the config's default (``ModelConfig.objective``):
    the launcher names it to the seed, whose command would otherwise start a ``NEW_RUN_OBJECTIVE`` run
    (``bt-node swarm`` passes that one itself)."""

    def __init__(self, base_dir: str | Path, *, run_id: str = "swarm", overrides: list[str] = (),
                 data: str = "auto", extra_args: list[str] = ()):
        self.base = Path(base_dir)
        self.run_id = run_id
        self.overrides = list(overrides)
        if not any(kv.split("=", 1)[0].strip() == "objective" for kv in self.overrides):
            self.overrides.insert(0, f"objective={ModelConfig().objective}")
        self.data = data
        self.extra = list(extra_args)
        self.nodes: list[NodeProc] = []

    @property
    def seed_maddr(self) -> str:
        return self.nodes[0].info["maddrs"][0]

    def start_seed(self, block: int = 0, args: list[str] = (), http_port: int | None = None) -> NodeProc:
        sets = [x for kv in self.overrides for x in ("--set", kv)]
        n = NodeProc("node0", ["seed", "--run-id", self.run_id, "--data", self.data, "--block", str(block),
                               *sets, *self.extra, *args], self.base / "node0", http_port or 0)
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
        n = NodeProc(name, a, workdir or self.base / name)
        self.nodes.append(n)
        n.start()
        if wait:
            n.wait_ready()
        return n

    def start_chain(self, blocks: list[int], *, seed_args: list[str] = (), http_port: int | None = None,
                    timeout: float = 120.0) -> None:
        """A network in one go: the seed on ``blocks[0]`` (ready first: the joiners dial it), then one joiner
        per further entry, started together, each waited for up to ``timeout`` seconds."""
        self.start_seed(block=blocks[0], args=seed_args, http_port=http_port)
        joiners = [self.start_join(block=b, wait=False) for b in blocks[1:]]
        for nd in joiners:
            nd.wait_ready(timeout=timeout)

    def live(self) -> list[NodeProc]:
        return [n for n in self.nodes if n.alive]

    def stop_all(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop every node at once (:func:`stop_together`)."""
        stop_together(self.nodes, timeout)
