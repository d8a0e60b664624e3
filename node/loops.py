"""The node's background work as small handles: each loop is one thread with its own stop event.

:class:`Loop` runs ``body(stop)`` in a daemon thread; ``stop()`` sets the event and joins with a
bound. A body that raises is logged, reported through ``on_crash`` (the node then stops), and
ends its thread. :class:`Teardown` holds what a node started, in order, and stops it in reverse,
each step bounded and none able to keep the next from running.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class Loop:
    def __init__(self, name: str, body: Callable[[threading.Event], None],
                 on_crash: Callable[[str, BaseException], None] | None = None):
        self.name, self.body, self.on_crash = name, body, on_crash
        self.stop_event = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"bt-{name}", daemon=True)

    def _main(self) -> None:
        try:
            self.body(self.stop_event)
        except Exception as e:  # a crashed loop is reported, and the owner decides what to do
            log.exception("%s loop failed", self.name)
            if self.on_crash is not None:
                self.on_crash(self.name, e)

    def start(self) -> "Loop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_event.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s loop did not stop within %.0fs", self.name, timeout)


class Teardown:
    """Things to stop, pushed in start order; :meth:`close` stops them last-first, once."""

    def __init__(self):
        self._items: list[tuple[str, Callable[[], None]]] = []
        self._lock = threading.Lock()
        self.errors: list[str] = []
        self.timings: list[tuple[str, float]] = []

    def push(self, name: str, stop: Callable[[], None]) -> None:
        with self._lock:
            self._items.append((name, stop))

    def close(self) -> None:
        while True:
            with self._lock:
                if not self._items:
                    return
                name, stop = self._items.pop()
            t0 = time.monotonic()
            try:
                stop()
            except Exception as e:  # keep stopping the rest
                log.warning("stopping %s failed: %s", name, e)
                self.errors.append(f"stopping {name}: {type(e).__name__}: {e}")
            self.timings.append((name, time.monotonic() - t0))
