"""Imports a node does not need are deferred (issue 15, lean nodes: p2p/lean_imports.py, cli/main.py),
and deferring them changes no behaviour. Fresh interpreters (the test process has imported
everything already): one that imports what a node imports (~9 s unloaded), and two that import
``blocktrain.p2p`` only."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

PROBE = r"""
import json, sys
import blocktrain.cli.main                      # what `bt-node seed` imports before the node starts
import blocktrain.p2p.averager, hivemind       # the node's averager: hivemind imports load_balancing
from hivemind.averaging.load_balancing import load_balance_peers
out = {"bench_at_start": sorted(m for m in sys.modules if m.startswith("blocktrain.bench")),
       "linprog_at_start": "scipy.optimize._linprog" in sys.modules}
out["even"] = load_balance_peers(100, [None, None, 0.0])   # what blocktrain's averagers gather
out["linprog_after_even"] = "scipy.optimize._linprog" in sys.modules
out["weighted"] = load_balance_peers(100, [1.0, 2.0, None])   # a peer stating a bandwidth: scipy runs
out["linprog_after_weighted"] = "scipy.optimize._linprog" in sys.modules
import scipy.optimize
out["real_module"] = sys.modules["scipy.optimize"] is scipy.optimize and hasattr(scipy.optimize, "linprog")
print(json.dumps(out))
"""


def _probe() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "BT_EAGER_IMPORTS"}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_node_imports_defer_scipy_and_bench_without_changing_load_balancing():
    out = _probe()
    assert out["bench_at_start"] == []
    assert not out["linprog_at_start"]
    assert out["even"] == [50, 50, 0] and not out["linprog_after_even"]
    # the LP itself, run by the real scipy once a bandwidth is stated: the faster peers get more
    assert sum(out["weighted"]) == 100 and out["weighted"][1] > out["weighted"][2] > out["weighted"][0]
    assert out["linprog_after_weighted"] and out["real_module"]


def test_eager_imports_when_asked(monkeypatch):
    """BT_EAGER_IMPORTS (the bench's older layouts) keeps both imports eager."""
    code = ("import sys, blocktrain.p2p; m = sys.modules.get('scipy.optimize'); "
            "print(type(m).__name__ if m is not None else 'absent')")
    for eager, expected in (("", "_Deferred"), ("scipy", "absent")):   # absent: hivemind imports it itself
        env = {**os.environ, "BT_EAGER_IMPORTS": eager}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0 and r.stdout.strip() == expected, (eager, r.stdout, r.stderr[-2000:])
    from blocktrain.cli.main import LazyGroup

    lazy = {"node-memory": ".bench_resource_cmds:bench_node_memory_cmd"}
    monkeypatch.delenv("BT_EAGER_IMPORTS", raising=False)
    assert "node-memory" not in LazyGroup(lazy=lazy).commands
    monkeypatch.setenv("BT_EAGER_IMPORTS", "scipy,cli")
    assert "node-memory" in LazyGroup(lazy=lazy).commands


def test_lazy_cli_lists_and_runs_every_command():
    from blocktrain.cli.main import cli

    runner = CliRunner()
    top = runner.invoke(cli, ["--help"])
    assert top.exit_code == 0
    for name in ("seed", "join", "generate", "status", "export", "swarm", "train-local", "eval", "bench"):
        assert f"  {name} " in top.output
    bench = runner.invoke(cli, ["bench", "--help"])
    assert bench.exit_code == 0
    for name in ("quality", "memory", "throughput", "node-memory", "swarm", "inference", "compression", "p2p",
                 "simulate", "pipeline"):
        assert f"  {name} " in bench.output
    sub = runner.invoke(cli, ["bench", "node-memory", "--help"])
    assert sub.exit_code == 0 and "--layout" in sub.output
    bad = runner.invoke(cli, ["bench", "no-such-bench"])
    assert bad.exit_code == 2 and "No such command" in bad.output
