"""Per-round op counts, host-sync/transfer inventory and CPU time of one LocalRun round:
paper vs whole vs forward-streamed, tiny config on CPU (1 thread). Also per-window scoring.
Usage: OMP_NUM_THREADS=1 python /tmp/paperperf/round_profile.py [--rounds N]"""
import os, sys, time, collections, inspect, argparse
os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np, torch
torch.set_num_threads(1)
from torch.overrides import TorchFunctionMode
from torch.profiler import profile, ProfilerActivity
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import DataSplit
from blocktrain.blocks.local_run import LocalRun
from blocktrain.blocks.evaluate import per_window_chain_ce, per_window_reference_ce

ap = argparse.ArgumentParser(); ap.add_argument("--rounds", type=int, default=20)
ap.add_argument("--score-windows", type=int, default=16)
args = ap.parse_args()

cfg = ModelConfig(d_model=32, n_heads=2, layers_per_block=2, n_blocks=4, seq_len=64, batch_size=8,
                  target_dim=64, chunk_len=16, warmup_steps=0)
rng = np.random.default_rng(0)
data = rng.integers(0, 256, 200_000, dtype=np.uint8)
split = DataSplit(data, data, "test", "synthetic")
dev = torch.device("cpu")

SYNC = {"item", "__float__", "__bool__", "__int__", "tolist", "cpu", "numpy"}
FACT = {"randn", "rand", "randint", "zeros", "ones", "arange", "tensor", "as_tensor", "linspace", "empty", "full",
        "from_numpy"}

def site():
    for fr in inspect.stack()[2:]:
        f = fr.filename
        if "/work/main/" in f or "site-packages/blocktrain" in f:
            return f.split("/main/")[-1].split("blocktrain/")[-1] + f":{fr.lineno}"
    return "?"

class Inventory(TorchFunctionMode):
    def __init__(self):
        super().__init__(); self.c = collections.Counter()
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in SYNC:
            self.c[(f"sync:{name}", site())] += 1
        elif name == "to" and (any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs):
            self.c[("to(device)", site())] += 1
        elif name in FACT and "device" not in kwargs:
            self.c[(f"cpu-factory:{name}", site())] += 1
        return func(*args, **kwargs)

def build(arm):
    if arm == "whole":
        return LocalRun(cfg, split, dev, chain=False, reference=True), "reference"
    return LocalRun(cfg.replace(objective=arm), split, dev, reference=False), "chain"

arms = ["whole", "forward-streamed", "paper"]
for arm in arms:
    run, name = build(arm)
    for _ in range(3):
        run.round()
    # timing
    n = args.rounds
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        run.round()
    wall, cpu = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
    # op counts
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run.round()
    ka = prof.key_averages()
    aten = {e.key: e.count for e in ka if e.key.startswith("aten::")}
    top = sorted(aten.items(), key=lambda kv: -kv[1])[:8]
    # inventory
    inv = Inventory()
    with inv:
        run.round()
    print(f"\n=== {arm}: {wall*1e3:.2f} ms wall, {cpu*1e3:.2f} ms CPU per round (mean of {n}); "
          f"round FLOPs {run.round_flops():.3g}; optimizers {sum(1 for _ in run.trainees)}")
    print(f"  aten calls per round: {sum(aten.values())} (distinct {len(aten)}); "
          f"aten::_local_scalar_dense {aten.get('aten::_local_scalar_dense',0)}, aten::item {aten.get('aten::item',0)}, "
          f"aten::to {aten.get('aten::to',0)}, aten::copy_ {aten.get('aten::copy_',0)}, aten::normal_ {aten.get('aten::normal_',0)}")
    print("  top aten:", ", ".join(f"{k[6:]}x{v}" for k, v in top))
    print("  host-sync / transfer / CPU-factory call sites in one round:")
    for (kind, where), k in sorted(inv.c.items()):
        print(f"    {k:3d}  {kind:24s} {where}")

    # scoring: per-window chain CE (as bench quality per_window=True) with k=4
    W = args.score_windows
    from blocktrain.blocks.windows import eval_windows
    win = eval_windows(split.eval, cfg.seq_len, W)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if name == "chain":
            per_window_chain_ce(run.objective, run.blocks, win, k=4)
        else:
            per_window_reference_ce(run.ref, win)
    dt = time.perf_counter() - t0
    ka = {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}
    inv = Inventory()
    with inv:
        if name == "chain":
            per_window_chain_ce(run.objective, run.blocks, win[:1], k=4)
    print(f"  scoring {W} windows (k=4): {dt*1e3:.1f} ms (profiled), aten calls {sum(ka.values())} "
          f"= {sum(ka.values())/W:.0f}/window; addmm/linear/mm: {ka.get('aten::linear',0)} linear; "
          f"_local_scalar_dense {ka.get('aten::_local_scalar_dense',0)}")
    if inv.c:
        print("  host-sync / transfer / CPU-factory sites scoring ONE window:")
        for (kind, where), k in sorted(inv.c.items()):
            print(f"    {k:3d}  {kind:24s} {where}")
