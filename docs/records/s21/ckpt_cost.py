"""CPU seconds per micro-batch of a pipeline block's engine paths, interleaved in one process (one torch
thread): the kept graph, --pipeline-recompute, --pipeline-layer-checkpoint, and both. A middle block of
the d_model-768 shape of BENCHMARKS "Memory of a pipeline block" (3 layers, batch 16 x 256), random input
and output gradient; each path's forward as the engine runs it, then its backward. Usage:
OMP_NUM_THREADS=1 PYTHONPATH=<code> python ckpt_cost.py [reps]"""
import statistics
import sys
import time

import torch

from blocktrain.blocks.chain_train import stage_backward
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.layers import layer_checkpointing
from blocktrain.blocks.objectives import get_objective

torch.set_num_threads(1)
cfg = ModelConfig(objective="pipeline", d_model=768, n_heads=12, layers_per_block=3, n_blocks=4, seq_len=256,
                  batch_size=16, target_dim=16)
obj = get_objective(cfg)
m = obj.build_block(1).train()
g = torch.Generator().manual_seed(0)
x0 = torch.randn(16, 256, 768, generator=g)
dh = torch.randn(16, 256, 768, generator=g)


def step(recompute: bool, ckpt: bool) -> None:
    with layer_checkpointing(ckpt):
        x = x0.clone().requires_grad_(not recompute)
        if recompute:
            with torch.no_grad():
                obj.stage_forward(m, 1, x, None)          # the forward whose output goes to the wire
            x.requires_grad_(True)
        h = obj.stage_forward(m, 1, x, None)              # kept graph / the recompute before the backward
        stage_backward(h, dh)
    m.zero_grad(set_to_none=True)


paths = {"kept graph": (False, False), "recompute": (True, False), "layer checkpoint": (False, True),
         "recompute + layer checkpoint": (True, True)}
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for p in paths.values():
    step(*p)                                              # warm-up
cpu = {k: [] for k in paths}
for r in range(reps):
    for k, p in (paths.items() if r % 2 == 0 else reversed(paths.items())):
        c0 = time.process_time()
        step(*p)
        cpu[k].append(time.process_time() - c0)
base = statistics.median(cpu["kept graph"])
for k, v in cpu.items():
    med = statistics.median(v)
    print(f"{k:30s} median {med:.2f} CPU-s per micro-batch ({', '.join(f'{t:.2f}' for t in v)}); "
          f"x{med / base:.2f} the kept graph, x{med / statistics.median(cpu['recompute']):.2f} recompute")
