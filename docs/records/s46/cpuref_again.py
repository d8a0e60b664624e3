#!/usr/bin/env python3
"""How much does the VM move a reference? Train a recorded run's CPU-budget one-block reference again, here, exactly
as the bench did (bench/pipeline.py `_references`: same config, data, seed, lr, schedule, CPU budget, curve marks),
and compare it with the recorded one window by window. The wall-time references of session 46 were trained on a
different VM than their chains; this says what such a move costs at this budget.
Usage: OMP_NUM_THREADS=1 python docs/records/s46/cpuref_again.py docs/records/run31.jsonl OUT.json"""
import json
import sys
from dataclasses import fields

from blocktrain.bench.pipeline import PipelineBenchSettings
from blocktrain.bench.pipeline_refs import train_reference
from blocktrain.blocks.stats import paired_bootstrap
from blocktrain.blocks.data import resolve_data
from blocktrain.blocks.windows import eval_windows


def main(src: str, out: str) -> None:
    rec = json.loads(open(src).read().strip().splitlines()[-1])
    names = {f.name for f in fields(PipelineBenchSettings)}
    s = PipelineBenchSettings(**{k: v for k, v in rec["settings"].items() if k in names})
    cfg = s.base_config()
    split = resolve_data(rec["data"], seq_len=cfg.seq_len)
    assert split.protocol == rec["protocol"]
    windows = eval_windows(split.eval, cfg.seq_len, s.eval_windows)
    n_train = rec.get("train_windows", s.train_windows)
    train_w = eval_windows(split.train, cfg.seq_len, n_train) if n_train else None
    run = rec["runs"]["pipeline"]
    spread = run["cpu_s_per_worker"]
    marks = [p["cpu_s"] for p in run["curve"] if "ce" in p]
    old = rec["references"]["one_block_cpu"]
    one = train_reference({**cfg.to_dict(), "lr": s.lrs.get("one_block", cfg.lr)}, rec["data"], cfg.layers_per_block,
                          windows, cpu_seconds=spread["mean"], marks=marks, curve_w=windows[:s.curve_windows],
                          device=s.device, seed=s.seed, train_w=train_w, schedule=s.lr_schedule)
    at = one["at_cpu"]
    d = paired_bootstrap(at["per_window"], old["per_window"]).to_dict()
    res = {"source": src, "cpu_budget_s": spread["mean"],
           "recorded": {"ce": old["ce"], "ce_train": old.get("ce_train"), "steps": old["steps"], "cpu_s": old["cpu_s"]},
           "again": {k: at[k] for k in ("ce", "ce_train", "steps", "cpu_s", "wall_s") if k in at},
           "again_minus_recorded": d}
    json.dump(res, open(out, "w"))
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
