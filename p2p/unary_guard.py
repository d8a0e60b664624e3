"""A fix for hivemind 1.1.12's unary calls: one call cancelled at the wrong instant silenced a whole P2P instance.

hivemind's ``ControlClient`` multiplexes every unary call (ours: ``rpc_forward`` hops, ``rpc_info``;
hivemind's: DHT and averaging RPCs) and every incoming unary request over one persistent connection
to p2pd, read by one task (``_read_from_persistent_conn``). A call waits on a future kept in
``_pending_calls`` until that reader sets its result. When the call is cancelled (a timeout, or the
router dropping the loser of a hedged race), ``Task.cancel`` cancels that future at once, but the
call removes it from ``_pending_calls`` only when its task next runs. If the answer was read in the
same event-loop iteration, the reader runs first, calls ``set_result`` on the cancelled future, gets
``InvalidStateError`` and dies. From then on no unary answer and no incoming unary request is ever
read on that connection: every hop this process asks for times out, and it answers no hop itself,
while it looks alive in the DHT (RELIABILITY.md, "16 nodes under churn": 0 of 22 generations in one
run, every try timing out at holders that were alive). ``tests/test_unary_guard.py`` reproduces it
deterministically with real daemons.

The same class leaks on the serving side: an incoming unary request is handled by a task kept in
``_handler_tasks`` and removed when the handler returns; a request its caller gave up on (the daemon
sends a cancel, the task is cancelled) was never removed, and the finished task keeps its
``CancelledError``, whose traceback holds the handler's frames and so the request's bytes (a hop's
activations) for the life of the node: 100 calls of 1 MB given up after 0.3 s left 100 tasks behind and
the process's RSS 291 MB larger (caller and server in one process; 8 MB with this guard:
``docs/records/s26/leak_probe.py``).

The fix (:func:`install`), part 1: each ``ControlClient``'s ``_pending_calls`` becomes a :class:`PendingCalls`,
a dict whose membership test says no for a future that is already done. The reader checks membership
before every ``set_result`` / ``set_exception``, so an answer to a call that was given up is dropped
(hivemind logs it at debug level as unexpected) instead of killing the reader. Nothing else changes:
calls still store, await and pop their futures as before. Part 2: ``_handler_tasks`` becomes a
:class:`HandlerTasks`, from which a request's task removes itself once done, however it ended.

Installed when hivemind's ``control`` module is first imported (``blocktrain/p2p/__init__.py``
registers :func:`install_on_import`), so every P2P instance a blocktrain process makes is guarded,
the DHT's and the averager's included (their threads or forked children share the patched class).
"""
from __future__ import annotations

import asyncio
import importlib.abc
import importlib.util
import sys
import threading

CONTROL_MODULE = "hivemind.p2p.p2p_daemon_bindings.control"
_lock = threading.Lock()


class PendingCalls(dict):
    """``call_id -> Future`` whose ``in`` is False for a done (cancelled) future: the persistent-connection
    reader then drops a late answer instead of setting a cancelled future's result."""

    def __contains__(self, call_id) -> bool:
        fut = self.get(call_id)
        return fut is not None and not (isinstance(fut, asyncio.Future) and fut.done())


class HandlerTasks(dict):
    """``call_id -> Task`` of incoming unary requests; a task leaves it as soon as it is done, however it
    ended (hivemind's handler removes it only when it returns: not when cancelled, even before it ran)."""

    def __setitem__(self, call_id, task) -> None:
        super().__setitem__(call_id, task)
        if isinstance(task, asyncio.Future):
            task.add_done_callback(lambda t, key=call_id: self.pop(key, None) if self.get(key) is t else None)


def install(control_module=None) -> bool:
    """Patch ``ControlClient``: every new instance keeps its pending calls in a :class:`PendingCalls` and
    its incoming requests' tasks in a :class:`HandlerTasks`. Idempotent; True if the class is (now) patched."""
    module = control_module or sys.modules.get(CONTROL_MODULE)
    if module is None:
        return False
    cls = module.ControlClient
    with _lock:
        if getattr(cls, "_bt_unary_guard", False):
            return True
        original_init = cls.__init__

        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self._pending_calls = PendingCalls(self._pending_calls)
            self._handler_tasks = HandlerTasks(self._handler_tasks)

        __init__.__wrapped__ = original_init
        cls.__init__ = __init__
        cls._bt_unary_guard = True
    return True


class _PatchAfterLoad(importlib.abc.Loader):
    """Runs the real loader of hivemind's ``control`` module, then :func:`install` on it."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        install(module)

    def __getattr__(self, name):   # get_source, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)


class _ControlFinder(importlib.abc.MetaPathFinder):
    """Finds hivemind's ``control`` module the usual way and wraps its loader (see :class:`_PatchAfterLoad`)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != CONTROL_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchAfterLoad(spec.loader)
                return spec
        return None


def install_on_import() -> None:
    """Guard hivemind's unary calls now if its ``control`` module is loaded, else as soon as it is."""
    if install():
        return
    if not any(isinstance(f, _ControlFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ControlFinder())
