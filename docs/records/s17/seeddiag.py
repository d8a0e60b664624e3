"""Scratch: is seed 2's bad chain its init or the network? In-process pipeline chain, the network's
init (init_blocks: seed init_seed + b), one batch of 32 windows per step (= 4 flushed micro-batches of 8),
lr 4e-3, warm-up 20, cosine to 1/10 over STEPS; data order from WindowSampler(seed=DATA, worker_id=0)."""
import json, sys, time
from pathlib import Path
import torch
from blocktrain.bench.pipeline import FULL_CONFIG
from blocktrain.bench.swarm import init_blocks
from blocktrain.node.swarm.run import typed_settings
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.default_data import resolve_default
from blocktrain.blocks.windows import eval_windows, WindowSampler
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.chain_train import chain_step
from blocktrain.blocks.train import make_optimizer, LrSchedule
from blocktrain.blocks.evaluate import per_window_chain_ce

init_seed, data_seed, steps = map(int, sys.argv[1:4])
out = sys.argv[4]
torch.set_num_threads(1)
cfg = ModelConfig.from_dict(typed_settings([*FULL_CONFIG, "objective=pipeline", f"init_seed={init_seed}", "lr=0.004"]),
                            source="diag")
split, used = resolve_default("/work/shared/data/gutenberg", cfg.seq_len, Path("/tmp/diagcache"))
windows = eval_windows(split.eval, cfg.seq_len, 1024)
obj = get_objective(cfg)
blocks = init_blocks(cfg)
opts = [make_optimizer(m, cfg) for m in blocks]
sched = LrSchedule(0.004, 20, "cosine", total_steps=steps)
sampler = WindowSampler(split.train, cfg.seq_len, seed=data_seed, worker_id=0)
g = torch.Generator

def score(w):
    for m in blocks: m.eval()
    with torch.no_grad():
        return obj.score(obj.local_hops(blocks), w, k=2, generator=g().manual_seed(0)).ce

curve, t0 = [], time.time()
for step in range(steps):
    w = sampler.next_batch(32)
    st = chain_step(obj, blocks, opts, cfg, step, w, lr=sched.at(step))
    if (step + 1) % 300 == 0:
        curve.append({"step": step + 1, "ce256": score(windows[:256]), "loss": st[-1]["loss"], "s": time.time() - t0})
        print(init_seed, data_seed, curve[-1], flush=True)
ce = score(windows)
pw = per_window_chain_ce(obj, blocks, windows, k=2)[0]
json.dump({"init_seed": init_seed, "data_seed": data_seed, "steps": steps, "ce": ce, "curve": curve,
           "per_window": [float(x) for x in pw], "s": time.time() - t0}, open(out, "w"))
print("DONE", init_seed, data_seed, ce, flush=True)
