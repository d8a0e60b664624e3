"""``bt-node bench node-memory``: what one real node costs in memory beyond its block's own tensors.

Method, per layout measured (``LAYOUTS``; each a fresh ``bt-node seed`` process, one at a time):

* start one node (``seed``, a one-node run of its own on 127.0.0.1, block 0, ``OMP_NUM_THREADS=1``,
  HTTP on port 0 unless ``http=False``: a node without ``--http-port`` imports no web framework) with the layout's environment, wait for its ready file, let it train for
  ``settle_s`` seconds (training steps, attempted averaging rounds with no peer, announcements);
* then take ``samples`` readings ``interval_s`` apart of the proportional set size (PSS, from
  ``/proc/PID/smaps_rollup`` via psutil: a page shared by n processes counts 1/n in each, so the
  sum over a node's processes is what the node adds to the machine) of the node's process and of
  every process below it, classified as main, DHT (the forked python child that is p2pd's parent),
  averager (the other forked python child), p2pd, torch_shm_manager, other; the median reading of
  each is reported (RSS, USS and open file descriptors too: USS, the pages no other process maps, does
  not move with what else runs on the machine; PSS does, by its share of shared-library pages);
* the block's own tensors: parameters, gradients, AdamW's two moments, and the averager's copy of
  the parameters (5 x parameter bytes, counted from the block built here from the same config);
  ``overhead = total PSS - tensors``, against ``TARGET_OVERHEAD_MB`` (issue 15: 300 MB);
* stop the node with SIGINT (SIGKILL of its whole tree if it is not gone within 60 s).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.objectives import get_objective

MB = 1e6   # figures in MB (10^6 bytes), as the target is stated
TARGET_OVERHEAD_MB = 300.0   # issue 15: "at most 300 MB"
TENSOR_COPIES = 5   # parameters, gradients, AdamW exp_avg and exp_avg_sq, the averager's copy
KINDS = ("main", "dht", "averager", "p2pd", "torch_shm_manager", "other")

# layout name -> (what it is, environment). Each layout starts from the bench's environment without
# any of KNOBS, so "after" is the node's default and each other layout names every setting it changes.
KNOBS = ("BT_HIVEMIND_IN", "HIVEMIND_MEMORY_SHARING_STRATEGY", "BT_TORCH_OPTIM", "BT_TUNE_MALLOC", "GOGC",
         "GOMEMLIMIT", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX", "BT_EAGER_IMPORTS")
_EAGER = {"BT_EAGER_IMPORTS": "scipy,cli"}   # the imports as they were before the lazy ones (lean1 and older)
_OLD = {"BT_TORCH_OPTIM": "1", "BT_TUNE_MALLOC": "0", "GOGC": "100", "GOMEMLIMIT": "off", **_EAGER}
LAYOUTS: dict[str, tuple[str, dict[str, str]]] = {
    "before": ("hivemind's DHT and averager as forked processes, file_system sharing (torch_shm_manager), "
               "torch.optim.AdamW, glibc and Go defaults: the node before issue 15's lean work",
               {"BT_HIVEMIND_IN": "process", "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_system", **_OLD}),
    "threads": ("as before, but the DHT and averager loops as threads of the node, file_descriptor sharing",
                {"BT_HIVEMIND_IN": "thread", "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor", **_OLD}),
    "threads-adamw": ("as threads, with blocktrain's AdamW (no torch._dynamo import)",
                      {"BT_HIVEMIND_IN": "thread", "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
                       **_OLD, "BT_TORCH_OPTIM": "0"}),
    "lean1": ("as threads-adamw, with glibc heap trimming and p2pd GOGC=25 GOMEMLIMIT=24MiB: the default "
              "of commit add0075", {**_EAGER, "GOMEMLIMIT": "24MiB"}),
    "lazy-scipy": ("as lean1, with scipy.optimize (which hivemind imports, a node never calls) deferred",
                   {"BT_EAGER_IMPORTS": "cli", "GOMEMLIMIT": "24MiB"}),
    "gomemlimit": ("as after, with p2pd's GOMEMLIMIT=24MiB (the default until 2026-12-01: dropped for the "
                   "daemon CPU it costs when streaming)", {"GOMEMLIMIT": "24MiB"}),
    "after": ("the default: as lazy-scipy, and bt-node imports its bench and offline commands only when "
              "invoked; p2pd with GOGC=25 only", {}),
    "arena1": ("as after, with MALLOC_ARENA_MAX=1 (one glibc heap for all threads; tried, not the default)",
               {"MALLOC_ARENA_MAX": "1"}),
}


def block_tensor_bytes(cfg: ModelConfig, block_index: int = 0) -> dict:
    block = get_objective(cfg).build_block(block_index)
    params = sum(p.numel() * p.element_size() for p in block.parameters() if p.requires_grad)
    return {"param_bytes": params, "copies": TENSOR_COPIES, "tensor_bytes": params * TENSOR_COPIES}


def classify(main: psutil.Process) -> dict[int, str]:
    """pid -> kind for the node's process tree (see the module docstring)."""
    kinds = {main.pid: "main"}
    children = main.children(recursive=True)
    p2pd_parents = set()
    for c in children:
        try:
            name = c.name()
            if name == "p2pd":
                kinds[c.pid] = "p2pd"
                p2pd_parents.add(c.ppid())
            elif name.startswith("torch_shm_manag"):
                kinds[c.pid] = "torch_shm_manager"
        except psutil.NoSuchProcess:
            pass
    for c in children:
        if c.pid in kinds:
            continue
        try:
            forked = c.ppid() == main.pid and c.cmdline() == main.cmdline()
        except psutil.NoSuchProcess:
            continue
        kinds[c.pid] = ("dht" if c.pid in p2pd_parents else "averager") if forked else "other"
    return kinds


def read_tree(main: psutil.Process) -> dict:
    """One reading: PSS / RSS / USS (bytes) and open fds summed per kind, and the process count per kind."""
    out = {k: {"pss": 0, "rss": 0, "uss": 0, "fds": 0, "processes": 0} for k in KINDS}
    for pid, kind in classify(main).items():
        try:
            p = psutil.Process(pid)
            m = p.memory_full_info()
            fds = p.num_fds()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        d = out[kind]
        d["pss"] += m.pss
        d["rss"] += m.rss
        d["uss"] += m.uss
        d["fds"] += fds
        d["processes"] += 1
    return out


def _stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    tree = []
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    _, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def measure_layout(layout: str, overrides: list[str], *, data: str | None, settle_s: float, samples: int,
                   interval_s: float, workdir: Path, ready_timeout: float = 180.0, http: bool = True) -> dict:
    """Start one node in ``layout``, read its tree's memory, stop it (on every exit path)."""
    what, env_extra = LAYOUTS[layout]
    d = workdir / layout
    d.mkdir(parents=True, exist_ok=True)
    ready = d / "ready.json"
    args = [sys.executable, "-m", "blocktrain.cli.main", "seed", "--run-id", f"mem-{layout}", "--block", "0",
            "--device", "cpu", *(["--http-port", "0"] if http else []), "--checkpoint-dir", str(d / "ckpt"),
            "--ready-file", str(ready), "--quiet", *[x for kv in overrides for x in ("--set", kv)]]
    if data:
        args += ["--data", data]
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}   # each layout says all it changes
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **env_extra})
    with open(d / "node.log", "wb") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        t0 = time.monotonic()
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() - t0 > ready_timeout:
                tail = (d / "node.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the {layout} node did not become ready (exit {proc.poll()}):\n{tail}")
            time.sleep(0.5)
        time.sleep(settle_s)
        main = psutil.Process(proc.pid)
        readings = []
        for i in range(samples):
            if proc.poll() is not None:
                raise RuntimeError(f"the {layout} node exited while measured (exit {proc.returncode})")
            readings.append(read_tree(main))
            if i + 1 < samples:
                time.sleep(interval_s)
    finally:
        _stop(proc)
    per_kind = {}
    for k in KINDS:
        per_kind[k] = {"pss_mb": statistics.median(r[k]["pss"] for r in readings) / MB,
                       "rss_mb": statistics.median(r[k]["rss"] for r in readings) / MB,
                       "uss_mb": statistics.median(r[k]["uss"] for r in readings) / MB,
                       "fds": int(statistics.median(r[k]["fds"] for r in readings)),
                       "processes": max(r[k]["processes"] for r in readings)}
    totals = [sum(r[k]["pss"] for k in KINDS) for r in readings]
    uss_totals = [sum(r[k]["uss"] for k in KINDS) for r in readings]
    return {"total_uss_mb": statistics.median(uss_totals) / MB, "layout": layout, "what": what, "env": env_extra, "per_kind": per_kind,
            "total_pss_mb": statistics.median(totals) / MB,
            "total_pss_mb_range": [min(totals) / MB, max(totals) / MB]}


def bench_node_memory(cfg: ModelConfig, overrides: list[str], layouts: list[str], *, data: str | None = None,
                      settle_s: float = 30.0, samples: int = 5, interval_s: float = 2.0, http: bool = True) -> dict:
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or not layouts:
        raise ValueError(f"unknown layout(s) {unknown}: choose from {', '.join(LAYOUTS)}")
    if settle_s < 0 or samples < 1 or interval_s < 0:
        raise ValueError("settle_s and interval_s must be >= 0 and samples >= 1")
    tensors = block_tensor_bytes(cfg)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bt-node-memory-") as tmp:
        for layout in layouts:
            r = measure_layout(layout, overrides, data=data, settle_s=settle_s, samples=samples,
                               interval_s=interval_s, workdir=Path(tmp), http=http)
            r["tensors_mb"] = tensors["tensor_bytes"] / MB
            r["overhead_mb"] = r["total_pss_mb"] - r["tensors_mb"]
            r["meets_target"] = r["overhead_mb"] <= TARGET_OVERHEAD_MB
            runs.append(r)
    return {"bench": "node-memory", "method": __doc__.split("Method, ")[1].strip(),
            "config": {k: getattr(cfg, k) for k in ("objective", "d_model", "n_blocks", "layers_per_block",
                                                    "seq_len", "batch_size")},
            "block_tensors": tensors, "target_overhead_mb": TARGET_OVERHEAD_MB, "http": http, "settle_s": settle_s,
            "samples": samples,
            "interval_s": interval_s, "data": data or "auto", "runs": runs}


if __name__ == "__main__":   # pragma: no cover - a quick look without the CLI
    print(json.dumps(bench_node_memory(ModelConfig(), [], list(LAYOUTS), settle_s=5, samples=2), indent=1))
