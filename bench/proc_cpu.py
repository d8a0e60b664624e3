"""A process's CPU time from ``/proc`` (Linux): what ``bench pipeline`` charges each worker for the training
window, and the fair budget of its one-block reference (a worker on a real network has its own machine)."""
from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (after the command name): [state, ppid, ..., utime at 11, stime at 12]."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_s(pid: int) -> tuple[float, float] | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used, alone and with its live descendants
    (a node's p2pd)."""
    own = proc_stat(pid)
    if own is None:
        return None
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (f := proc_stat(int(d.name))) is not None:
            kids.setdefault(int(f[1]), []).append(int(d.name))
    tree, todo = 0, [pid]
    while todo:
        p = todo.pop()
        if (f := proc_stat(p)) is not None:
            tree += int(f[11]) + int(f[12])
            todo += kids.get(p, [])
    return (int(own[11]) + int(own[12])) / _TICK, tree / _TICK


def spread(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)} if xs else {}


def diff(a: tuple[float, float] | None, b: tuple[float, float] | None) -> tuple[float, float] | None:
    return None if a is None or b is None else (b[0] - a[0], b[1] - a[1])
