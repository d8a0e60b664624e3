"""Fixtures shared by test files."""
from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Longest files first (``test_utils/durations.py``: xdist hands whole files to its workers in
    this order, with ``--no-loadscope-reorder`` in pyproject's addopts). ``full_matrix`` cases repeat
    a path another case already takes (another signal or target of the same stop): skipped unless
    BT_FULL_MATRIX=1, to keep the default run (CI) fast."""
    from test_utils.durations import UNKNOWN_S, load
    seconds = load()
    items.sort(key=lambda it: -seconds.get(it.nodeid.split("::")[0], UNKNOWN_S))   # stable: in-file order kept
    if os.environ.get("BT_FULL_MATRIX") == "1":
        return
    skip = pytest.mark.skip(reason="full matrix only: set BT_FULL_MATRIX=1")
    for item in items:
        if item.get_closest_marker("full_matrix"):
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Tiny tensors: a second OpenMP thread only spins, and on a loaded 2-core machine that made the
    objective test files up to 40x slower. Restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def node_template():
    """The node processes this worker starts through ``ManagedProcess`` are forked from a template
    process (one per import-time environment) that has imported torch and the node once
    (``test_utils/zygote.py``; ``BT_TEST_ZYGOTE=0``: started as usual). Started at the first such node,
    stopped after the last test."""
    import subprocess

    from blocktrain.node.swarm.launcher import ManagedProcess
    from test_utils import zygote
    ManagedProcess.popen = staticmethod(zygote.popen)
    yield
    ManagedProcess.popen = staticmethod(subprocess.Popen)
    zygote.close()
    if os.environ.get("BT_CPU_LOG"):   # how many node starts the templates took, and why the others did not
        import json
        with open(os.environ["BT_CPU_LOG"], "a") as f:
            f.write(json.dumps({"node_template": zygote.counts, "fallbacks": zygote.fallbacks,
                                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}) + "\n")


# BT_CPU_LOG=FILE: one JSON line per test phase with the CPU seconds it used, its own and its reaped
# child processes' (node processes, CLI runs). Wall time on a shared 2-core machine says little about
# what a test costs a quiet CI machine; CPU time does (used to keep the suite fast).
if os.environ.get("BT_CPU_LOG"):
    import json
    import resource
    import time

    def _cpu() -> float:   # the node template's children are its children, not this process's
        from test_utils.zygote import children_cpu
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + children_cpu()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        cpu0, t0, start = _cpu(), time.monotonic(), time.time()
        yield
        with open(os.environ["BT_CPU_LOG"], "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu() - cpu0, 2),
                                "wall_s": round(time.monotonic() - t0, 2), "start": round(start, 2),
                                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}) + "\n")
