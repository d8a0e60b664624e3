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
"""
from __future__ import annotations

import ctypes
import linecache
import os
import sys
import threading
import time

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
