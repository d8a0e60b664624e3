"""Imports hivemind makes that a node does not use, deferred until first use (issue 15, lean nodes).

* ``scipy.optimize``: ``hivemind.averaging.load_balancing`` imports it at module level (321 scipy
  modules, ~24 MB of private memory, ~28 MB PSS in a running node: BENCHMARKS.md "Lean nodes (issue 15)")
  for one call, ``scipy.optimize.linprog`` in ``optimize_parts_lp``. hivemind calls that only when a
  peer of the averaging group states a bandwidth; blocktrain's averager never sets one (every peer
  gathers ``None``, so ``load_balance_peers`` splits evenly without scipy). :func:`defer_scipy_optimize`
  puts stand-ins for ``scipy`` and ``scipy.optimize`` in ``sys.modules`` (the base package too: 23
  modules, +1.0 MB anonymous after numpy, which the node never needs either); the first read of an
  attribute a stand-in lacks (``linprog``, when a foreign peer does state a bandwidth; ``__path__`` for
  a submodule import) imports the real module, which then replaces it in ``sys.modules``.
* hivemind's package ``__init__``: ``import hivemind.dht`` runs ``hivemind/__init__.py`` first, which
  imports ``hivemind.moe`` (mixture-of-experts servers and clients) and ``hivemind.optim`` (its
  collaborative optimizer), 37 modules and +1.7 MB anonymous that no node code path uses (blocktrain
  imports hivemind's submodules by their full names). :func:`defer_hivemind_init` registers the
  package without running its ``__init__``; its submodules import as usual, and the first read of a
  name the package lacks (``hivemind.DHT``, ``hivemind.moe``, ``hivemind.__version__``) runs the real
  ``__init__`` in the same module object. Same behaviour, later import.

(Not :class:`importlib.util.LazyLoader`: Python's ``import`` statement reads ``__spec__`` of a module
found in ``sys.modules``, which makes a LazyLoader module load at once.)

Called from ``blocktrain/p2p/__init__.py``, before any submodule imports hivemind.
``BT_EAGER_IMPORTS`` (a comma list; ``bt-node bench node-memory`` uses it for its older layouts) keeps
imports eager: ``scipy`` (scipy and scipy.optimize), ``scipy-base`` (the scipy package only: the
default until 2026-12-01's fourth pass), ``hivemind`` (hivemind's ``__init__``); ``cli`` (cli/main.py)
and ``torch`` (node/memory.py) are read there.
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


def is_stand_in(module) -> bool:
    """True if ``module`` (an entry of ``sys.modules``) is a stand-in whose real module is not imported yet."""
    return isinstance(module, _Deferred)


def stand_in(name: str, spec) -> _Deferred:
    """A :class:`_Deferred` stand-in for module ``name`` found at ``spec`` (also used by node/memory.py for torch)."""
    m = _Deferred(name)
    m.__spec__, m.__file__, m.__loader__, m.__package__ = spec, spec.origin, spec.loader, spec.parent
    return m


def defer_scipy_optimize() -> bool:
    """Put stand-ins for ``scipy.optimize`` (and, unless ``BT_EAGER_IMPORTS`` names ``scipy-base``, for the
    ``scipy`` package itself) in ``sys.modules``. True if deferred here; False if already imported, scipy
    is missing, or ``BT_EAGER_IMPORTS`` names ``scipy``."""
    name = "scipy.optimize"
    if name in sys.modules or eager("scipy"):
        return False
    if eager("scipy-base") or "scipy" in sys.modules:
        try:
            spec = importlib.util.find_spec(name)   # imports the scipy package itself
        except ImportError:
            return False
        if spec is None:
            return False
        deferred = stand_in(name, spec)
        sys.modules[name] = deferred
        setattr(sys.modules["scipy"], "optimize", deferred)   # as a submodule import would
        return True
    base = importlib.util.find_spec("scipy")   # a top-level name: imports nothing
    if base is None or not base.submodule_search_locations:
        return False
    path = os.path.join(list(base.submodule_search_locations)[0], "optimize", "__init__.py")
    if not os.path.isfile(path):
        return False
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[os.path.dirname(path)])
    # no __path__ on the package's stand-in: importing any scipy submodule reads it, which imports the
    # real scipy first (its __init__ runs, as it would have)
    package = stand_in("scipy", base)
    deferred = stand_in(name, spec)
    package.optimize = deferred   # hivemind's ``import scipy.optimize`` binds the package; it reads .optimize
    sys.modules["scipy"], sys.modules[name] = package, deferred
    return True


def defer_hivemind_init() -> bool:
    """Register the ``hivemind`` package without running its ``__init__`` (see the module docstring).
    True if deferred here; False if hivemind is already imported, missing, or ``BT_EAGER_IMPORTS``
    names ``hivemind``."""
    if "hivemind" in sys.modules or eager("hivemind"):
        return False
    spec = importlib.util.find_spec("hivemind")   # a top-level name: imports nothing
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return False
    package = importlib.util.module_from_spec(spec)   # __path__, __file__, __spec__: submodules import

    def __getattr__(attr: str):   # PEP 562: only for names the package lacks
        if attr.startswith("__") and attr.endswith("__") and attr not in ("__version__", "__all__"):
            raise AttributeError(attr)   # probes (``__wrapped__``, ...): hivemind's init defines none of them
        sub = sys.modules.get(f"hivemind.{attr}")
        if sub is not None:   # a submodule still importing (``import hivemind.p2p.x as y`` reads it here)
            return sub
        with _Deferred._lock:
            if vars(package).pop("__getattr__", None) is not None:
                spec.loader.exec_module(package)   # the real __init__, in the registered module
        return getattr(package, attr)

    package.__getattr__ = __getattr__
    sys.modules["hivemind"] = package
    return True
