"""Scratch (session 24): does a depth-aware init narrow the chain's init spread (issue 13, target 2)?
Session 17's seeddiag.py (docs/records/s17/) with one change under MODE=scaled: each layer's two
residual-branch output projections (attn.proj, mlp.out) start at std 0.02 / sqrt(2 L), L the chain's
layers (GPT-2's rule), instead of 0.02. MODE=base is seeddiag.py's init. Usage:
    python initdiag.py MODE INIT DATA STEPS OUT
In-process pipeline chain, one batch of 32 windows per step, lr 4e-3, warm-up 20, cosine to 1/10."""
import json, math, sys, time
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

mode = sys.argv[1]
init_seed, data_seed, steps = map(int, sys.argv[2:5])
out = sys.argv[5]
assert mode in ("base", "scaled"), mode
torch.set_num_threads(1)
cfg = ModelConfig.from_dict(typed_settings([*FULL_CONFIG, "objective=pipeline", f"init_seed={init_seed}", "lr=0.004"]),
                            source="diag")
split, used = resolve_default("/work/shared/data/gutenberg", cfg.seq_len, Path("/tmp/diagcache"))
windows = eval_windows(split.eval, cfg.seq_len, 1024)
obj = get_objective(cfg)
blocks = init_blocks(cfg)
n_layers = cfg.n_blocks * cfg.layers_per_block
if mode == "scaled":
    with torch.no_grad():
        for m in blocks:
            for name, p in m.named_parameters():
                if name.endswith(("attn.proj.weight", "mlp.out.weight")):
                    p.mul_(1.0 / math.sqrt(2 * n_layers))
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
        print(mode, init_seed, data_seed, curve[-1], flush=True)
ce = score(windows)
pw = per_window_chain_ce(obj, blocks, windows, k=2)[0]
json.dump({"mode": mode, "init_seed": init_seed, "data_seed": data_seed, "steps": steps, "ce": ce, "curve": curve,
           "per_window": [float(x) for x in pw], "s": time.time() - t0}, open(out, "w"))
print("DONE", mode, init_seed, data_seed, ce, flush=True)
