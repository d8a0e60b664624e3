"""Process-level memory settings of a node (BENCHMARKS.md "Lean nodes (issue 15)").

glibc keeps freed heap memory for reuse unless the free block at the top of the heap exceeds
M_TRIM_THRESHOLD (which it raises dynamically up to 32 MB as large blocks come and go); a node's
training and networking threads free and reallocate many mid-sized buffers, so its heap stays at
its high-water mark. A fixed 64 KiB threshold and no top padding let glibc return freed tops to
the system, and ``malloc_trim(0)`` every 10 s returns whole free pages inside the heap too (a few
to ~15 MB of PSS for a tiny-model node, within run-to-run noise: BENCHMARKS.md). An environment variable
(MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_) set by the operator wins; BT_TUNE_MALLOC=0 leaves
glibc's defaults alone (``bt-node bench node-memory`` uses it for the "before" layout).
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

M_TRIM_THRESHOLD, M_TOP_PAD = -1, -2   # <malloc.h>
TRIM_THRESHOLD = 64 * 1024
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
    return ok
