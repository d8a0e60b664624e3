"""hivemind's DHT and averager loops as threads of the node's process instead of forked children.

Why: each forked hivemind child carries its own copy-on-write share of the torch runtime and its own
Python heap (measured: DHT process ~119 MB PSS, averager ~172 MB, plus torch's shm manager ~58 MB
that hivemind's default ``file_system`` sharing strategy starts); a thread costs the loop's own
objects only. See BENCHMARKS.md "Lean nodes (issue 15)" and ``bt-node bench node-memory``.

How: hivemind's ``DHT`` and ``DecentralizedAverager`` are ``mp.Process`` classes that talk to their
``run()`` loop over an ``mp.Pipe`` (``send`` / ``recv`` / ``poll`` / ``fileno`` for the loop's
``add_reader``). :class:`RunsInThread` (a mixin, before :class:`~blocktrain.p2p.process.StopsWithParent`)
replaces that pipe by :func:`local_pipe`, which hands the very objects across (no pickling: hivemind's
``MPFuture`` resolves only the instance its creator holds when both sides share one pid), and runs
``run()`` in a daemon thread: ``start``/``is_alive``/``join``/``kill``/``terminate`` act on that thread.
A loop that does not stop when asked cannot be killed like a process: ``kill`` SIGKILLs the daemons
that thread spawned (p2pd) and leaves the thread behind (daemonic; it ends with the process).

Lifecycle, unchanged for the node: p2pd is still spawned in its own session with a parent-death
SIGTERM (p2p/process.py); the thread that forks it is the DHT's loop thread, which lives as long as
the DHT, and dies with the node's process on SIGKILL, so p2pd dies with the node.

``BT_HIVEMIND_IN=process`` keeps hivemind's forked children (the old layout, for comparison);
``thread`` (the default) is this module. Anything else is refused with a clear error.
"""
from __future__ import annotations

import collections
import os
import signal
import threading
from typing import Any

__all__ = ["HIVEMIND_IN_ENV", "RunsInThread", "default_sharing_strategy", "hivemind_in", "local_pipe",
           "record_spawned"]

HIVEMIND_IN_ENV = "BT_HIVEMIND_IN"
MODES = ("thread", "process")


def hivemind_in() -> str:
    """Where hivemind's DHT and averager loops run: ``thread`` (default) or ``process``."""
    mode = os.environ.get(HIVEMIND_IN_ENV, "thread").strip().lower() or "thread"
    if mode not in MODES:
        raise ValueError(f"{HIVEMIND_IN_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def default_sharing_strategy() -> None:
    """Before hivemind is imported: with the loops in threads nothing crosses a process, so take
    torch's ``file_descriptor`` sharing strategy (no ``torch_shm_manager`` daemon, ~58 MB) instead
    of hivemind's default ``file_system``, unless HIVEMIND_MEMORY_SHARING_STRATEGY says otherwise.
    A bad BT_HIVEMIND_IN is left for :func:`hivemind_in` to refuse when a node starts."""
    if os.environ.get(HIVEMIND_IN_ENV, "thread").strip().lower() in ("", "thread"):
        os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")


class _LocalEnd:
    """One end of :func:`local_pipe`: what the peer sent, in order, passed by reference. ``fileno()``
    is readable while a message (or the peer's close) waits, as an ``mp.Connection``'s would be: one
    wake-up byte per message, written and consumed under the same lock as the message itself (the
    event loop that watches the fd makes it non-blocking, so a read must never find it empty)."""

    def __init__(self) -> None:
        self._queue: collections.deque = collections.deque()
        self._r, self._w = os.pipe()
        self._cond = threading.Condition()
        self._eof_bytes = 0   # wake-up bytes written by the peer's close, not yet read
        self.peer: _LocalEnd | None = None
        self.closed = False

    def fileno(self) -> int:
        return self._r

    def _peer_closed(self) -> bool:
        return self.peer is None or self.peer.closed

    def send(self, obj: Any) -> None:
        peer = self.peer
        if self.closed:
            raise OSError("handle is closed")
        if peer is None or peer.closed:
            raise BrokenPipeError("the other end is closed")
        with peer._cond:
            peer._queue.append(obj)
            os.write(peer._w, b"m")
            peer._cond.notify()

    def poll(self, timeout: float | None = 0.0) -> bool:
        with self._cond:
            if not self._queue and not self._peer_closed() and timeout != 0.0:
                self._cond.wait_for(lambda: self._queue or self._peer_closed(), timeout)
            return bool(self._queue) or self._peer_closed()

    def _drain_byte(self) -> None:
        try:
            os.read(self._r, 1)
        except BlockingIOError:   # only a close's byte can be missing (already drained)
            pass

    def recv(self) -> Any:
        with self._cond:
            if self.closed:
                raise OSError("handle is closed")
            self._cond.wait_for(lambda: self._queue or self._peer_closed())
            if self._queue:
                obj = self._queue.popleft()
                self._drain_byte()
                return obj
            if self._eof_bytes:
                self._eof_bytes -= 1
                self._drain_byte()
            raise EOFError("the other end closed the pipe")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        peer = self.peer
        if peer is not None:
            with peer._cond:
                peer._eof_bytes += 1
                try:
                    os.write(peer._w, b"c")   # readable: a loop watching the fd comes and gets its EOFError
                except OSError:
                    pass
                peer._cond.notify_all()

    def __del__(self) -> None:
        for fd in (getattr(self, "_r", None), getattr(self, "_w", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def local_pipe() -> tuple[_LocalEnd, _LocalEnd]:
    """A duplex in-process stand-in for ``mp.Pipe()``: each end receives what the other sent."""
    a, b = _LocalEnd(), _LocalEnd()
    a.peer, b.peer = b, a
    return a, b


# -- daemons (p2pd) spawned by a loop thread, so that kill() can end them --------------------
_spawned: dict[int, list] = collections.defaultdict(list)   # thread ident -> asyncio Process objects
_spawned_lock = threading.Lock()


def record_spawned(proc) -> None:
    """Called (by p2p/process.py's subprocess wrapper) in the thread that spawned ``proc``."""
    with _spawned_lock:
        _spawned[threading.get_ident()].append(proc)


def _kill_spawned(ident: int | None, *, kill: bool = True) -> None:
    """Forget the daemons thread ``ident`` spawned, SIGKILLing those not yet reaped (a pid not yet
    reaped cannot have been reused)."""
    with _spawned_lock:
        procs = _spawned.pop(ident, []) if ident is not None else []
    for proc in procs if kill else ():
        if proc.returncode is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except OSError:   # already gone
                pass


class _MainThreadSignals:
    """Stands in for the ``signal`` module in ``hivemind.dht.dht``, whose loop sets SIGINT to SIG_IGN
    (right for its own process, an error in a thread): off the main thread that call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return getattr(signal, name)

    @staticmethod
    def signal(signum, handler):
        if threading.current_thread() is threading.main_thread():
            return signal.signal(signum, handler)
        return signal.getsignal(signum)


def _patch_dht_signals() -> None:
    import hivemind.dht.dht as dht_module
    if not isinstance(dht_module.signal, _MainThreadSignals):
        dht_module.signal = _MainThreadSignals()


def _patch_mpfuture_events() -> None:
    """An ``MPFuture`` made in a thread whose event loop is not running (the node's main thread) and
    resolved in a loop thread (the DHT's): hivemind would ``run_until_complete`` that idle loop from
    inside the running one, which raises. Nobody can be awaiting on a loop that is not running, so
    the event is set directly; every other case is hivemind's own code."""
    from hivemind.utils.mpfuture import MPFuture
    original = MPFuture._set_event_threadsafe
    if getattr(original, "_bt_patched", False):
        return

    def _set_event_threadsafe(self):
        loop = self._loop
        if loop is not None and not loop.is_closed() and not loop.is_running():
            self._aio_event.set()
        else:
            original(self)

    _set_event_threadsafe._bt_patched = True   # type: ignore[attr-defined]
    MPFuture._set_event_threadsafe = _set_event_threadsafe


def _patch_step_control_attach() -> None:
    """hivemind's averager ``step()`` sends its ``StepControl`` through the control pipe; the loop
    attaches a fresh trigger and cancel future to what it receives and hands them back, and the host
    attaches them to its own object. Across a process those are two objects; through a local pipe
    (passed by reference) they are one, and hivemind's second ``attach`` asserted "Futures are
    already attached", so every averaging round failed. Attaching the very same pair again is a
    no-op; any other second attach still raises, as in hivemind."""
    from hivemind.averaging.control import StepControl
    original = StepControl.attach
    if getattr(original, "_bt_patched", False):
        return

    def attach(self, trigger, cancel):
        if trigger is not None and self._trigger is trigger and self._cancel is cancel:
            return
        return original(self, trigger, cancel)

    attach._bt_patched = True   # type: ignore[attr-defined]
    StepControl.attach = attach


class RunsInThread:
    """Mixin for hivemind's ``mp.Process`` classes (``class X(RunsInThread, StopsWithParent, DHT)``).
    Call :meth:`bt_use_thread` after ``__init__`` (with ``start=False``) and before ``start()``; without
    that call the class behaves exactly as the classes after it in the MRO."""

    bt_in_thread = False
    _bt_thread: threading.Thread | None = None

    def bt_use_thread(self) -> None:
        self.bt_in_thread = True
        _patch_dht_signals()
        _patch_mpfuture_events()
        _patch_step_control_attach()
        self._bt_swap_pipes()

    def _bt_swap_pipes(self) -> None:
        """Replace hivemind's control pipe by a local one (override where more is attached to it)."""
        self._inner_pipe, self._outer_pipe = local_pipe()

    def start(self) -> None:
        if not self.bt_in_thread:
            return super().start()   # type: ignore[misc]
        if self._bt_thread is not None:
            raise RuntimeError("already started")
        self._bt_thread = threading.Thread(target=self._bt_thread_main, name=f"bt-{type(self).__name__}",
                                           daemon=True)
        self._bt_thread.start()

    def _bt_thread_main(self) -> None:
        clean = False
        try:
            self.run()
            clean = True   # the loop's own shutdown stopped what it spawned
        finally:
            _kill_spawned(threading.get_ident(), kill=not clean)

    def is_alive(self) -> bool:
        if not self.bt_in_thread:
            return super().is_alive()   # type: ignore[misc]
        return self._bt_thread is not None and self._bt_thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if not self.bt_in_thread:
            return super().join(timeout)   # type: ignore[misc]
        if self._bt_thread is not None and self._bt_thread is not threading.current_thread():
            self._bt_thread.join(timeout)

    def kill(self) -> None:
        if not self.bt_in_thread:
            return super().kill()   # type: ignore[misc]
        _kill_spawned(self._bt_thread.ident if self._bt_thread is not None else None)

    def terminate(self) -> None:
        if not self.bt_in_thread:
            return super().terminate()   # type: ignore[misc]
        self.kill()
