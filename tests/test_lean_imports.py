"""Imports a node does not need are deferred (issue 15, lean nodes: p2p/lean_imports.py, cli/main.py,
node/memory.py for torch's), and deferring them changes no behaviour. Fresh interpreters (the test process has imported
everything already): one that imports what a node imports (~9 s unloaded), and two that import
``blocktrain.p2p`` only."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

PROBE = r"""
import json, sys
import blocktrain.cli.main                      # what `bt-node seed` imports before the node starts
import blocktrain.p2p.averager, hivemind       # the node's averager: hivemind imports load_balancing
from hivemind.averaging.load_balancing import load_balance_peers
out = {"bench_at_start": sorted(m for m in sys.modules if m.startswith("blocktrain.bench")),
       "linprog_at_start": "scipy.optimize._linprog" in sys.modules,
       "scipy_at_start": sorted(m for m in sys.modules if m.startswith("scipy") and
                                type(sys.modules[m]).__name__ != "_Deferred"),
       "hivemind_init_at_start": sorted(m for m in sys.modules if m.startswith(("hivemind.moe", "hivemind.optim")))}
out["even"] = load_balance_peers(100, [None, None, 0.0])   # what blocktrain's averagers gather
out["linprog_after_even"] = "scipy.optimize._linprog" in sys.modules
out["weighted"] = load_balance_peers(100, [1.0, 2.0, None])   # a peer stating a bandwidth: scipy runs
out["linprog_after_weighted"] = "scipy.optimize._linprog" in sys.modules
import scipy.optimize
out["real_module"] = sys.modules["scipy.optimize"] is scipy.optimize and hasattr(scipy.optimize, "linprog")
out["real_scipy"] = type(sys.modules["scipy"]).__name__ == "module" and hasattr(sys.modules["scipy"], "__version__")
# hivemind's package names: the first read runs its real __init__ in the same module object
out["hivemind_version"] = hivemind.__version__
out["hivemind_names"] = hivemind.DHT is __import__("hivemind.dht", fromlist=["DHT"]).DHT and hasattr(hivemind, "Server")
out["hivemind_init_after"] = "hivemind.moe" in sys.modules and "hivemind.optim" in sys.modules
out["hivemind_same_module"] = sys.modules["hivemind"] is hivemind
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
    assert not out["linprog_at_start"] and out["scipy_at_start"] == []
    assert out["hivemind_init_at_start"] == []   # the node's imports never run hivemind's package __init__
    assert out["even"] == [50, 50, 0] and not out["linprog_after_even"]
    # the LP itself, run by the real scipy once a bandwidth is stated: the faster peers get more
    assert sum(out["weighted"]) == 100 and out["weighted"][1] > out["weighted"][2] > out["weighted"][0]
    assert out["linprog_after_weighted"] and out["real_module"] and out["real_scipy"]
    assert out["hivemind_version"] == "1.1.12" and out["hivemind_names"]
    assert out["hivemind_init_after"] and out["hivemind_same_module"]


def test_eager_imports_when_asked(monkeypatch):
    """BT_EAGER_IMPORTS (the bench's older layouts) keeps the imports eager."""
    code = ("import sys, blocktrain.p2p; n = lambda m: type(m).__name__ if m is not None else 'absent'; "
            "print(n(sys.modules.get('scipy.optimize')), n(sys.modules.get('scipy')), end=' '); "
            "import hivemind.utils.timed_storage; print('init' if 'hivemind.moe' in sys.modules else 'no-init')")
    for eager, expected in (("", "_Deferred _Deferred no-init"),
                            ("scipy", "absent absent no-init"),   # absent: hivemind imports it itself
                            ("scipy-base", "_Deferred module no-init"),
                            ("hivemind", "_Deferred _Deferred init")):
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


RELEASE_PROBE = r"""
import json, sys, torch
from blocktrain.node.memory import release_startup_pages
def rss_file():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssFile:"))
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
x = torch.randn(4, 32)
def step():
    m.zero_grad()
    y = m(x)
    y.square().mean().backward()
    return y.detach().clone(), m[0].weight.grad.clone()
y0, g0 = step()
before = rss_file()
released = release_startup_pages()
after = rss_file()
y1, g1 = step()   # the unmapped code pages fault back in: same results
print(json.dumps({"before": before, "after": after, "released": released,
                  "same": bool(torch.equal(y0, y1) and torch.equal(g0, g1))}))
"""


def _release_probe(flag: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "BT_RELEASE_PAGES"}
    env["OMP_NUM_THREADS"] = "1"
    if flag is not None:
        env["BT_RELEASE_PAGES"] = flag
    r = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_released_library_pages_leave_rss_and_fault_back_in_with_the_same_results():
    out = _release_probe(None)
    assert out["same"], out
    # importing torch maps tens of MB of libtorch's code; unmapped, they leave the process's RSS
    assert out["released"] > 20e6 and out["after"] < out["before"] - 20e6, out
    kept = _release_probe("0")   # the switch the bench's older layouts use
    assert kept["same"] and kept["released"] == 0 and kept["after"] >= kept["before"] - 2e6, kept


def test_only_never_written_read_only_library_mappings_are_released():
    from blocktrain.node.memory import _code_mappings

    def mapping(addr, perms, path, rss=8, anon=0, dirty=0, flags="rd ex mr mw me"):
        return (f"{addr:x}-{addr + 0x1000:x} {perms} 00000000 fe:00 1 {path}\n"
                f"Rss: {rss} kB\nShared_Dirty: 0 kB\nPrivate_Dirty: {dirty} kB\nAnonymous: {anon} kB\n"
                f"VmFlags: {flags}\n")
    smaps = "".join([
        mapping(0x1000, "r-xp", "/usr/lib/libtorch_cpu.so"),             # code: released
        mapping(0x3000, "r--p", "/usr/lib/libc.so.6"),                   # read-only data: released
        mapping(0x5000, "r--p", "/usr/lib/libc.so.6", anon=4, dirty=4),  # relocated (RELRO): written, kept
        mapping(0x7000, "rw-p", "/usr/lib/libc.so.6"),                   # writable: kept
        mapping(0x9000, "r-xp", "/usr/lib/libx.so", flags="rd ex lo"),   # mlock()ed: kept
        mapping(0xb000, "r--p", "/data/corpus.bin"),                     # not a library: kept
        mapping(0xd000, "r-xp", "/usr/bin/python3.11"),                  # the interpreter: released
        mapping(0xf000, "r-xp", "/usr/lib/liby.so", rss=0),              # nothing resident: skipped
        mapping(0x11000, "r-xs", "/usr/lib/libz.so"),                    # shared mapping: kept
    ])
    assert _code_mappings(smaps, "/usr/bin/python3.11") == [(0x1000, 0x2000), (0x3000, 0x4000), (0xd000, 0xe000)]


MMAP_PROBE = r"""
import json, sys, torch
from blocktrain.node.memory import tune_malloc
def big_maps():   # anonymous mappings of 8-9 MiB: an 8 MiB block mapped on its own
    n = 0
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) == 5:
            a, b = (int(x, 16) for x in parts[0].split("-"))
            n += (8 << 20) <= b - a <= (8 << 20) + (1 << 20)
    return n
x = torch.empty(30 << 20, dtype=torch.uint8); x.fill_(1); del x   # a freed mapped block: glibc raises its threshold
if sys.argv[1] == "tune":
    tune_malloc()
before = big_maps()
t = torch.empty(8 << 20, dtype=torch.uint8); t.fill_(1)
during = big_maps()
del t
print(json.dumps({"before": before, "during": during, "after": big_maps()}))
"""


@pytest.mark.parametrize("how", ["tune", "BT_TUNE_MALLOC=0", "none"])
def test_a_tuned_node_maps_large_tensors_on_their_own_and_unmaps_them_when_freed(how):
    """node/memory.py pins glibc's mmap threshold at 4 MiB: an 8 MiB tensor gets a mapping of its own and
    leaves the process when freed, even after glibc raised its threshold (as torch's import makes it do);
    untuned (or BT_TUNE_MALLOC=0) it comes from the heap, whose high-water mark stays."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "BT_TUNE_MALLOC"))}
    if how.startswith("BT_TUNE_MALLOC"):
        env["BT_TUNE_MALLOC"] = "0"
    r = subprocess.run([sys.executable, "-c", MMAP_PROBE, "none" if how == "none" else "tune"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if how == "tune":
        assert out["during"] == out["before"] + 1 and out["after"] == out["before"], out
    else:
        assert out["during"] == out["before"] == out["after"], out


TORCH_PROBE = r"""
import hashlib, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from click.testing import CliRunner
from blocktrain.cli.main import cli
# what `bt-node seed`/`join` run first: the group's callback, before the subcommand parses its flags
r = CliRunner().invoke(cli, ["seed", "--no-such-flag"])
assert r.exit_code == 2 and "no-such-flag" in r.output, r.output
from blocktrain.p2p.lean_imports import is_stand_in
import torch
from blocktrain.blocks.model import Model
from blocktrain.node.pipeline.engine import PipelineEngine
from blocktrain.node.pipeline.settings import PipelineSettings
from blocktrain.node.trainer import BlockTrainer
from test_utils.configs import tiny_config
from blocktrain.node.memory import TORCH_UNUSED
NAMES = ("torch._meta_registrations", *TORCH_UNUSED)
out = {"stand_ins": [n for n in NAMES if is_stand_in(sys.modules.get(n))]}
data = np.frombuffer(b"the cat sat on the mat; the dog sat on the log. " * 60, dtype=np.uint8)
digest = hashlib.sha256()
for objective in ("paper", "pipeline"):
    cfg = tiny_config(objective=objective, n_blocks=3, dropout=0.1)
    trainers = [BlockTrainer(cfg, b, data, data, seed=b, worker_id=1) for b in range(3)]
    out[objective + "_losses"] = [[t.train_step()["loss"] for _ in range(3)] for t in trainers] if objective == "paper" else []
    if objective == "pipeline":   # a middle stage's forward and backward (activation gradients) on one micro-batch
        t = trainers[1]
        e = PipelineEngine(t, n_blocks=3, loop=None, next_stage=object(), settings=PipelineSettings(accumulate=4))
        gen = torch.Generator().manual_seed(7)
        T, D = cfg.seq_len, t.objective.state_dim()
        x, y, g = (torch.randn(2, T, D, generator=gen), torch.randint(0, 256, (2, T), generator=gen),
                   torch.randn(2, T, D, generator=gen))
        torch.manual_seed(1234)
        grad_in = e._backward(e._forward(x, None, y), g, 1.0)
        digest.update(grad_in.numpy().tobytes())
        e.close()
    for t in trainers:
        for p in t.module.parameters():
            digest.update(p.detach().numpy().tobytes())
    m = Model(cfg, trainers[0].objective, [t.module.eval() for t in trainers])
    out[objective + "_text"] = m.generate("the ", 12, temperature=0.8, seed=3)["bytes"].hex()
out["digest"] = digest.hexdigest()
out["decomp_after_training"] = [m for m in ("torch._decomp", "torch._prims", "torch._refs") if m in sys.modules]
out["stand_ins_after_training"] = [n for n in NAMES if is_stand_in(sys.modules.get(n))]
if out["stand_ins"]:   # what loads the deferred modules: meta tensors refused until a tracing stack is imported
    try:
        torch.fft.fft(torch.empty(8, device="meta"))
        out["meta_before"] = "ran"
    except NotImplementedError:
        out["meta_before"] = "refused"
    import torch._decomp
    out["metas_real"] = not is_stand_in(sys.modules["torch._meta_registrations"])
    out["decompositions"] = len(torch._decomp.decomposition_table)
    out["meta_after"] = list(torch.fft.fft(torch.empty(8, device="meta")).shape)
    out["normal"] = float(torch.distributions.Normal(0.0, 1.0).log_prob(torch.tensor(0.0)))
    out["export_real"] = callable(torch.export.export) and not is_stand_in(sys.modules["torch.export"])
    with torch.profiler.record_function("probe"):   # the others: their first read imports them
        out["others_real"] = (callable(torch.quantization.QuantStub) and callable(torch.masked.masked_tensor)
                              and not any(is_stand_in(sys.modules.get(n)) for n in NAMES))
print(json.dumps(out))
"""


def test_a_node_imports_torch_without_its_meta_kernels_and_trains_bit_for_bit_the_same():
    """node/memory.py import_torch_lean (via the node commands): the same losses, weights, activation
    gradients and generations with and without torch's meta kernels and the packages of TORCH_UNUSED;
    the first import of a tracing stack brings the kernels back, the first read of a package imports it."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    runs = {}
    for eager in ("", "torch"):
        env = {**os.environ, "BT_EAGER_IMPORTS": eager, "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, "-c", TORCH_PROBE, tests_dir], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[eager] = json.loads(r.stdout.strip().splitlines()[-1])
    lean, eager = runs[""], runs["torch"]
    assert lean["stand_ins"] == ["torch._meta_registrations", "torch.export", "torch.distributions",
                                 "torch.quantization", "torch.masked", "torch.profiler"]
    assert eager["stand_ins"] == []
    for key in ("paper_losses", "paper_text", "pipeline_text", "digest"):
        assert lean[key] == eager[key], key
    assert len(lean["paper_text"]) == 24 and len(lean["paper_losses"]) == 3
    assert lean["decomp_after_training"] == [] and lean["stand_ins_after_training"] == lean["stand_ins"]
    assert eager["decomp_after_training"] == ["torch._decomp", "torch._prims", "torch._refs"]
    assert lean["meta_before"] == "refused" and lean["metas_real"] and lean["decompositions"] > 500
    assert lean["meta_after"] == [8] and abs(lean["normal"] + 0.9189385) < 1e-6 and lean["export_real"]
    assert lean["others_real"]
