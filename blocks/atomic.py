"""Atomic file writes: write a temporary file in the same directory, flush and fsync it, move it
into place with ``os.replace``, fsync the directory. A crash leaves the old file or the new one,
never a half one."""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Any, Callable


def _tmp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # platforms that cannot open a directory (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(final: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)``, fsync tmp, ``os.replace(tmp, final)``, fsync the directory.
    On any failure the temporary file is removed and ``final`` is untouched."""
    _write_then_place(final, write, lambda _key: final, reuse=False)


def atomic_write_named(draft: Path, write: Callable[[Path], str],
                       name: Callable[[str], Path]) -> tuple[Path, str, bool]:
    """Like :func:`atomic_write` for a file named after what was written (a content hash):
    ``write(tmp)`` writes the temporary file beside ``draft`` and returns a key, ``name(key)`` is the
    final path. If that file already exists (the same content), the new one is dropped. Returns the
    final path, the key, and whether this call created the file."""
    return _write_then_place(draft, write, name, reuse=True)


def _write_then_place(draft: Path, write: Callable[[Path], Any], name: Callable[[Any], Path],
                      *, reuse: bool) -> tuple[Path, Any, bool]:
    draft.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(draft)
    try:
        key = write(tmp)
        final = name(key)
        if reuse and final.exists():
            tmp.unlink()
            return final, key, False
        _fsync_path(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(final.parent)
    return final, key, True


def write_bytes(data: bytes) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
    return write
