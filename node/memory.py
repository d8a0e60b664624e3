"""Process-level memory settings of a node (BENCHMARKS.md "Lean nodes (issue 15)").

glibc keeps freed heap memory for reuse unless the free block at the top of the heap exceeds
M_TRIM_THRESHOLD (which it raises dynamically up to 32 MB as large blocks come and go); a node's
training and networking threads free and reallocate many mid-sized buffers, so its heap stays at
its high-water mark. A fixed 64 KiB threshold and no top padding let glibc return freed tops to
the system, and ``malloc_trim(0)`` every 10 s returns whole free pages inside the heap too (a few
to ~15 MB of PSS for a tiny-model node, within run-to-run noise: BENCHMARKS.md). An environment variable
(MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_) set by the operator wins; BT_TUNE_MALLOC=0 leaves
glibc's defaults alone (``bt-node bench node-memory`` uses it for the "before" layout).

The mmap threshold is pinned too, at 4 MiB (MALLOC_MMAP_THRESHOLD_ set by the operator wins): glibc
raises it on every free of a mapped block (torch's import frees many), up to 32 MB, and every
allocation under it comes from a heap that keeps its high-water mark and fragments. A large block's
activations (12-50 MB each at d_model 768) then outlive their tensors in the RSS: without the pin a
d_model-768 middle block (4 micro-batches in flight, recompute) peaked 286 MiB higher, the whole-size
model's process 791 MiB (``bt-node bench memory --allocator glibc`` vs ``node``, docs/records/s17), for
about 5% more CPU in that block's step (docs/records/s19). Allocations of 4 MiB and more get their own
mapping and leave the RSS when freed; a tiny model's are all smaller, so a tiny node runs as before (its training
thread's arena and CPU per step unchanged: ``bench/trainer_arena.py``).

:func:`release_startup_pages`, called once when the node has started, drops this process's page-table
entries for the code of its shared libraries (read-only, never-written file mappings of ``*.so``
files and of the interpreter): importing torch touches ~70 MB of ``libtorch_cpu.so`` (static
initialisers spread over the whole library: operator registrations, ...) of which a training node
then runs a fraction. ``madvise(MADV_DONTNEED)`` on such a mapping only unmaps the pages: they stay
in the page cache, and the next instruction fetch from one maps it again (a minor fault, no disk
read). The kernel reclaims such clean file pages under memory pressure anyway; dropping them once
makes the node's RSS its working set instead of its start-up's high-water mark. A mapping with any
written (copy-on-write, anonymous) page, e.g. relocated data, is never touched. It also empties
``linecache`` (source lines that warnings and tracebacks printed while starting read in: ~2 MB) and
returns free heap pages (``malloc_trim``). BT_RELEASE_PAGES=0 keeps them all (``bt-node bench
node-memory``'s older layouts).

:func:`import_torch_lean`, called by the node commands before anything imports torch, keeps torch's
Python meta kernels out of the node: ``torch._meta_registrations`` and the ``torch._decomp``,
``torch._prims`` and ``torch._refs`` it imports (533 meta kernels and 1,097 decompositions in torch
2.13's tables), -17.6 MB of private memory in a bare interpreter (BENCHMARKS.md "Lean nodes", fifth
pass). They serve meta and fake tensors (``torch.compile``, ``torch.export``, shape propagation), which
a node never creates: its tensors are CPU or CUDA tensors, whose kernels are C++, so its results are bit
for bit the same (tests/test_lean_imports.py). Of ``torch._prims`` a node needs one thing, the metaclass
``torch._prims.rng_prims`` gives ``torch.Generator`` (which refuses to run without it): it is set here
by the same call. The first import of a compile or decomposition stack (``METAS_NEEDED_BY``) loads the
real registrations first, as does the first read of an attribute of the stand-in (``from
torch._meta_registrations import ...``); an op run on a meta tensor with no kernel of its own before
that raises torch's NotImplementedError (loud, never a wrong result). The packages of ``TORCH_UNUSED``
(``torch.export``, ``torch.distributions``, ``torch.quantization``, ``torch.masked``, ``torch.profiler``:
imported by torch's ``__init__``, read by no node code nor hivemind's; about -5 MB more) get stand-ins
as scipy does (p2p/lean_imports.py): the first read of any of their names imports them.
``BT_EAGER_IMPORTS=torch`` keeps all of it eager.
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import os
import sys
import threading
import time

from ..p2p.lean_imports import eager, is_stand_in, stand_in

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3   # <malloc.h>
MADV_DONTNEED = 4   # <sys/mman.h>
TRIM_THRESHOLD = 64 * 1024
MMAP_THRESHOLD = 4 * 1024 * 1024
TRIM_EVERY_S = 10.0   # malloc_trim(0) also returns whole free pages inside the heap, not only its top
_trimmer: threading.Thread | None = None


def tune_malloc() -> bool:
    """Apply the settings above in this process (glibc only; a no-op elsewhere). True if applied."""
    if not sys.platform.startswith("linux") or os.environ.get("BT_TUNE_MALLOC", "1").strip() == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):   # not glibc (musl has no mallopt)
        return False
    global _trimmer
    ok = True
    if _trimmer is None and hasattr(libc := ctypes.CDLL(None), "malloc_trim"):
        def trim() -> None:
            while True:
                time.sleep(TRIM_EVERY_S)
                libc.malloc_trim(0)
        _trimmer = threading.Thread(target=trim, name="bt-malloc-trim", daemon=True)
        _trimmer.start()
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if "MALLOC_TOP_PAD_" not in os.environ:
        ok = mallopt(M_TOP_PAD, 0) == 1 and ok
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and ok
    return ok


def _code_mappings(smaps: str, executable: str) -> list[tuple[int, int]]:
    """(start, end) of each mapping in ``smaps`` (the text of /proc/PID/smaps) that is a private,
    read-only mapping of a shared library or of ``executable`` with resident pages and no written one."""
    out, cur = [], None

    def done(m):
        if m and m["Rss"] > 0 and m["Anonymous"] == 0 and m["Private_Dirty"] == 0 and m["Shared_Dirty"] == 0:
            out.append((m["start"], m["end"]))

    for line in smaps.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and not head[0].endswith(":"):   # a mapping's first line
            done(cur)
            cur = None
            perms, path = head[1], (head[5].strip() if len(head) > 5 else "")
            name = os.path.basename(path)
            if (perms[1] == "-" and perms[3] == "p" and path.startswith("/")
                    and (".so" in name or path == executable) and not path.endswith(" (deleted)")):
                a, b = (int(x, 16) for x in head[0].split("-"))
                cur = {"start": a, "end": b, "Rss": 0, "Anonymous": 0, "Private_Dirty": 0, "Shared_Dirty": 1}
        elif cur is not None and len(head) >= 2 and head[0].rstrip(":") in cur:
            cur[head[0].rstrip(":")] = int(head[1])
        elif cur is not None and head and head[0] == "VmFlags:" and "lo" in head[1:]:
            cur = None   # mlock()ed: leave it
    done(cur)
    return out


def release_startup_pages() -> int:
    """Unmap the resident pages of this process's shared-library code (see the module docstring); the
    bytes of RSS released. 0 where not Linux or BT_RELEASE_PAGES=0."""
    if not sys.platform.startswith("linux") or os.environ.get("BT_RELEASE_PAGES", "1").strip() == "0":
        return 0
    try:
        with open("/proc/self/smaps") as f:
            ranges = _code_mappings(f.read(), os.path.realpath(sys.executable))
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    madvise = libc.madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    before = _rss_file()
    for a, b in ranges:
        madvise(a, b - a, MADV_DONTNEED)   # a failure (EINVAL: the mapping changed meanwhile) changes nothing
    released = max(0, before - _rss_file())
    linecache.clearcache()
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    return released


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


TORCH_METAS = "torch._meta_registrations"
# the stacks that run meta or fake tensors: the first import of one loads the real registrations before it
METAS_NEEDED_BY = ("torch._decomp", "torch._refs", "torch._dynamo", "torch._inductor", "torch._functorch.aot_autograd")
# packages torch's __init__ imports that no node code (nor hivemind's) reads: imported on their first read
TORCH_UNUSED = ("torch.export", "torch.distributions", "torch.quantization", "torch.masked", "torch.profiler")


class _AlreadyImported(importlib.abc.Loader):
    """The loader of a module that :func:`load_torch_metas` imported while the import system was looking
    for it: hands the module in ``sys.modules`` (run once) to the import under way, which would otherwise
    run the module's file a second time into a new module object, and gives it back its own spec."""

    def __init__(self, module):
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec   # the import system set ours


class _MetasFirstFinder(importlib.abc.MetaPathFinder):
    """On sys.meta_path while the registrations are deferred: the first import of a module of
    ``METAS_NEEDED_BY`` imports the real registrations first, in torch's own order (they import
    ``torch._decomp``, ``torch._prims`` and ``torch._refs`` themselves), then that module."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in METAS_NEEDED_BY:
            return None
        load_torch_metas()   # takes this finder off sys.meta_path first
        module = sys.modules.get(fullname)
        if module is None:
            return None   # not imported by the registrations (torch._dynamo, ...): the usual finders go on
        alias = importlib.machinery.ModuleSpec(fullname, _AlreadyImported(module))
        module.__spec__ = alias   # the import system takes the spec of a module found in sys.modules meanwhile
        return alias


def import_torch_lean() -> bool:
    """Import torch with stand-ins for ``torch._meta_registrations`` and ``TORCH_UNUSED`` (see the module
    docstring). True if deferred here; False if torch is already imported or lacks those modules, or
    ``BT_EAGER_IMPORTS`` names ``torch`` (then torch is imported as usual)."""
    if "torch" in sys.modules or TORCH_METAS in sys.modules or eager("torch"):
        return False
    spec = importlib.util.find_spec("torch")   # a top-level name: imports nothing
    if spec is None or not spec.submodule_search_locations:
        return False
    root = list(spec.submodule_search_locations)[0]
    files = {name: os.path.join(root, *name.split(".")[1:], "__init__.py") for name in TORCH_UNUSED}
    files[TORCH_METAS] = os.path.join(root, "_meta_registrations.py")
    if not all(os.path.isfile(f) for f in files.values()):
        return False
    for name, f in files.items():   # a package's stand-in has no __path__: its submodules import the real one
        sys.modules[name] = stand_in(name, importlib.util.spec_from_file_location(name, f))
    sys.meta_path.insert(0, _MetasFirstFinder())
    import torch
    _generator_metaclass(torch)
    return True


def _generator_metaclass(torch) -> None:
    """torch 2.13's ``torch.Generator()`` refuses to run until ``torch._prims.rng_prims`` has set the
    Generator's metaclass, which the registrations' import of ``torch._prims`` otherwise does: set it as
    that module does (one call), or, where this torch lacks the call, import the module (+6 MB)."""
    try:
        set_metaclass = torch._C._set_generator_metaclass
        from torch._opaque_base import OpaqueBaseMeta
    except (AttributeError, ImportError):
        try:
            importlib.import_module("torch._prims.rng_prims")
        except ImportError:
            pass   # a torch without either needs neither
        return
    set_metaclass(OpaqueBaseMeta)


def load_torch_metas() -> bool:
    """Import the real ``torch._meta_registrations`` now if :func:`import_torch_lean` stood in for it.
    True if loaded here."""
    for finder in [f for f in sys.meta_path if isinstance(f, _MetasFirstFinder)]:
        sys.meta_path.remove(finder)
    deferred = sys.modules.get(TORCH_METAS)
    if not is_stand_in(deferred):
        return False
    getattr(deferred, "register_meta", None)   # any attribute imports the real module, which replaces the stand-in
    return True
