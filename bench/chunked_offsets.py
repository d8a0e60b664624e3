"""Where ``pipeline-chunked`` loses to ``pipeline``: held-out CE by a byte's offset in its chunk.

    python -m blocktrain.bench.chunked_offsets --data ../shared/data/gutenberg [--steps 107,255 ...]

Trains the ``pipeline-chunked`` chain and the ``pipeline`` chain in one process with
``chain_train.chain_step`` (the reference step of the pipeline engine; lr warm-up then cosine to
each run's own steps, as ``bench quality`` v2 does), seed 0, on the same sampler, then scores the
same fixed held-out windows and reports nats/byte per offset i - c*k of the target in its chunk
(offset 0: the chunk's first byte, which sees what the AR model sees). For ``pipeline`` the same
positions are grouped the same way (it has no chunks: its rows show what position alone does).
Prints one JSON object. Not wall-time dependent (FLOPs are not matched here: give the steps).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from blocktrain.blocks.chain_train import chain_step
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import resolve_data
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.optim import AdamW
from blocktrain.blocks.train import LrSchedule
from blocktrain.blocks.windows import WindowSampler, eval_windows


def train_and_score(cfg: ModelConfig, split, steps: int, lr: float, eval_w: torch.Tensor, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    obj = get_objective(cfg.replace(init_seed=seed))
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]
    opts = [AdamW(m.parameters(), lr=lr, weight_decay=cfg.weight_decay) for m in blocks]
    sched = LrSchedule(lr, cfg.warmup_steps, "cosine", steps)
    sampler = WindowSampler(split.train, cfg.seq_len, seed=seed)
    t0 = time.process_time()
    for step in range(steps):
        chain_step(obj, blocks, opts, cfg, step, sampler.next_batch(cfg.batch_size), lr=sched.at(step))
    cpu_s = time.process_time() - t0
    hops = obj.local_hops(blocks)
    with torch.no_grad():
        nll = torch.cat([F.cross_entropy(obj._last_logits(hops, w[:, :-1]).transpose(1, 2), w[:, 1:], reduction="none")
                         for w in eval_w.split(64)])
    offset = torch.arange(cfg.seq_len) % cfg.chunk_len
    return {"objective": obj.name, "steps": steps, "lr": lr, "train_cpu_s": round(cpu_s, 1),
            "heldout_ce": round(float(nll.mean()), 4),
            "ce_by_offset": [round(float(nll[:, offset == i].mean()), 4) for i in range(cfg.chunk_len)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--runs", default="pipeline-chunked:107,pipeline-chunked:255,pipeline:255",
                    help="objective:steps, comma-separated")
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--eval-windows", type=int, default=1024)
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config override KEY=INT (default: the protocol-v2 CPU size of BENCHMARKS.md)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = dict(d_model=32, n_heads=2, layers_per_block=1, n_blocks=4, seq_len=64, batch_size=16, chunk_len=4,
                warmup_steps=10)
    base.update({k: int(v) for k, v in (s.split("=", 1) for s in a.sets)})
    cfg = ModelConfig(**base)
    split = resolve_data(a.data, seq_len=cfg.seq_len)
    eval_w = eval_windows(split.eval, cfg.seq_len, a.eval_windows)
    out = []
    for item in a.runs.split(","):
        name, steps = item.split(":")
        out.append(train_and_score(cfg.replace(objective=name), split, int(steps), a.lr, eval_w))
    print(json.dumps({"config": base, "protocol": split.protocol, "eval_windows": a.eval_windows, "runs": out}))


if __name__ == "__main__":
    main()
