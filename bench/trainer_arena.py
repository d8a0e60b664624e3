"""The training thread's glibc arena and its CPU per step, by glibc mmap threshold (issue 15, lean nodes).

Why: in a running tiny node the thread that trains holds a ~10-13 MB glibc arena, most of it free
between steps (BENCHMARKS.md "Lean nodes", fourth pass). glibc raises its mmap threshold each time a
mapped block is freed (up to 32 MB); torch's import frees many, so by the time the node pins its trim
threshold (node/memory.py ``tune_malloc``, which also stops further raises) a step's activations of
128 KiB to a few MB are carved from the thread's arena, which then stays at the step's high-water mark.
Pinning the threshold back returns them to the system after every step, at the CPU cost measured here.

Method: one fresh process per threshold (``None`` = as the node runs: ``tune_malloc`` after the
imports; a number = the same, then ``mallopt(M_MMAP_THRESHOLD, n)``); a ``BlockTrainer`` of the bench's
tiny shape (``bench/resources.py`` TINY_OVERRIDES, one torch thread) trains in a thread of its own:
``warmup`` steps, then ``steps`` steps timed with ``time.thread_time`` (that thread's user + system CPU);
then glibc's ``malloc_info`` for the arena that grew most (that thread's: its size, free bytes inside it) and
the process's anonymous RSS growth since before the thread started.

    python -m blocktrain.bench.trainer_arena --data /work/shared/data/wikitext-2-raw/wiki.valid.raw \\
        --threshold none --threshold 131072 --threshold 524288
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

M_MMAP_THRESHOLD = -3   # <malloc.h>


def _malloc_info() -> list[dict]:
    libc = ctypes.CDLL(None)
    libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        xml = open(f.name).read()
    out = []
    for m in re.finditer(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.S):
        sizes = re.search(r'<total type="fast" count="\d+" size="(\d+)"/>\s*'
                          r'<total type="rest" count="\d+" size="(\d+)"/>', m.group(2))
        current = int(re.search(r'<system type="current" size="(\d+)"/>', m.group(2)).group(1))
        out.append({"arena": int(m.group(1)), "bytes": current, "free": int(sizes.group(1)) + int(sizes.group(2))})
    return out


def _anon_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def measure_one(data: str, threshold: int | None, steps: int, warmup: int) -> dict:
    import numpy as np
    import torch

    from blocktrain.bench.resources import TINY_OVERRIDES
    from blocktrain.blocks.config import ModelConfig
    from blocktrain.node.memory import tune_malloc
    from blocktrain.node.trainer import BlockTrainer

    torch.set_num_threads(1)
    corpus = np.fromfile(data, dtype=np.uint8)
    trainer = BlockTrainer(ModelConfig(**TINY_OVERRIDES), 0, corpus, corpus[: len(corpus) // 10])
    tune_malloc()
    if threshold is not None and ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        raise OSError("mallopt(M_MMAP_THRESHOLD) refused")
    before = {a["arena"]: a["bytes"] for a in _malloc_info() if a["arena"] > 0}
    anon0, res = _anon_kb(), {}

    def train() -> None:
        for _ in range(warmup):
            trainer.train_step()
        c0 = time.thread_time()
        for _ in range(steps):
            trainer.train_step()
        res["cpu_ms_per_step"] = (time.thread_time() - c0) / steps * 1e3
        res["arenas"] = _malloc_info()

    t = threading.Thread(target=train, name="trainer")
    t.start()
    t.join()
    # the thread's arena: the one that grew most (a new thread may reuse an idle arena of a finished one)
    arena = max((a for a in res["arenas"] if a["arena"] > 0), key=lambda a: a["bytes"] - before.get(a["arena"], 0))
    return {"threshold": threshold, "cpu_ms_per_step": res["cpu_ms_per_step"], "arena_mb": arena["bytes"] / 1e6,
            "arena_free_mb": arena["free"] / 1e6, "anon_growth_mb": (_anon_kb() - anon0) * 1024 / 1e6,
            "steps": steps}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a raw byte file to train on")
    ap.add_argument("--threshold", action="append", default=[],
                    help="'none' (as the node runs) or bytes; repeat; each in a fresh process")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or not os.path.isfile(a.data):
        ap.error("--steps >= 1, --warmup >= 0 and an existing --data file are required")
    try:
        thresholds = [None if t.lower() == "none" else int(t) for t in (a.threshold or ["none"])]
    except ValueError:
        ap.error("--threshold takes 'none' or a byte count")
    if a.one:
        print(json.dumps(measure_one(a.data, thresholds[0], a.steps, a.warmup)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for t in thresholds:
        r = subprocess.run([sys.executable, "-m", "blocktrain.bench.trainer_arena", "--one", "--data", a.data,
                            "--threshold", "none" if t is None else str(t), "--steps", str(a.steps),
                            "--warmup", str(a.warmup)], capture_output=True, text=True, env=env, timeout=1800)
        if r.returncode != 0:
            raise SystemExit(f"threshold {t}: {r.stderr[-2000:]}")
        print(r.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
