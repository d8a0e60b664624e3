"""Worker resources: peak training memory and step throughput of ONE block vs the end-to-end reference.

(Over 400 lines on purpose: both measurements share the trainee setup and the process-isolated
measuring child below, and a third of the file is this description of the method.)

``bench memory``
    Each measurement (one block, or the full-depth reference) runs in a FRESH Python process
    (``python -m blocktrain.bench.resources --measure block|reference ...``) so neither
    sees the other's allocations. The process imports torch and blocktrain, runs one warm-up
    step on a throwaway model of the same kind with a few KiB of parameters (the first step
    starts thread pools and the autograd engine; with torch.optim, BT_TORCH_OPTIM=1, it also
    imports torch._dynamo, ~68 MB more; blocks/optim.py does not), then records its RSS (the
    *baseline*: interpreter + warm torch runtime, no model of
    the measured size yet; ``after_import_rss_mib`` is reported too), builds the module and its
    AdamW optimizer, and trains ``steps`` optimizer steps on synthetic random bytes of the
    configured batch and seq_len (memory does not depend on the bytes' values), so parameters,
    gradients, AdamW state and the activations of forward+backward all count. Reported:

    * ``peak_rss_mib``: the process's peak resident set (``getrusage(RUSAGE_SELF).ru_maxrss``),
      torch's own footprint included;
    * ``peak_increase_mib``: that peak minus the baseline, i.e. what training the module adds
      on top of an idle torch process (the figure a worker pays per block);
    * on CUDA, ``torch.cuda.max_memory_allocated`` over the whole run (the baseline there is 0).

    The ratio block/reference is given for each.

    A block of a chain-trained objective (``pipeline``, ``forward-streamed``) has no loss alone; its
    step is measured as the pipeline engine runs it on a worker (node/pipeline/engine.py) at
    ``--inflight`` K micro-batches in flight: a ``pipeline`` block before the last runs K forwards
    on random input states (block 0: random bytes) keeping their graphs, each with a copy of the
    block's weights (weight stashing: the worst case, one version per held micro-batch;
    ``--no-weight-stash``: none, as the engine's default and its flushed windows run), then the K
    backwards from random dL/dh_b, then one clipped AdamW step on the mean; the last block and
    ``forward-streamed`` blocks compute their loss and backward at once (nothing held), K times.
    The stash (graphs + weight copies) is thus inside the measured step's live-tensor peak. With
    ``--recompute`` (the engine's ``--pipeline-recompute``) the K forwards keep no graph, only each
    micro-batch's input (its output is given to the wire, which drops it once encoded), and each
    backward first runs its forward again with a graph.

``bench throughput``
    One block step (its local objective's loss, backward, clip, AdamW) and one reference step
    (next-byte CE, same batch) are timed in the SAME process, interleaved (block, reference,
    reference, block, ...) after a warm-up, and the median step time of each gives tokens/s and
    the ratio block/reference. Model FLOPs come from ``blocks.flops.train_flops_per_step``; on
    CUDA, MFU is achieved FLOP/s over an ASSUMED device peak (dense bf16, from a small table by
    device name, or ``--peak-tflops``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from blocktrain.blocks.chain_train import stage_backward
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.flops import train_flops_per_step
from blocktrain.blocks.layers import layer_checkpointing
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.reference import ReferenceLM
from blocktrain.blocks.train import make_optimizer, optimizer_step, reference_loss_fn

MiB = 1024.0 * 1024.0
# Optional second CPU measurement: fixed glibc mmap threshold, so RSS follows live tensors.
GLIBC_MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
ALLOCATORS = ("node", "glibc")   # node: node/memory.py tune_malloc in both processes; glibc: its defaults
MEMORY_TARGET = 0.35       # issue 2, target 2: block peak memory <= 0.35x the reference's
THROUGHPUT_TARGET = 3.0    # issue 2, target 2: block-step throughput >= 3x the reference step's

# A small config for --tiny (well under a minute on 2 CPU cores); keeps B=4 and 2 layers per block
# so the block/reference ratios have the same structure as the default config.
TINY_OVERRIDES: dict[str, Any] = dict(d_model=64, n_heads=2, layers_per_block=2, n_blocks=4, seq_len=64,
                                      target_dim=16, batch_size=8, warmup_steps=0)

# Dense bf16 tensor-core peaks, TFLOP/s, from vendor data sheets (no sparsity). An ASSUMPTION:
# clocks, power limits and the SKU's form factor change the real figure. First match wins.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.0),
]


# -- helpers ---------------------------------------------------------------------------------
def _rss_now_bytes() -> int | None:
    """Current resident set size, from /proc (Linux); None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024  # bytes on macOS, KiB on Linux


def peak_tflops_for(device_name: str) -> tuple[float | None, str]:
    for key, tf in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tf, f"assumed dense bf16 peak of '{key}' ({tf:g} TFLOP/s, vendor data sheet)"
    return None, f"no peak known for '{device_name}' (pass --peak-tflops)"


def primer_config(cfg: ModelConfig) -> ModelConfig:
    """A minute model of the same kind, used to warm the runtime before the memory baseline."""
    seq = min(cfg.seq_len, 8)
    return cfg.replace(d_model=8, n_heads=1, layers_per_block=1, seq_len=seq, target_dim=4, batch_size=1,
                       chunk_len=min(cfg.chunk_len, seq))


def _n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters() if p.requires_grad)


class _Trainee:
    """One module with its optimizer and a ready-made step on a fixed synthetic batch."""

    def __init__(self, which: str, cfg: ModelConfig, device: torch.device, block_index: int = 0,
                 seed: int = 0, inflight: int = 4, recompute: bool = False, weight_stash: bool = True):
        if which not in ("block", "reference"):
            raise ValueError(f"unknown module {which!r}: use block or reference")
        if not 0 <= block_index < cfg.n_blocks:
            raise ValueError(f"--block {block_index} out of range [0, {cfg.n_blocks})")
        torch.manual_seed(cfg.init_seed)
        self.which, self.cfg, self.device = which, cfg, device
        g = torch.Generator().manual_seed(seed)
        self.windows = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1),
                                     generator=g).to(device)
        if which == "block":
            self.objective = get_objective(cfg)
            self.module = self.objective.build_block(block_index).to(device)
            self.layers = cfg.layers_per_block
            self.tokens_per_window = self.objective.train_tokens_per_window
            gen = torch.Generator().manual_seed(seed + 1)
            self.loss_fn = lambda: self.objective.local_loss(self.module, block_index, self.windows, gen)
            self.chain = not self.objective.block_local   # trained along the chain: see _chain_step
            self.block_index, self.inflight = block_index, inflight
            self.recompute, self.weight_stash = recompute, weight_stash
        else:
            self.module = ReferenceLM(cfg).to(device)
            self.layers = cfg.reference_layers
            self.tokens_per_window = cfg.seq_len
            self.loss_fn = reference_loss_fn(self.module, self.windows)
        self.opt = make_optimizer(self.module, cfg)
        self.steps = 0

    def step(self) -> dict:
        if getattr(self, "chain", False):
            out = self._chain_step()
        else:
            out = optimizer_step(self.module, self.opt, self.cfg, self.steps, self.loss_fn)
        self.steps += 1
        return out

    def _chain_step(self) -> dict:
        """One step of a chain-trained block as a worker's pipeline engine runs it (see the module doc)."""
        obj, m, b, cfg, dev = self.objective, self.module, self.block_index, self.cfg, self.device
        ctx, y = self.windows[:, :-1], self.windows[:, 1:]
        g = torch.Generator().manual_seed(self.steps)
        shape = (ctx.shape[0], ctx.shape[1], obj.state_dim())
        m.train()
        for grp in self.opt.param_groups:
            grp["lr"] = cfg.lr
        self.opt.zero_grad(set_to_none=True)
        held = obj.chain_training == "backprop" and b < cfg.n_blocks - 1
        losses, stash = [], []
        context = ctx if b == 0 else None
        for _ in range(self.inflight):
            x = None if b == 0 else torch.randn(shape, generator=g).to(dev)
            weights = ({k: v.detach().clone() for k, v in m.state_dict().items()}
                       if held and self.weight_stash else None)
            if held and self.recompute:   # only the input stays: the output goes to the wire; no graph
                with torch.no_grad():
                    h = obj.stage_forward(m, b, x, context)
                del h
                stash.append((x, None, weights))
                continue
            if x is not None:
                x.requires_grad_(True)
            h = obj.stage_forward(m, b, x, context)
            if held:   # the graph (and a copy of the weights) stay until the gradient comes back
                stash.append((x, h, weights))
            else:
                loss, _ = obj.stage_loss(m, b, h, y)
                loss.backward()
                losses.append(float(loss.detach()))
        while stash:
            x, h, _weights = stash.pop(0)
            if self.recompute:            # the backward runs the forward again, with its graph
                if x is not None:
                    x.requires_grad_(True)
                h = obj.stage_forward(m, b, x, context)
            stage_backward(h, torch.randn(shape, generator=g).to(dev))
            del x, h, _weights
        for p in m.parameters():
            if p.grad is not None:
                p.grad.div_(self.inflight)
        gnorm = torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.grad_clip)
        self.opt.step()
        return {"loss": sum(losses) / len(losses) if losses else 0.0, "grad_norm": float(gnorm)}

    def describe(self) -> dict:
        if getattr(self, "chain", False):
            return {"layers": self.layers, "params": _n_params(self.module), "inflight": self.inflight,
                    "recompute": self.recompute, "weight_stash": self.weight_stash,
                    "chain_training": self.objective.chain_training}
        return {"layers": self.layers, "params": _n_params(self.module),
                "flops_per_step": train_flops_per_step(self.module, self.cfg.batch_size, self.tokens_per_window)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine() or 'cpu'}, {os.cpu_count()} CPUs"


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def _config_summary(cfg: ModelConfig) -> dict:
    keys = ("objective", "d_model", "n_heads", "layers_per_block", "n_blocks", "seq_len", "target_dim",
            "batch_size", "sigma_min", "sigma_max")
    return {k: getattr(cfg, k) for k in keys} | {"config_hash": cfg.config_hash}


# -- memory: the child process ----------------------------------------------------------------
def measure_memory_here(cfg: ModelConfig, which: str, *, steps: int, device: torch.device,
                        block_index: int = 0, inflight: int = 4, recompute: bool = False,
                        weight_stash: bool = True, layer_checkpoint: bool = False) -> dict:
    """Run in a fresh process: baseline RSS, build, train ``steps`` steps, peak RSS (and CUDA peak).
    ``layer_checkpoint``: every forward with a graph checkpointed per layer (``blocks.layers``)."""
    with layer_checkpointing(layer_checkpoint):
        out = _measure_memory(cfg, which, steps=steps, device=device, block_index=block_index,
                              inflight=inflight, recompute=recompute, weight_stash=weight_stash)
    out["layer_checkpoint"] = layer_checkpoint
    return out


def _measure_memory(cfg: ModelConfig, which: str, *, steps: int, device: torch.device, block_index: int,
                    inflight: int, recompute: bool, weight_stash: bool) -> dict:
    gc.collect()
    after_import = _rss_now_bytes()
    # Warm the runtime on a throwaway model of the same kind (a few KiB of parameters): the first
    # step starts thread pools and the autograd engine (and, with torch.optim, imports ~800 modules
    # of torch._dynamo), which any torch process pays whatever it trains.
    _Trainee(which, primer_config(cfg), device).step()
    gc.collect()
    baseline = _rss_now_bytes()
    baseline_src = "VmRSS after imports and a 1-step warm-up on a throwaway tiny model"
    if baseline is None:
        baseline, baseline_src = _peak_rss_bytes(), "ru_maxrss after imports and warm-up"
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    tr = _Trainee(which, cfg, device, block_index, inflight=inflight, recompute=recompute,
                  weight_stash=weight_stash)
    after_build = _rss_now_bytes()
    losses = []
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        losses.append(tr.step()["loss"])
    _sync(device)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = _peak_rss_bytes()
    live = live_tensor_peak(tr) if device.type == "cpu" else None   # after the RSS reading: it allocates
    n = _n_params(tr.module)
    out = {
        "module": which, **tr.describe(), "steps": steps, "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),   # the process's user + system CPU over those steps
        "threads": torch.get_num_threads(),
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "after_import_rss_mib": None if after_import is None else after_import / MiB,
        "baseline_rss_mib": baseline / MiB, "baseline": baseline_src,
        "after_build_rss_mib": None if after_build is None else after_build / MiB,
        "peak_rss_mib": peak / MiB, "peak_increase_mib": (peak - baseline) / MiB,
        # fp32 weights + grads + AdamW exp_avg + exp_avg_sq: 16 bytes per parameter
        "param_grad_adam_mib": 16.0 * n / MiB,
    }
    if live is not None:
        out.update(live)
    if device.type == "cuda":
        out["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / MiB
        out["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MiB
    return out


def _tensor_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def live_tensor_peak(tr: "_Trainee") -> dict:
    """Peak bytes of live tensors during one more training step, from the allocator's own events:
    the tensors alive before the step (weights, AdamW state, any grads) plus the peak of the
    running sum of every allocation and free inside the step (torch.profiler ``profile_memory``,
    each op's self allocations in start order). Deterministic and independent of how the C
    allocator caches freed memory, unlike RSS."""
    from torch.profiler import ProfilerActivity, profile
    state = [v for st in tr.opt.state.values() for v in st.values()]
    static = _tensor_bytes([*tr.module.parameters(), *(p.grad for p in tr.module.parameters()), *state])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tr.step()
    running = peak = 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        running += ev.self_cpu_memory_usage
        peak = max(peak, running)
    return {"live_static_mib": static / MiB, "live_step_peak_mib": peak / MiB,
            "live_peak_mib": (static + peak) / MiB}


def _child_cmd(cfg: ModelConfig, which: str, *, steps: int, device: torch.device, block_index: int,
               threads: int | None, inflight: int = 4, recompute: bool = False,
               weight_stash: bool = True, allocator: str = "node", layer_checkpoint: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "blocktrain.bench.resources", "--measure", which,
           "--config-json", cfg.to_json(), "--steps", str(steps), "--device", device.type,
           "--block", str(block_index), "--inflight", str(inflight),
           "--recompute" if recompute else "--no-recompute", "--weight-stash" if weight_stash else "--no-weight-stash",
           "--allocator", allocator, "--layer-checkpoint" if layer_checkpoint else "--no-layer-checkpoint"]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    return cmd


def _measure_in_subprocesses(cfg: ModelConfig, *, steps: int, device: torch.device, block_index: int,
                             timeout: float, threads: int | None, inflight: int = 4, recompute: bool = False,
                             weight_stash: bool = True, env: dict[str, str] | None = None,
                             allocator: str = "node", layer_checkpoint: frozenset = frozenset()) -> dict[str, dict]:
    """Block and reference, each in its own fresh process, one after the other, so neither competes
    with the other for cores or memory bandwidth while it is measured."""
    names = ("block", "reference")
    procs: dict[str, subprocess.Popen] = {}
    out: dict[str, dict] = {}

    def start(which: str) -> None:
        procs[which] = subprocess.Popen(
            _child_cmd(cfg, which, steps=steps, device=device, block_index=block_index, threads=threads,
                       inflight=inflight, recompute=recompute, weight_stash=weight_stash, allocator=allocator,
                       layer_checkpoint=which in layer_checkpoint),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})

    def finish(which: str) -> None:
        p = procs[which]
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                if q.poll() is None:
                    q.kill()
                    q.communicate()
            raise RuntimeError(f"memory measurement of the {which} took more than {timeout:g} s") from None
        if p.returncode != 0:
            tail = (stderr or stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"memory measurement of the {which} failed (exit {p.returncode}): "
                               + " | ".join(tail))
        try:
            out[which] = json.loads(stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise RuntimeError(f"memory measurement of the {which} printed no JSON: {stdout[-300:]!r}") from None

    try:
        for w in names:
            start(w)
            finish(w)
    finally:
        for q in procs.values():
            if q.poll() is None:
                q.kill()
                q.communicate()
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def bench_memory(cfg: ModelConfig, device: torch.device, *, steps: int = 5, block_index: int = 0,
                 timeout: float = 900.0, threads: int | None = None, glibc_mmap: bool = False,
                 inflight: int = 1, recompute: bool = False, weight_stash: bool = True,
                 allocator: str = "node", layer_checkpoint: bool = False,
                 reference_layer_checkpoint: bool = False) -> dict:
    """Peak training memory of one block vs the full-depth reference, each in a fresh process, both with
    the same C allocator settings: ``node`` (what a node applies at start, ``node/memory.py``
    ``tune_malloc``) or ``glibc`` (its defaults, as before 2026-12-02). ``layer_checkpoint`` /
    ``reference_layer_checkpoint``: the block's / the reference's forwards checkpointed per layer (the
    engine's ``--pipeline-layer-checkpoint``; the reference with it too: the like-for-like comparison)."""
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if not 0 <= block_index < cfg.n_blocks:
        raise ValueError(f"--block {block_index} out of range [0, {cfg.n_blocks})")
    if not 1 <= inflight <= 4096:
        raise ValueError(f"--inflight must be in [1, 4096], got {inflight}")
    if allocator not in ALLOCATORS:
        raise ValueError(f"--allocator must be one of {', '.join(ALLOCATORS)}, got {allocator!r}")
    if layer_checkpoint and get_objective(cfg).block_local:
        raise ValueError(f"--layer-checkpoint measures the pipeline engine's --pipeline-layer-checkpoint: a block of a "
                         f"chain-trained objective (pipeline, pipeline-chunked, forward-streamed), not {cfg.objective}")
    ckpt = frozenset(w for w, on in (("block", layer_checkpoint), ("reference", reference_layer_checkpoint)) if on)
    m = _measure_in_subprocesses(cfg, steps=steps, device=device, block_index=block_index, timeout=timeout,
                                 threads=threads, inflight=inflight, recompute=recompute, weight_stash=weight_stash,
                                 allocator=allocator, layer_checkpoint=ckpt)
    block, ref = m["block"], m["reference"]
    chain_note = ""
    if "chain_training" in block:
        held = ("their inputs (recompute: the output goes to the wire; each backward runs its forward again first)"
                if recompute else "their graphs")
        copies = (" and one weight copy each (the weight-stashing worst case)" if weight_stash
                  else " and no weight copy (the engine's default)")
        chain_note = (f"; the {cfg.objective} block's step is the pipeline engine's at {inflight} micro-batches in flight "
                      f"(a block before the last holds {held}{copies} until their backwards; then one AdamW step)")
    res: dict[str, Any] = {
        "bench": "memory", "device": device.type, "device_name": _device_name(device),
        "torch": torch.__version__, "config": _config_summary(cfg), "block_index": block_index,
        "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "steps": steps,
        "threads": block.get("threads"), "allocator": allocator,
        "layer_checkpoint": {"block": layer_checkpoint, "reference": reference_layer_checkpoint},
        "method": ("each module trained in its own fresh process on synthetic bytes for `steps` AdamW steps; "
                   + ("both processes apply the node's C allocator settings at start (node/memory.py tune_malloc: "
                      "trim threshold 64 KiB, mmap threshold 4 MiB, malloc_trim every 10 s); " if allocator == "node"
                      else "glibc's default allocator settings; ")
                   + ("; ".join(f"the {w}'s forwards checkpointed per layer (each layer's input kept, the layer run "
                                "again in the backward)" for w in sorted(ckpt)) + "; " if ckpt else "")
                   + "peak_rss = getrusage ru_maxrss of the whole process; peak_increase = peak_rss minus "
                   "the baseline VmRSS taken after importing torch+blocktrain and one warm-up step on a "
                   "throwaway tiny model of the same kind (torch's own footprint, lazy imports and "
                   "thread pools excluded)"
                   + ("; cuda = torch.cuda.max_memory_allocated" if device.type == "cuda" else
                      "; live_tensor_peak (the headline on CPU) = bytes of the tensors alive before one "
                      "more step (weights, grads, AdamW state) + the peak running sum of the allocator's "
                      "allocation/free events during that step (torch.profiler profile_memory)")) + chain_note,
        "block": block, "reference": ref,
        "ratio_peak_rss": _ratio(block["peak_rss_mib"], ref["peak_rss_mib"]),
        "ratio_peak_increase": _ratio(block["peak_increase_mib"], ref["peak_increase_mib"]),
        "ratio_param_grad_adam": _ratio(block["param_grad_adam_mib"], ref["param_grad_adam_mib"]),
        "target_ratio": MEMORY_TARGET,
    }
    if device.type == "cuda":
        res["ratio_cuda_max_allocated"] = _ratio(block.get("cuda_max_allocated_mib"),
                                                 ref.get("cuda_max_allocated_mib"))
        res["ratio"] = res["ratio_cuda_max_allocated"]
        res["ratio_kind"] = "cuda_max_allocated"
    else:
        res["ratio_live_tensors"] = _ratio(block.get("live_peak_mib"), ref.get("live_peak_mib"))
        res["ratio"] = res["ratio_live_tensors"]
        res["ratio_kind"] = "live_tensor_peak"
    res["meets_target"] = res["ratio"] is not None and res["ratio"] <= MEMORY_TARGET
    if glibc_mmap:
        m = _measure_in_subprocesses(cfg, steps=steps, device=device, block_index=block_index,
                                     timeout=timeout, threads=threads, inflight=inflight, recompute=recompute,
                                     weight_stash=weight_stash, env=GLIBC_MMAP_ENV, allocator=allocator,
                                     layer_checkpoint=ckpt)
        res["glibc_mmap"] = {
            "env": " ".join(f"{k}={v}" for k, v in GLIBC_MMAP_ENV.items()),
            "note": ("glibc told to serve every allocation >= 64 KiB with mmap and unmap it on free "
                     "(no dynamic threshold), so freed tensors leave the RSS: peak RSS then tracks "
                     "live tensor memory rather than allocator caching"),
            "block": m["block"], "reference": m["reference"],
            "ratio_peak_rss": _ratio(m["block"]["peak_rss_mib"], m["reference"]["peak_rss_mib"]),
            "ratio_peak_increase": _ratio(m["block"]["peak_increase_mib"], m["reference"]["peak_increase_mib"]),
        }
    return res


# -- throughput ---------------------------------------------------------------------------------
def bench_throughput(cfg: ModelConfig, device: torch.device, *, warmup: int = 3, iters: int = 10,
                     block_index: int = 0, peak_tflops: float | None = None,
                     threads: int | None = None) -> dict:
    """Tokens/s of one block's optimizer step vs one reference step, interleaved, median of ``iters``."""
    if warmup < 0 or iters < 1:
        raise ValueError(f"need --warmup >= 0 and --iters >= 1, got {warmup}, {iters}")
    set_threads(threads)
    trainees = {w: _Trainee(w, cfg, device, block_index) for w in ("block", "reference")}
    for _ in range(warmup):
        for tr in trainees.values():
            tr.step()
    _sync(device)
    times: dict[str, list[float]] = {"block": [], "reference": []}
    order = ["block", "reference"]
    for i in range(iters):
        for w in (order if i % 2 == 0 else order[::-1]):   # ABBA: no systematic first/second bias
            _sync(device)
            t0 = time.perf_counter()
            trainees[w].step()
            _sync(device)
            times[w].append(time.perf_counter() - t0)
    tokens = cfg.batch_size * cfg.seq_len
    name = _device_name(device)
    peak_src = None
    if peak_tflops is not None:
        peak_src = f"given with --peak-tflops ({peak_tflops:g} TFLOP/s)"
    elif device.type == "cuda":
        peak_tflops, peak_src = peak_tflops_for(name)
    out: dict[str, Any] = {
        "bench": "throughput", "device": device.type, "device_name": name, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "config": _config_summary(cfg), "block_index": block_index,
        "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "tokens_per_step": tokens,
        "warmup": warmup, "iters": iters,
        "method": ("block step and reference step (same synthetic batch) timed interleaved ABBA in one "
                   "process after warm-up; median step time; tokens/s = batch*seq_len/median"),
        "peak_tflops": peak_tflops, "peak_source": peak_src,
    }
    for w, tr in trainees.items():
        med = statistics.median(times[w])
        d = tr.describe()
        achieved = d["flops_per_step"] / med
        out[w] = {**d, "step_s_median": med, "step_s_min": min(times[w]), "step_s_max": max(times[w]),
                  "tokens_per_s": tokens / med, "achieved_tflops": achieved / 1e12,
                  "mfu": (achieved / (peak_tflops * 1e12)) if peak_tflops else None}
    out["ratio"] = out["block"]["tokens_per_s"] / out["reference"]["tokens_per_s"]
    # Robustness checks for a busy machine: the i-th block step and i-th reference step run
    # back to back, so their ratio sees about the same load; and the ratio of the fastest steps.
    out["ratio_paired_median"] = statistics.median(r / b for b, r in zip(times["block"], times["reference"]))
    out["ratio_best"] = min(times["reference"]) / min(times["block"])
    out["flops_ratio"] = out["reference"]["flops_per_step"] / out["block"]["flops_per_step"]
    out["target_ratio"] = THROUGHPUT_TARGET
    out["meets_target"] = out["ratio"] >= THROUGHPUT_TARGET
    return out


# -- child entry point ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blocktrain.bench.resources",
                                 description="One memory measurement in this (fresh) process; prints JSON.")
    ap.add_argument("--measure", choices=["block", "reference"], required=True)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--weight-stash", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--allocator", choices=ALLOCATORS, default="node")
    ap.add_argument("--layer-checkpoint", action=argparse.BooleanOptionalAction, default=False)
    a = ap.parse_args(argv)
    if a.allocator == "node":   # as a node does once its imports are done (node/node.py)
        from blocktrain.node.memory import tune_malloc
        tune_malloc()
    set_threads(a.threads)
    cfg = ModelConfig.from_dict(json.loads(a.config_json), source="--config-json")
    res = measure_memory_here(cfg, a.measure, steps=a.steps, device=torch.device(a.device),
                              block_index=a.block, inflight=a.inflight, recompute=a.recompute,
                              weight_stash=a.weight_stash, layer_checkpoint=a.layer_checkpoint)
    sys.stdout.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
