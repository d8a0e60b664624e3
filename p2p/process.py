"""hivemind's child processes as a node's children: they stop when the node tells them and never
outlive it.

A node has three kinds of hivemind children: the DHT process and the averager process
(``multiprocessing`` children, forked), and the libp2p daemon ``p2pd`` (a Go binary the DHT process
starts with ``asyncio.create_subprocess_exec``). Left as hivemind makes them:

* a Ctrl-C or ``kill -- -PGID`` reaches every process of the group at once: p2pd exits on SIGINT
  (Go installs its own handler even over an inherited SIG_IGN) and the DHT and averager processes
  die on SIGTERM, so the node is left half alive, unable to withdraw its records or to stop;
* a SIGKILLed node leaves them all running (they only stop when told through their pipes).

So, in this module (applied by :class:`~blocktrain.p2p.discovery.Discovery` and the averager):

* :class:`StopsWithParent`, a mixin for hivemind's ``mp.Process`` classes: in the child, right
  after the fork, SIGINT and SIGTERM are ignored (the parent stops the child through its pipe, in
  order, and SIGKILLs it if that takes too long: :func:`stop_process`), and a watchdog thread
  ends the child (``os._exit``) within :data:`WATCH_INTERVAL` seconds of its parent's death. A
  watchdog rather than a parent-death signal, because ``PR_SET_PDEATHSIG`` fires when the parent
  *thread* that forked the child ends, and the threads that start a DHT are not all long-lived.
* :func:`detach_spawned_daemons`, applied in the DHT process (whose only subprocess is p2pd):
  p2pd starts in its own session, so signals to the node's process group never reach it (hivemind
  stops it with SIGTERM when the DHT shuts down), with ``PR_SET_PDEATHSIG`` = SIGTERM, so it exits
  when the DHT process does (the DHT process's main thread, which forks it, lives as long as that
  process).
* :class:`DroppingPipe`, the DHT process's request pipe: a request from a process that has exited
  is dropped at once instead of stalling the DHT for 3 s (and past its stop deadline).
* :func:`parent_death_preexec`, the same parent-death signal for any ``subprocess.Popen`` child
  (the local swarm's node processes).
"""
from __future__ import annotations

import asyncio
import atexit
import ctypes
import functools
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Callable

from blocktrain.p2p.inprocess import record_spawned

logger = logging.getLogger(__name__)

__all__ = ["DroppingPipe", "StopsWithParent", "WATCH_INTERVAL", "detach_spawned_daemons", "parent_death_preexec",
           "set_parent_death_signal", "stop_process", "watch_parent"]

# p2pd is a Go program: collect garbage at 25% heap growth (BENCHMARKS.md "Lean nodes (issue 15)").
# Not GOMEMLIMIT=24MiB (the first lean pass): under it streaming 300 MB through two daemons cost
# 6.4-7.0 s of daemon CPU against 1.3 s with GOGC=25 alone (the GC runs all the time near the
# limit), and a daemon starved of CPU for 10 s loses its connections (yamux keepalive)
P2PD_GO_ENV = {"GOGC": "25"}
WATCH_INTERVAL = 0.25    # seconds between a child's looks at its parent pid
PR_SET_PDEATHSIG = 1     # <linux/prctl.h>


@functools.lru_cache(maxsize=1)
def _prctl():
    """libc's prctl, resolved once (never inside a freshly forked child), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when the thread that forked it ends."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def parent_death_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess`` / asyncio: the child gets ``sig`` when its parent (the
    forking thread) ends, and exits at once if the parent is already gone. Only fork from threads
    that live as long as the child should (the main thread, an event loop's thread)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent, signum = os.getpid(), int(sig)

    def preexec() -> None:   # in the child, between fork and exec: no imports, no allocation to speak of
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:   # the parent died before the signal was armed
            os._exit(1)
    return preexec


def watch_parent(parent_pid: int, on_orphaned: Callable[[], None], interval: float = WATCH_INTERVAL
                 ) -> threading.Thread:
    """A daemon thread that calls ``on_orphaned()`` once this process's parent is no longer
    ``parent_pid`` (it died: the process was re-parented)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        on_orphaned()
    t = threading.Thread(target=watch, name="bt-parent-watch", daemon=True)
    t.start()
    return t


def _exit_orphaned() -> None:
    os._exit(0)


def detach_spawned_daemons() -> None:
    """In this process (the DHT's, whose only subprocess is p2pd): every asyncio subprocess starts
    in its own session with a parent-death SIGTERM (see the module docstring)."""
    import asyncio.subprocess as aio_sub

    if getattr(aio_sub.create_subprocess_exec, "_bt_detached", False):
        return
    original = aio_sub.create_subprocess_exec

    async def create_subprocess_exec(program, *args, **kwargs):
        kwargs.setdefault("start_new_session", True)
        if kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = parent_death_preexec(signal.SIGTERM)
        # p2pd's Go runtime: a smaller heap (GOGC / GOMEMLIMIT already in the environment win)
        kwargs["env"] = {**P2PD_GO_ENV, **(kwargs.get("env") or os.environ)}
        proc = await original(program, *args, **kwargs)
        record_spawned(proc)   # a DHT loop run in a thread (p2p/inprocess.py) can then kill it
        return proc

    create_subprocess_exec._bt_detached = True   # type: ignore[attr-defined]
    aio_sub.create_subprocess_exec = create_subprocess_exec
    asyncio.create_subprocess_exec = create_subprocess_exec


def enter_child(parent_pid: int, *, spawns_daemons: bool) -> None:
    """First thing in a hivemind ``mp.Process`` child: ignore stop signals, die with the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.getppid() != parent_pid:   # the parent died while we were being forked
        _exit_orphaned()
    watch_parent(parent_pid, _exit_orphaned)
    if spawns_daemons:
        detach_spawned_daemons()


_started: "weakref.WeakSet" = weakref.WeakSet()   # children of this process made by StopsWithParent


class StopsWithParent:
    """Mixin for a hivemind ``mp.Process`` class (``class X(StopsWithParent, DHT)``): see the module
    docstring. ``bt_spawns_daemons``: the child starts p2pd (the DHT process)."""

    bt_spawns_daemons = False
    _bt_parent_pid: int | None = None

    def start(self) -> None:
        self._bt_parent_pid = os.getpid()
        super().start()   # type: ignore[misc]
        _started.add(self)

    def run(self) -> None:
        if self._bt_parent_pid is not None:
            enter_child(self._bt_parent_pid, spawns_daemons=self.bt_spawns_daemons)
        super().run()   # type: ignore[misc]


class DroppingPipe:
    """A hivemind child's end of its request pipe (the DHT process's ``_inner_pipe``). Each request
    carries its reply channel as a file descriptor that the receiver fetches from the *sender's*
    process; a request sent by a process that has exited since (the averager process, stopped a
    moment before the DHT) cannot be read. hivemind then logs it and stalls its request loop for
    ``wait_timeout`` (3 s), so the DHT missed its stop deadline and had to be killed. Such a request
    is dropped at once instead (nobody waits for its answer): it reads as a call of ``no_op``, a
    coroutine method of the child that does nothing."""

    def __init__(self, conn, no_op: str):
        self._conn = conn
        self._no_op = no_op

    def recv(self):
        try:
            return self._conn.recv()
        except (OSError, ConnectionError) as e:
            logger.info("dropped a request whose sender has exited: %s", e)
            return (self._no_op, [], {})

    def __getattr__(self, name):   # fileno, poll, close: the connection's own
        return getattr(self._conn, name)


def stop_process(proc, graceful: Callable[[], None] | None, timeout: float) -> bool:
    """Stop an ``mp.Process`` child: ``graceful()`` (which asks it to stop), up to ``timeout``
    seconds for it to exit, then SIGKILL (children of this module ignore SIGTERM). True if it
    stopped when asked (or was not running), False if it had to be killed."""
    t0 = time.monotonic()
    if graceful is not None:
        try:
            graceful()
        except Exception:   # already gone, or a broken pipe: kill below
            pass
    try:
        if proc.is_alive():
            proc.join(max(0.0, timeout - (time.monotonic() - t0)))
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
            return False
    except (AssertionError, ValueError):   # not started by this process, or already closed
        pass
    return True


@atexit.register
def _kill_left_children() -> None:
    """At interpreter exit, SIGKILL such children still running: multiprocessing's own exit hook
    (registered before this one, so run after it) SIGTERMs daemonic children and then joins them,
    which would wait for ever on a child that ignores SIGTERM."""
    for proc in list(_started):
        try:
            if proc._parent_pid == os.getpid() and proc.is_alive():
                proc.kill()
                proc.join(2.0)
        except (AssertionError, ValueError, AttributeError):
            pass
