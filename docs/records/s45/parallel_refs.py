"""Are two one-block references at once (one thread each, 2 cores) as fast as one alone? The question
before running two `bench pipeline-wall-reference` jobs side by side on this 2-core VM: their wall-time
budget buys steps, so each must get what one alone gets. Runs run 31's one-block reference config
(FULL_CONFIG, lr 4e-3, cosine) for SECONDS of wall time: alone, then two at once (seeds 0 and 1), and
prints each process's steps per wall second and the ratio to the one alone.
Usage: OMP_NUM_THREADS=1 python parallel_refs.py [SECONDS] [DATA]"""
import sys
import threading

import torch

from blocktrain.bench.pipeline import FULL_CONFIG
from blocktrain.bench.pipeline_refs import train_reference
from blocktrain.blocks.config import ModelConfig
from blocktrain.node.swarm.run import typed_settings

def one(cfg, data: str, secs: float, seed: int, out: dict) -> None:
    w = torch.zeros(2, cfg.seq_len + 1, dtype=torch.long)
    r = train_reference(cfg.to_dict(), data, cfg.layers_per_block, w, seconds=secs, seed=seed, schedule="cosine")
    out[seed] = r["steps"] / r["train_wall_s"], r["train_cpu_s"] / r["train_wall_s"]


def main() -> None:
    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 90.0
    data = sys.argv[2] if len(sys.argv) > 2 else "/work/shared/data/gutenberg"
    cfg = ModelConfig.from_dict(typed_settings([*FULL_CONFIG, "lr=0.004"]), source="parallel_refs")
    alone: dict = {}
    one(cfg, data, secs, 0, alone)
    both: dict = {}
    ts = [threading.Thread(target=one, args=(cfg, data, secs, s, both)) for s in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    a = alone[0][0]
    print(f"alone: {a:.2f} steps/s (CPU/wall {alone[0][1]:.2f})")
    for s, (r, c) in sorted(both.items()):
        print(f"two at once, seed {s}: {r:.2f} steps/s (CPU/wall {c:.2f}), {r / a:.3f}x alone")


if __name__ == "__main__":   # the references are spawned processes: they import this file
    main()
