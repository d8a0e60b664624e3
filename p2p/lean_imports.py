"""Imports hivemind makes that a node does not use, deferred until first use (issue 15, lean nodes).

``hivemind.averaging.load_balancing`` imports ``scipy.optimize`` at module level (321 scipy modules,
~24 MB of private memory, ~28 MB PSS in a running node: BENCHMARKS.md "Lean nodes (issue 15)") for one
call, ``scipy.optimize.linprog`` in ``optimize_parts_lp``. hivemind calls that only when a peer of the
averaging group states a bandwidth; blocktrain's averager never sets one (every peer gathers ``None``,
so ``load_balance_peers`` splits evenly without scipy). :func:`defer_scipy_optimize` puts a stand-in
``scipy.optimize`` in ``sys.modules``; the first read of an attribute it lacks (``linprog``, when a
foreign peer does state a bandwidth; ``__path__`` for a submodule import) imports the real module,
which then replaces it in ``sys.modules`` and on ``scipy``. Same behaviour, later import.
(Not :class:`importlib.util.LazyLoader`: Python's ``import`` statement reads ``__spec__`` of a module
found in ``sys.modules``, which makes a LazyLoader module load at once.)

Called from ``blocktrain/p2p/__init__.py``, before any submodule imports hivemind.
``BT_EAGER_IMPORTS=scipy`` (a comma list; ``bt-node bench node-memory`` uses it for its older layouts)
keeps the eager import.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import types

EAGER_ENV = "BT_EAGER_IMPORTS"


def eager(name: str) -> bool:
    """True if ``BT_EAGER_IMPORTS`` (comma-separated) names ``name``: keep that import eager."""
    return name in {x.strip().lower() for x in os.environ.get(EAGER_ENV, "").split(",")}


class _Deferred(types.ModuleType):
    """A module's stand-in: its spec's ``__spec__``, ``__name__``, ``__file__``, ``__loader__``,
    ``__package__`` (read by code that scans ``sys.modules``, e.g. ``inspect.getmodule``); any other
    attribute imports the real module (once, under a lock) and is read from it."""

    _lock = threading.RLock()   # re-entered while the real module runs: its submodules read its attributes

    def __getattr__(self, attr: str):
        name = self.__name__
        with _Deferred._lock:
            real = sys.modules.get(name)
            if real is self or real is None:
                sys.modules.pop(name, None)
                real = importlib.import_module(name)   # also sets the parent package's attribute
        return getattr(real, attr)


def defer_scipy_optimize() -> bool:
    """Put a stand-in for ``scipy.optimize`` in ``sys.modules``. True if it was deferred here; False if
    it is already imported, scipy is missing, or ``BT_EAGER_IMPORTS`` names ``scipy``."""
    name = "scipy.optimize"
    if name in sys.modules or eager("scipy"):
        return False
    try:
        spec = importlib.util.find_spec(name)   # imports the light ``scipy`` package itself
    except ImportError:
        return False
    if spec is None:
        return False
    stand_in = _Deferred(name)
    stand_in.__spec__, stand_in.__file__, stand_in.__loader__ = spec, spec.origin, spec.loader
    stand_in.__package__ = spec.parent
    sys.modules[name] = stand_in
    setattr(sys.modules["scipy"], "optimize", stand_in)   # as a submodule import would
    return True
