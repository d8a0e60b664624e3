"""Stop signals for the long-running commands (``seed``, ``join``, ``swarm``).

The first SIGINT (Ctrl-C) or SIGTERM, sent to the process or to its whole process group, asks for
a graceful stop: ``on_first()`` runs, and while the command is still starting (inside
:meth:`StopSignals.interrupting`) :class:`Interrupted` is raised in the main thread so the start
is cut short. The command then stops what it started and exits 0. A second signal runs
``on_second()`` and exits at once with 128 + the signal number, except while this process is an
orphan: a parent-death signal (``PR_SET_PDEATHSIG``, set by the launcher of ``bt-node swarm``)
comes once for every thread of the dead parent that the kernel re-parents the child to, so
repeats then are not a user's second Ctrl-C.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """Raised in the main thread by the first stop signal while a command is starting."""


class StopSignals:
    def __init__(self, on_first: Callable[[], None], on_second: Callable[[], None] | None = None):
        self.on_first, self.on_second = on_first, on_second
        self.received: int | None = None
        self._interruptible = False
        self._parent = os.getppid()

    def install(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    @contextlib.contextmanager
    def interrupting(self):
        """Inside this block the first signal also raises :class:`Interrupted` (at once, if one
        already came)."""
        self._interruptible = True
        try:
            if self.received is not None:
                raise Interrupted()
            yield
        finally:
            self._interruptible = False

    def _handle(self, signum, _frame) -> None:
        if self.received is not None and os.getppid() != self._parent:   # parent-death repeats: see above
            return
        if self.received is not None:   # the second signal: no more waiting
            try:
                if self.on_second is not None:
                    self.on_second()
            finally:
                sys.stderr.write(f"\nsecond {signal.Signals(signum).name}: exiting now\n")
                sys.stderr.flush()
                os._exit(128 + signum)
        self.received = signum
        sys.stderr.write(f"\n{signal.Signals(signum).name}: stopping (send it again to exit at once)\n")
        sys.stderr.flush()
        self.on_first()
        if self._interruptible:
            raise Interrupted()
