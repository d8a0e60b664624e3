#!/usr/bin/env python3
"""Issue 13 target 2 at a glance: every protocol-v2 networked run with a record (runs 22-33), one row each, from
the records themselves (the last line of each file; a `-wall` record, where one exists, adds the wall-time
reference trained afterwards). Usage: python docs/records/s46/target2_table.py [docs/records]"""
import json
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")


def last(p):
    with open(p) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def diff(ref):
    if not ref or "chain_minus" not in ref:
        return "not measured"
    m = ref["chain_minus"]
    return f"{m['mean']:+.3f} [{m['lo']:+.3f}, {m['hi']:+.3f}] ({ref['ce']:.4f}, {ref['steps']:,} steps)"


print("| run | seed | minutes | chain CE | chain minus one block, same wall time (its CE, steps) "
      "| chain minus one block, one worker's CPU-s (its CE, steps) |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for n in range(1, 100):
    p = os.path.join(root, f"run{n}.jsonl")
    if not os.path.exists(p):
        continue
    r = last(p)
    refs = dict(r.get("references") or {})
    wall = os.path.join(root, f"run{n}-wall.jsonl")
    apart = ""
    if "one_block" not in refs and os.path.exists(wall):
        refs["one_block"] = last(wall)["references"]["one_block"]
        apart = " (trained apart)"
    s = r["settings"]
    print(f"| {n} | {s['seed']} | {s['train_s'] / 60:.0f} | {r['runs']['pipeline']['chain_ce']:.4f} | "
          f"{diff(refs.get('one_block'))}{apart} | {diff(refs.get('one_block_cpu'))} |")
