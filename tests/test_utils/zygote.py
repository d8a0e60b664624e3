"""A template process that forks the suite's node processes, so each does not import torch again.

Starting a node costs ~4 CPU-seconds, most of it importing torch and our CLI (BENCHMARKS "Suite time"),
and the suite starts over a hundred. A test worker starts a template (:func:`popen`, installed as
``ManagedProcess.popen`` by ``conftest.py``): it imports what every node process imports before it
parses its command line (our CLI, torch the way a node imports it, and the node) and what the node imports as it
starts (its HTTP API and rebalancing loop), then waits on a unix socket.
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
A node run through one of this folder's wrappers (``WRAPPERS``: ``python faulty_node.py FAULT seed ...``)
forks too, the wrapper run as ``python SCRIPT`` would run it. The tests' CLI runs (:func:`run_cli`) fork
as well, with their output on pipes; the nodes such a run starts fork from a copy of it made before it
runs (``swarm`` and the benches start several).
So do the JSON-lines test programs of this folder (``PROGRAMS``), with the launcher's piped stdin and stdout,
and nodes started inside ``ip netns exec NS`` (the child enters the namespace).
What a template cannot give, and where the launcher falls back to ``subprocess.Popen``: another program
(``entry`` wrappers such as ``faketime``), a command that is not a node's (it would carry torch it never
imports), other stdio than the launcher's, an environment no template could start with single-threaded, and a
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
# what a node command imports before it runs, and what the node imports as it starts (its HTTP API: FastAPI,
# pydantic, uvicorn, ~0.25 CPU-s a node here; its rebalancing loop)
PRELOAD = ("blocktrain.cli.node_cmds", "blocktrain.node.node", "blocktrain.node.http.server",
           "blocktrain.node.rebalance")


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


CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the network namespace ``ip netns`` named ``name``."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):   # Python 3.12
            os.setns(fd, CLONE_NEWNET)
        else:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


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
    if req.get("netns"):   # what ``ip netns exec NS`` does for a process's network (it also remounts /sys)
        _enter_netns(req["netns"])
    # a node: [its log] for stdout and stderr; a CLI run (:func:`run_cli`): [stdout pipe, stderr pipe];
    # a process the launcher pipes: [stdin pipe, stdout pipe, its log]
    devnull = os.open(os.devnull, os.O_RDONLY)
    stdio = fds if len(fds) == 3 else [devnull, fds[0], fds[-1]]
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    for fd in (devnull, *fds):
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for k, v in import_env.items():   # set with setdefault by our imports (p2p/inprocess.py)
        os.environ.setdefault(k, v)
    from blocktrain.cli.main import NODE_COMMANDS
    if req.get("cli") and req["args"][:1] and req["args"][0] not in NODE_COMMANDS:
        _template_of_this_process(import_env, started)   # the nodes ``swarm`` and the benches start: from a copy
    script = req.get("script")   # of this folder (``WRAPPERS``, ``PROGRAMS``): run as ``python SCRIPT ARGS``
    _show_cmdline([sys.executable, *([script] if script else CLI), *req["args"]])
    os.close(started)
    sys.modules.pop("blocktrain.cli.main", None)   # as in a fresh process, it runs as __main__ only
    try:
        import numpy
        numpy.random.seed()   # a fresh process draws its own state (``random`` reseeds itself at fork)
    except ImportError:
        pass
    if script:
        sys.argv = [script, *req["args"]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = ["-m", *req["args"]]   # as ``python -m``: run_module puts the module's file first
        runpy.run_module("blocktrain.cli.main", run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve(path: str) -> None:
    import importlib

    start_env = dict(os.environ)
    from blocktrain.cli.main import NODE_COMMANDS  # noqa: F401  (the CLI, as ``python -m`` imports it)
    from blocktrain.node.memory import import_torch_lean
    import_torch_lean()   # what the CLI's group does before a node command: torch, the lean way
    for name in PRELOAD:
        importlib.import_module(name)
    import_env = {k: v for k, v in os.environ.items() if start_env.get(k) != v}
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("the template must stay single-threaded to fork")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    print("ready " + json.dumps({"env": _import_time_env(dict(os.environ)), "import_env": import_env}), flush=True)
    _serve_on(srv, import_env)


def _serve_on(srv: socket.socket, import_env: dict) -> None:
    """Answer the requests that come to the listening socket ``srv``: fork a child, its exit code, CPU."""
    from blocktrain.p2p.process import parent_death_preexec
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
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


class _ForkedProc:
    """The part of ``subprocess.Popen`` :meth:`_Template.close` uses, for a template this process forked."""

    def __init__(self, pid: int):
        self.pid, self.returncode, self.stdout = pid, None, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGTERM
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["template"], timeout)
            time.sleep(0.02)
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _template_of_this_process(import_env: dict, started: int) -> None:
    """In a CLI run forked from a template, before it runs: fork a template from this process while it is
    still the template's pristine copy, and start the nodes the command starts through the launcher
    (``bt-node swarm``, the benches) from it, as the test worker does. The copy dies with this process (so
    its children, the nodes, get their parent-death signal as they would from ``subprocess.Popen``); it is
    stopped and reaped at exit (its CPU and its children's then count as this process's). ``started``: the
    descriptor whose closing tells the test worker's template this process has started (the copy closes it)."""
    import atexit

    from blocktrain.node.swarm.launcher import ManagedProcess
    from blocktrain.p2p.process import parent_death_preexec
    t = _Template.__new__(_Template)
    # an abstract socket (no file: nothing is left in /tmp when a test kills the run)
    t.dir, t.path = None, f"\0bt-zygote-{os.getpid()}-{os.urandom(4).hex()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(t.path)
    srv.listen(64)
    die_with_cli = parent_death_preexec(signal.SIGTERM) or (lambda: None)
    pid = os.fork()
    if pid == 0:
        try:
            die_with_cli()
            os.close(started)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):   # not the CLI run's pipes: the test reads them to their end
                os.dup2(devnull, fd)
            os.close(devnull)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _serve_on(srv, import_env)
        finally:
            os._exit(1)
    srv.close()
    t.proc = _ForkedProc(pid)
    t.env, t.import_env = _import_time_env(dict(os.environ)), import_env
    _templates.append(t)
    counts["templates"] += 1
    ManagedProcess.popen = staticmethod(popen)
    atexit.register(_close_and_log)


def _close_and_log() -> None:
    """At a CLI run's exit: stop its template; with ``BT_CPU_LOG``, a line of how its nodes started."""
    close()
    if os.environ.get("BT_CPU_LOG") and (counts["forked"] or counts["fallbacks"]):
        with open(os.environ["BT_CPU_LOG"], "a") as f:
            f.write(json.dumps({"cli_template": counts, "fallbacks": fallbacks, "command": sys.argv[1:3]}) + "\n")


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
# node commands forked or not, templates started, CLI runs forked (:func:`run_cli`)
counts = {"forked": 0, "fallbacks": 0, "templates": 0, "cli_forked": 0}


def _fallback(cmd, why: str) -> None:
    counts["fallbacks"] += 1
    fallbacks.append(f"{' '.join(map(str, cmd[1:5]))}: {why}")
    del fallbacks[:-20]


HERE = os.path.dirname(os.path.realpath(__file__))
# the test wrappers of a node in this folder (they patch the node, then run its CLI), and where in their
# arguments the node command is
WRAPPERS = {os.path.join(HERE, name): at for name, at in (("pipeline_probe.py", 0), ("faulty_node.py", 1))}
# the test programs of this folder that are not nodes but import what the template has (hivemind, torch):
# the wire test node, the hostile averager, the DHT probe
PROGRAMS = {os.path.join(HERE, name) for name in ("wire_node.py", "hostile_averager.py", "dht_probe.py")}


def _command(cmd) -> dict | None:
    """What the template needs to fork ``cmd``, a node command: its arguments, the wrapper script it runs
    through (or None) and the network namespace it runs in (``ip netns exec NS ...``, or None); None if
    ``cmd`` is not one."""
    from blocktrain.cli.main import NODE_COMMANDS   # the commands that import what the template has
    cmd, netns = list(map(str, cmd)), None
    if cmd[:3] == ["ip", "netns", "exec"] and len(cmd) > 4:
        netns, cmd = cmd[3], cmd[4:]
    if cmd[:3] == [sys.executable, *CLI] and len(cmd) > 3 and cmd[3] in NODE_COMMANDS:
        return {"args": cmd[3:], "script": None, "netns": netns}
    if cmd[:1] == [sys.executable] and len(cmd) > 1 and os.path.realpath(cmd[1]) in WRAPPERS:
        at = WRAPPERS[os.path.realpath(cmd[1])]
        if len(cmd) > 2 + at and cmd[2 + at] in NODE_COMMANDS:
            return {"args": cmd[2:], "script": cmd[1], "netns": netns}
    if cmd[:1] == [sys.executable] and len(cmd) > 1 and os.path.realpath(cmd[1]) in PROGRAMS:
        return {"args": cmd[2:], "script": cmd[1], "netns": netns}
    return None


def _template_for(cmd, kw) -> _Template | None:
    if _command(cmd) is None:
        return None   # another program, or a command that imports less than a node (not worth noting)
    if os.environ.get("BT_TEST_ZYGOTE") == "0":
        return _fallback(cmd, "BT_TEST_ZYGOTE=0")
    if threading.current_thread() is not threading.main_thread():
        return _fallback(cmd, f"started from thread {threading.current_thread().name}")
    logged = kw.get("stdin") is subprocess.DEVNULL and kw.get("stderr") is subprocess.STDOUT \
        and hasattr(kw.get("stdout"), "fileno")
    piped = kw.get("stdin") is subprocess.PIPE and kw.get("stdout") is subprocess.PIPE \
        and hasattr(kw.get("stderr"), "fileno") and kw.get("text") and kw.get("bufsize") == 1
    if not (logged or piped) or not kw.get("start_new_session") or kw.get("cwd"):
        return _fallback(cmd, "stdio other than the launcher's, a cwd or no session of its own")
    return _template_with(cmd, kw.get("env") or os.environ)


def _template_with(cmd, env) -> _Template | None:
    """A template for ``cmd`` started with ``env``: one whose import-time environment is ``env``'s, started
    if need be; None where there is none (the reason noted)."""
    if sum(len(a.encode()) + 1 for a in cmd) + 1 >= CMDLINE_ROOM:
        return _fallback(cmd, "a command line longer than the template can show")
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
    req = {"op": "spawn", **_command(cmd), "env": env, "cwd": os.getcwd()}
    if kw["stdin"] is subprocess.DEVNULL:   # the launcher's log for stdout and stderr
        pid = _spawn(t, req, [kw["stdout"].fileno()])
        counts["forked"] += 1
        return TemplateChild(t, list(cmd), pid)
    (in_r, in_w), (out_r, out_w) = os.pipe(), os.pipe()   # text pipes, line-buffered, as Popen makes them
    pid = _spawn(t, req, [in_r, out_w, kw["stderr"].fileno()], theirs=(in_r, out_w), ours=(in_w, out_r))
    counts["forked"] += 1
    child = TemplateChild(t, list(cmd), pid)
    child.stdin, child.stdout = open(in_w, "w", buffering=1), open(out_r)
    return child


def _spawn(t: _Template, req: dict, fds: list[int], *, theirs=(), ours=()) -> int:
    """Ask ``t`` to fork ``req`` with ``fds`` as the child's stdio; its pid. ``theirs``: the pipe ends only the
    child keeps (closed here once sent, or on failure); ``ours``: the other ends (closed here on failure)."""
    try:
        return t.ask(req, fds)["pid"]
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)


THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def run_cli(args: list[str], *, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, blocktrain.cli.main, *args], capture_output=True, text=True,
    stdin=DEVNULL, timeout=timeout, env=...)``, forked from a template where it can be: the tests' way to run
    a CLI command that imports torch anyway (``train-local``, ``swarm``, the benches; not the lean ones, whose
    imports are what some tests check). The nodes such a command starts through the launcher fork from a copy
    of it (:func:`_template_of_this_process`). Its environment is ``env`` (or this process's) with one thread
    per library where it names none and ``PYTHONUNBUFFERED=1``, as the launcher gives a node; stdout and
    stderr are pipes read to their end, as ``subprocess.run`` does, and a run past ``timeout`` is killed
    (its process group) and raises ``subprocess.TimeoutExpired``."""
    import selectors

    cmd = [sys.executable, *CLI, *args]
    env = {**THREADS, **(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    t = None
    if os.environ.get("BT_TEST_ZYGOTE") == "0":
        _fallback(cmd, "BT_TEST_ZYGOTE=0")
    elif threading.current_thread() is not threading.main_thread():
        _fallback(cmd, f"started from thread {threading.current_thread().name}")
    else:
        t = _template_with(cmd, env)
    if t is None:
        return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout, env=env)
    deadline = time.monotonic() + timeout
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    pid = _spawn(t, {"op": "spawn", "args": list(args), "env": env, "cwd": os.getcwd(), "cli": True},
                 [out_w, err_w], theirs=(out_w, err_w), ours=(out_r, err_r))
    counts["cli_forked"] += 1
    child = TemplateChild(t, cmd, pid)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(min(left, 1.0)):
                data = os.read(key.fd, 1 << 16)
                if data:
                    bufs[key.fd] += data
                else:
                    sel.unregister(key.fd)
        timed_out = bool(sel.get_map())
        if not timed_out:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            child.wait(10)
    finally:
        sel.close()
        for fd in bufs:
            os.close(fd)

    def text(b: bytearray) -> str:   # as ``text=True``: the locale's encoding, universal newlines
        import locale
        return b.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")
    out, err = text(bufs[out_r]), text(bufs[err_r])
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, child.returncode, out, err)


def children_cpu() -> float:
    """CPU seconds of the templates' children that they have reaped (0 without a template)."""
    return sum(t.children_cpu() for t in _templates)   # a closed one's move to this process's RUSAGE_CHILDREN


def close() -> None:
    """Stop every template (the children still running get their parent-death signal)."""
    while _templates:
        _templates.pop().close()


if __name__ == "__main__":
    serve(sys.argv[1])
