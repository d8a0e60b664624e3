"""A template process that forks the suite's node processes, so each does not import torch again.

Starting a node costs ~4 CPU-seconds, most of it importing torch and our CLI (BENCHMARKS "Suite time"),
and the suite starts over a hundred. A test worker starts a template (:func:`popen`, installed as
``ManagedProcess.popen`` by ``conftest.py``): it imports what every node process imports before it
parses its command line (our CLI, torch the way a node imports it, and the node), then waits on a unix socket.
Each ``python -m blocktrain.cli.main ...`` a :class:`~blocktrain.node.swarm.launcher.ManagedProcess`
would start is instead forked from it; the child does what ``python -m`` would from there: its own
session (process group), stdin from /dev/null, stdout and stderr on the log the launcher opened (its
descriptor passed over the socket), the launcher's environment and working directory, then
``runpy`` runs the CLI as ``__main__`` and the process exits as the interpreter would.

What stays as with ``subprocess.Popen``: the pid is the node's (signals, ``killpg`` of its group,
``/proc``), so is ``/proc/PID/cmdline`` (written over the template's own argument area, which a padding
argument of spaces makes room for: it shows as a last argument of spaces), the exit code is the node's
(the template reaps its children and reports it), and the node dies with the test worker (the template
has the worker's ``PR_SET_PDEATHSIG``, each child the template's).
A template is started with the first such node's environment; a node whose environment differs in what is
read while torch and the node are imported (thread counts, allocator and loader settings,
``BT_EAGER_IMPORTS``, hivemind's settings) gets a template of its own, up to ``MAX_TEMPLATES`` per worker.
What a template cannot give, and where the launcher falls back to ``subprocess.Popen``: another program
(``entry`` wrappers: ``ip netns exec``, ``faketime``), a command that is not a node's (it would carry
torch it never imports), piped stdio, an environment no template could start with single-threaded, and a
start from any thread but the main one (the template must die with the worker, and a parent-death signal
armed from another thread fires when that thread ends); ``fallbacks`` keeps the last reasons.
``BT_TEST_ZYGOTE=0`` turns it off.

The CPU the children use is the template's ``RUSAGE_CHILDREN``, not the worker's: :func:`children_cpu`
asks the template for it (``conftest.py`` adds it to ``BT_CPU_LOG``).
"""
from __future__ import annotations

import array
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

CLI = ["-m", "blocktrain.cli.main"]
# environment read while torch (or our lean import of it) loads: a child must see what the template saw
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_", "TORCH", "PYTORCH", "LD_", "MALLOC_", "GLIBC_",
                   "PYTHON", "BT_EAGER_IMPORTS", "BT_HIVEMIND_IN", "HIVEMIND", "CUDA", "NVIDIA")
PRELOAD = ("blocktrain.cli.node_cmds", "blocktrain.node.node")   # what a node command imports before it runs


def _import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


# -- the template (server) -------------------------------------------------------------------------
def _recv(conn: socket.socket) -> tuple[dict, list[int]]:
    buf, fds = b"", []
    while not buf.endswith(b"\n"):
        msg, anc, _flags, _addr = conn.recvmsg(1 << 16, socket.CMSG_SPACE(4 * array.array("i").itemsize))
        if not msg:
            raise ConnectionError("closed")
        buf += msg
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(data[:len(data) - len(data) % a.itemsize])
                fds += list(a)
    return json.loads(buf), fds


CMDLINE_ROOM = 16384   # bytes of command line a child can show: the template starts with a padding argument this long


def _show_cmdline(argv: list[str]) -> None:
    """Write ``argv`` over this process's own argument area (``/proc/PID/cmdline`` reads it; tests find a
    node's processes by its command line); a last argument of spaces fills the rest. Left as it was if
    ``argv`` does not fit (the launcher side starts such a command with ``subprocess.Popen``)."""
    import ctypes
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])   # arg_start and arg_end: fields 48 and 49 of proc(5)
    data = b"\0".join(a.encode() for a in argv) + b"\0"
    if len(data) + 1 > end - start:
        return
    data += b" " * (end - start - len(data) - 1) + b"\0"
    ctypes.memmove(start, data, len(data))


def _become_node(req: dict, fds: list[int], die_with_template, started: int, import_env: dict) -> None:
    """In the forked child: become ``python -m blocktrain.cli.main ARGS`` (does not return). Once it has its
    own session and command line it closes ``started``, and only then does the template answer with its pid.
    ``die_with_template``: the launcher's parent-death hook, armed in the template before the fork.
    ``import_env``: what the template's imports put in its environment (as they would have in the child's)."""
    import runpy

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    die_with_template()   # SIGTERM when the template dies; exits at once if it already has
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[0], 2)
    for fd in (devnull, *fds):
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for k, v in import_env.items():   # set with setdefault by our imports (p2p/inprocess.py)
        os.environ.setdefault(k, v)
    _show_cmdline([sys.executable, *CLI, *req["args"]])
    os.close(started)
    sys.argv = ["-m", *req["args"]]   # as ``python -m``: run_module puts the module's file first
    sys.modules.pop("blocktrain.cli.main", None)   # as in a fresh process, it runs as __main__ only
    try:
        import numpy
        numpy.random.seed()   # a fresh process draws its own state (``random`` reseeds itself at fork)
    except ImportError:
        pass
    runpy.run_module("blocktrain.cli.main", run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve(path: str) -> None:
    import importlib

    from blocktrain.p2p.process import parent_death_preexec
    start_env = dict(os.environ)
    from blocktrain.cli.main import NODE_COMMANDS  # noqa: F401  (the CLI, as ``python -m`` imports it)
    from blocktrain.node.memory import import_torch_lean
    import_torch_lean()   # what the CLI's group does before a node command: torch, the lean way
    for name in PRELOAD:
        importlib.import_module(name)
    import_env = {k: v for k, v in os.environ.items() if start_env.get(k) != v}
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("the template must stay single-threaded to fork")
    die_with_template = parent_death_preexec(signal.SIGTERM) or (lambda: None)   # resolved here, not in a child
    exited: dict[int, int] = {}

    def reap(*_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            exited[pid] = os.waitstatus_to_exitcode(status)

    signal.signal(signal.SIGCHLD, reap)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    print("ready " + json.dumps({"env": _import_time_env(dict(os.environ)), "import_env": import_env}), flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                req, fds = _recv(conn)
            except (ConnectionError, ValueError, OSError):
                continue
            if req["op"] == "spawn":
                wait_r, started = os.pipe()
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})   # not reaped before the next line
                pid = os.fork()
                exited.pop(pid, None)   # a pid the kernel gives again: not the earlier child's exit
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                if pid == 0:
                    srv.close()
                    conn.close()
                    os.close(wait_r)
                    _become_node(req, fds, die_with_template, started, import_env)
                for fd in (started, *fds):
                    os.close(fd)
                os.read(wait_r, 1)   # EOF once the child closed it (or died)
                os.close(wait_r)
                answer = {"pid": pid}
            elif req["op"] == "status":
                reap()
                answer = {"returncode": exited.get(req["pid"])}
            else:   # "cpu"
                reap()
                ru = resource.getrusage(resource.RUSAGE_CHILDREN)
                answer = {"children_cpu": ru.ru_utime + ru.ru_stime}
            try:
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:
                pass


# -- the test worker's side ------------------------------------------------------------------------
class _Template:
    def __init__(self, env: dict):
        """A template for nodes started with ``env`` (what is read as torch and the node are imported)."""
        from blocktrain.p2p.process import parent_death_preexec
        self.dir = tempfile.mkdtemp(prefix="bt-zygote-")
        self.path = os.path.join(self.dir, "sock")
        env = dict(env)
        with open(os.path.join(self.dir, "stderr"), "wb") as err:   # not a terminal, as a node log
            self.proc = subprocess.Popen([sys.executable, __file__, self.path, " " * CMDLINE_ROOM],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env,
                                         start_new_session=True, preexec_fn=parent_death_preexec(signal.SIGTERM))
        line = self.proc.stdout.readline()
        if not line.startswith(b"ready "):
            self.proc.kill()
            self.proc.wait()
            with open(os.path.join(self.dir, "stderr"), errors="replace") as f:
                raise RuntimeError(f"the node template did not start: {line!r}\n{f.read()[-3000:]}")
        ready = json.loads(line[len(b"ready "):])
        self.env = ready["env"]                # the import-time environment its imports saw and left
        self.import_env = ready["import_env"]  # what they set (a child gets it where its own does not say)

    def children_cpu(self) -> float:
        if self.proc.poll() is not None:
            return 0.0
        try:
            return self.ask({"op": "cpu"})["children_cpu"]
        except OSError:
            return 0.0

    def matches(self, env: dict) -> bool:
        """Whether a process started with ``env`` would have imported what this template did."""
        return _import_time_env({**self.import_env, **env}) == self.env

    def ask(self, req: dict, fds: list[int] = ()) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.path)
            data = json.dumps(req).encode() + b"\n"
            if fds:
                s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                s.sendall(data)
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(1 << 16)
                if not chunk:
                    raise ConnectionError("the node template closed the connection")
                buf += chunk
        return json.loads(buf)

    def close(self) -> None:
        if self.proc.poll() is None:   # its children get their parent-death signal
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class TemplateChild:
    """The part of ``subprocess.Popen`` a launcher uses, for a child of the template."""

    def __init__(self, template: _Template, args: list[str], pid: int):
        self._t, self.args, self.pid, self.returncode = template, args, pid, None
        self.stdin = self.stdout = self.stderr = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._t.ask({"op": "status", "pid": self.pid})["returncode"]
            except OSError:   # the template is gone, and its children with it
                self.returncode = -signal.SIGTERM
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


MAX_TEMPLATES = 3   # one per import-time environment the worker's nodes ask for (tests that set one start more)
_templates: list[_Template] = []
_refused: list[dict] = []   # import-time environments a template could not start with (e.g. OpenBLAS threads)
fallbacks: list[str] = []   # why the last node commands started with subprocess.Popen (the tests show it on failure)
counts = {"forked": 0, "fallbacks": 0, "templates": 0}   # node commands forked or not, templates started


def _fallback(cmd, why: str) -> None:
    counts["fallbacks"] += 1
    fallbacks.append(f"{' '.join(map(str, cmd[3:5]))}: {why}")
    del fallbacks[:-20]


def _template_for(cmd, kw) -> _Template | None:
    from blocktrain.cli.main import NODE_COMMANDS   # the commands that import what the template has
    if list(cmd[:3]) != [sys.executable, *CLI] or len(cmd) < 4 or cmd[3] not in NODE_COMMANDS:
        return None   # another program, or a command that imports less than a node (not worth noting)
    if os.environ.get("BT_TEST_ZYGOTE") == "0":
        return _fallback(cmd, "BT_TEST_ZYGOTE=0")
    if threading.current_thread() is not threading.main_thread():
        return _fallback(cmd, f"started from thread {threading.current_thread().name}")
    if kw.get("stdin") is not subprocess.DEVNULL or kw.get("stderr") is not subprocess.STDOUT \
            or not kw.get("start_new_session") or kw.get("cwd") or not hasattr(kw.get("stdout"), "fileno"):
        return _fallback(cmd, "piped stdio, a cwd or no session of its own")
    if sum(len(a.encode()) + 1 for a in cmd) + 1 >= CMDLINE_ROOM:
        return _fallback(cmd, "a command line longer than the template can show")
    env = kw.get("env") or os.environ
    for t in [t for t in _templates if t.proc.poll() is not None]:
        _templates.remove(t)
        t.close()
    for t in _templates:
        if t.matches(env):
            return t
    if len(_templates) >= MAX_TEMPLATES:
        return _fallback(cmd, f"import-time environment {_import_time_env(env)} unlike the {MAX_TEMPLATES} "
                              f"templates' ({[t.env for t in _templates]})")
    if _import_time_env(env) in _refused:
        return _fallback(cmd, "no template starts with this import-time environment")
    try:
        t = _Template(env)
    except RuntimeError as e:   # it would not be single-threaded, so could not fork (OpenBLAS threads, ...)
        _refused.append(_import_time_env(env))
        return _fallback(cmd, str(e)[:300])
    _templates.append(t)
    counts["templates"] += 1
    if not t.matches(env):
        return _fallback(cmd, f"a template started with its environment saw another: {t.env}")
    return t


def popen(cmd, **kw):
    """``subprocess.Popen(cmd, **kw)``, forked from a template where it can be (see the module docstring)."""
    t = _template_for(cmd, kw)
    if t is None:
        return subprocess.Popen(cmd, **kw)
    env = dict(kw.get("env") or os.environ)
    pid = t.ask({"op": "spawn", "args": list(cmd[3:]), "env": env, "cwd": os.getcwd()}, [kw["stdout"].fileno()])["pid"]
    counts["forked"] += 1
    return TemplateChild(t, list(cmd), pid)


def children_cpu() -> float:
    """CPU seconds of the templates' children that they have reaped (0 without a template)."""
    return sum(t.children_cpu() for t in _templates)   # a closed one's move to this process's RUSAGE_CHILDREN


def close() -> None:
    """Stop every template (the children still running get their parent-death signal)."""
    while _templates:
        _templates.pop().close()


if __name__ == "__main__":
    serve(sys.argv[1])
