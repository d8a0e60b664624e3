"""Detail: top aten ops by self CPU time / count in one paper round and one paper hop (tiny, CPU),
and full-size (h200 preset shapes) CPU cost of the host-side RNG that paper's local_loss runs per block.
Usage: OMP_NUM_THREADS=1 python /tmp/paperperf/detail.py"""
import os, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np, torch
torch.set_num_threads(1)
from torch.profiler import profile, ProfilerActivity
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import DataSplit
from blocktrain.blocks.local_run import LocalRun
from blocktrain.blocks.chain import HopRequest, hop_levels
from blocktrain.blocks.objectives.paper.schedule import NoiseSchedule

cfg = ModelConfig(d_model=32, n_heads=2, layers_per_block=2, n_blocks=4, seq_len=64, batch_size=8,
                  target_dim=64, chunk_len=16, warmup_steps=0)
data = np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8)
split = DataSplit(data, data, "test", "synthetic")
run = LocalRun(cfg.replace(objective="paper"), split, torch.device("cpu"), reference=False)
for _ in range(3): run.round()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    run.round()
print("paper round, top by self CPU time:")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

obj = run.objective; hops = obj.local_hops(run.blocks)
ctx = torch.randint(0, 256, (1, cfg.seq_len)); z = obj._start_state(1, cfg.seq_len, None, "cpu")
req = HopRequest(z, ctx, *hop_levels(obj.sigmas, 1, z), want_logits=True)
hops[1](req)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    hops[1](req)
c = {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}
print("one paper hop (batch 1): aten calls", sum(c.values()))
print(sorted(c.items(), key=lambda kv: -kv[1])[:25])

# full-size host-side work of paper's local_loss per block (h200 preset: batch 64, seq_len 512, target_dim 64)
big = ModelConfig(d_model=512, n_heads=8, layers_per_block=2, n_blocks=4, seq_len=512, batch_size=64, target_dim=64)
g = torch.Generator().manual_seed(0)
sch = NoiseSchedule(big)
def t(f, n=20):
    f(); t0 = time.perf_counter(); c0 = time.process_time()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e3, (time.process_time() - c0) / n * 1e3
w, cp = t(lambda: torch.randn((64, 512, 64), generator=g, device="cpu"))
print(f"\nFULL SIZE randn(64,512,64) on CPU with CPU generator (objective.py:426): {w:.2f} ms wall, {cp:.2f} ms CPU per block-step"
      f" -> x4 blocks = {4*w:.1f} ms per round")
w, cp = t(lambda: torch.randn((64, 512, 64), device="cpu"))
print(f"  (same, default generator: {w:.2f} ms)")
w, cp = t(lambda: sch.sample(1, 64, g))
print(f"schedule.sample(b, 64) float64 ndtri on CPU (objective.py:424): {w:.3f} ms")
x = torch.randn(64, 512, 64)
w, cp = t(lambda: x.clone())
print(f"memcpy of the 8.4 MB noise tensor on host (lower bound of staging for pageable H2D): {w:.2f} ms")
# scoring: per window start state
w, cp = t(lambda: torch.randn(1, 511, 64, generator=g), n=200)
print(f"score: _start_state randn(1,511,64) per sample: {w*1e3:.0f} us; x4 samples x1024 windows = {w*4*1024/1e3:.2f} s")
