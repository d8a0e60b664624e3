"""Count, per training round, the aten kernels whose output is a full activation (>= batch*seq_len*d_model
elements): on a GPU each is a memory-bandwidth-bound pass over an (N,T,d) tensor. Tiny config on CPU.
Usage: OMP_NUM_THREADS=1 python /tmp/paperperf/passes.py"""
import os, collections
os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np, torch
torch.set_num_threads(1)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import DataSplit
from blocktrain.blocks.local_run import LocalRun

cfg = ModelConfig(d_model=32, n_heads=2, layers_per_block=2, n_blocks=4, seq_len=64, batch_size=8,
                  target_dim=64, chunk_len=16, warmup_steps=0)
data = np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8)
split = DataSplit(data, data, "test", "synthetic")
FULL = cfg.batch_size * cfg.seq_len * cfg.d_model
MATMUL = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_flash_attention_for_cpu_backward"}

class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.c = collections.Counter(); self.total = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.total += 1
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        name = func.overloadpacket.__name__
        if any(o.numel() >= FULL for o in outs) and name not in MATMUL and not func.is_view and name not in ("detach", "view", "_unsafe_view", "t", "transpose", "expand"):
            self.c[name] += 1
        return out

for arm in ["whole", "forward-streamed", "paper"]:
    run = (LocalRun(cfg, split, torch.device("cpu"), chain=False, reference=True) if arm == "whole"
           else LocalRun(cfg.replace(objective=arm), split, torch.device("cpu"), reference=False))
    for _ in range(2): run.round()
    m = Count()
    with m:
        run.round()
    n = sum(m.c.values())
    layers = cfg.n_blocks * cfg.layers_per_block
    print(f"{arm}: {m.total} dispatched aten kernels/round; {n} non-matmul kernels writing a full (N,T,>=d) tensor "
          f"= {n/layers:.1f} per layer")
    print("   ", ", ".join(f"{k}x{v}" for k, v in m.c.most_common(14)))
