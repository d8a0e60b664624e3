"""The node's background work as small handles: each loop is one thread with its own stop event.

:class:`Loop` runs ``body(stop)`` in a daemon thread; ``stop()`` sets the event and joins with a
bound. A body that raises is logged, reported through ``on_crash`` (the node then stops), and
ends its thread. :class:`Teardown` holds what a node started, in order, and stops it in reverse,
each step bounded (its own budget, and the whole stop's deadline) and none able to keep the next
from running: a step still running when its time is up is left to finish in the background and
recorded as abandoned. ``timings`` says how long each step took. :class:`DutyCycle` keeps a
loop's own work to a fraction of wall time (a volunteer's "use at most this share of my machine").
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
        self.join(timeout)

    def join(self, timeout: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s loop did not stop within %.0fs", self.name, timeout)


class DutyCycle:
    """Work at most ``fraction`` of wall time: after work that kept this loop busy ``busy_s`` seconds,
    :meth:`pause` is the idle time that brings busy / (busy + idle) down to ``fraction``. ``fraction`` 1 never
    pauses. (A pipeline block 0 charges each micro-batch's compute on the node, not its round trip:
    ``node/pipeline/engine.py``.)"""

    def __init__(self, fraction: float = 1.0):
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"--train-duty must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.paused_s = 0.0        # total idle time this cycle asked for (reported in status)

    def pause(self, busy_s: float) -> float:
        if self.fraction >= 1.0 or busy_s <= 0.0:
            return 0.0
        p = busy_s * (1.0 - self.fraction) / self.fraction
        self.paused_s += p
        return p

    def paced(self, work: Callable[[], None], stop: threading.Event) -> None:
        """Run ``work`` once, then stay idle for its share of the cycle (``stop`` cuts the idle short)."""
        t0 = time.monotonic()
        work()
        p = self.pause(time.monotonic() - t0)
        if p:
            stop.wait(p)


class Teardown:
    """Things to stop, pushed in start order; :meth:`close` stops them last-first, once.

    Each step runs in its own thread and gets ``budget`` seconds (given at :meth:`push`), cut to
    what is left of ``close``'s ``deadline`` but never below ``min_step`` (so later steps, such as
    stopping child processes, still get their turn when earlier ones overran)."""

    def __init__(self, min_step: float = 0.2):
        self._items: list[tuple[str, Callable[[], None], float]] = []
        self._lock = threading.Lock()
        self.min_step = min_step
        self.errors: list[str] = []
        self.timings: list[tuple[str, float]] = []

    def push(self, name: str, stop: Callable[[], None], budget: float | Callable[[], float] = 5.0) -> None:
        """``budget``: seconds, or a function giving them when the step's turn comes."""
        with self._lock:
            self._items.append((name, stop, budget))

    def close(self, deadline: float | None = None) -> None:
        """Stop everything, last pushed first; ``deadline`` (seconds) bounds the whole close."""
        t_start = time.monotonic()
        while True:
            with self._lock:
                if not self._items:
                    return
                name, stop, budget = self._items.pop()
            if callable(budget):
                budget = float(budget())
            if deadline is not None:
                budget = max(self.min_step, min(budget, deadline - (time.monotonic() - t_start)))
            t0 = time.monotonic()
            failed: list[BaseException] = []

            def run(stop=stop, failed=failed) -> None:
                try:
                    stop()
                except BaseException as e:  # keep stopping the rest
                    failed.append(e)

            th = threading.Thread(target=run, name=f"bt-stop-{name}", daemon=True)
            th.start()
            th.join(budget)
            took = time.monotonic() - t0
            self.timings.append((name, took))
            if th.is_alive():
                log.warning("stopping %s did not finish within %.1fs; going on", name, budget)
                self.errors.append(f"stopping {name}: abandoned after {budget:.1f}s")
            elif failed:
                e = failed[0]
                log.warning("stopping %s failed: %s", name, e)
                self.errors.append(f"stopping {name}: {type(e).__name__}: {e}")
