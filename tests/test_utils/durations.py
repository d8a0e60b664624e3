"""How long each test file took in the last measured run: the order in which xdist hands files to
its workers (longest first, so one long file does not start last and run alone at the end).

xdist's ``--dist loadfile`` gives each worker whole files, and by default orders them by their number
of tests: a file with one 2-minute test went last. ``tests/conftest.py`` orders the collected items
by the figures in ``tests/durations.json`` instead (files not listed there count as short); the
figures only order the run, no test reads them. Regenerate after a change that moves them a lot:

    BT_CPU_LOG=/tmp/cpu.jsonl python -m pytest -q
    python tests/test_utils/durations.py /tmp/cpu.jsonl > tests/durations.json
"""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

FILE = Path(__file__).resolve().parent.parent / "durations.json"
UNKNOWN_S = 5.0   # a file the last run did not time (new, or renamed)


def load(path: Path = FILE) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def file_seconds(cpu_log: str) -> dict[str, float]:
    """Wall seconds per test file from a BT_CPU_LOG file (tests/conftest.py), longest first."""
    total: collections.Counter = collections.Counter()
    for line in Path(cpu_log).read_text().splitlines():
        rec = json.loads(line)
        if "test" not in rec:   # a worker's node-template counts (conftest.py)
            continue
        total[rec["test"].split("::")[0]] += float(rec["wall_s"])
    return {f: round(s, 1) for f, s in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))}


if __name__ == "__main__":
    print(json.dumps(file_seconds(sys.argv[1]), indent=1))
