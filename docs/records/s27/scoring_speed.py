"""A chain's held-out scoring, window by window (the definition, Objective.score_per_window) against batched
(the objective's override): wall time and the largest difference, at the size of `bench quality --preset cpu`
(d_model 64, 4 blocks x 1 layer, seq_len 128), k = 4, one thread, untrained blocks.
Usage: OMP_NUM_THREADS=1 python docs/records/s27/scoring_speed.py [N_WINDOWS [OBJECTIVE]]"""
import sys
import time

import torch

from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import resolve_data
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.objectives.base import Objective
from blocktrain.blocks.windows import eval_windows

torch.set_num_threads(1)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
objective = sys.argv[2] if len(sys.argv) > 2 else "paper"
cfg = ModelConfig(d_model=64, n_heads=2, layers_per_block=1, n_blocks=4, seq_len=128, batch_size=16, chunk_len=4,
                  objective=objective)
obj = get_objective(cfg)
torch.manual_seed(0)
blocks = [obj.build_block(b).eval() for b in range(cfg.n_blocks)]
hops = obj.local_hops(blocks)
windows = eval_windows(resolve_data("tests/data/lord-arthur-savile", None, seq_len=cfg.seq_len).eval, cfg.seq_len, n)
t0 = time.perf_counter()
loop, _ = Objective.score_per_window(obj, hops, windows, k=4, seed=0)
t1 = time.perf_counter()
batched, _ = obj.score_per_window(hops, windows, k=4, seed=0)
t2 = time.perf_counter()
diff = max(abs(a - b) for a, b in zip(loop, batched))
print(f"{objective}: {n} windows, k=4: window by window {t1 - t0:.2f} s, batched {t2 - t1:.2f} s "
      f"({(t1 - t0) / (t2 - t1):.1f}x); largest per-window difference {diff:.2e} nats/byte")
