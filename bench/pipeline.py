"""``bt-node bench pipeline``: training along the chain vs block-local training, at equal wall time.

For each objective (default ``pipeline``, ``forward-streamed``, ``paper``) one real local network
of ``bt-node`` processes on 127.0.0.1 (one torch thread each; default 6 workers over 4 blocks,
blocks 1 and 2 held twice) trains for the same wall time, counted from the moment every worker is
up (holders start from the last block down, block 0 last, so a chain-trained network is whole
before its first micro-batch). Then:

* quality: every worker leaves gracefully (final checkpoint); the chain through replica r of every
  block (r = 0, 1, ...; the last replica where a block has fewer) is scored in this process on the
  same held-out windows for every objective, and the mean over replica chains is reported, with
  the untrained chain's CE for scale;
* CPU: each worker's node process CPU time (user + system, every thread; ``/proc/PID/stat``) during
  the window, and with its children (p2pd) for information: what one worker would have had of its
  own machine is the mean (min, max) of the former;
* throughput: tokens per second of each block (its holders' samples during the window x seq_len),
  the chain's figure being the slowest block's;
* traffic: bytes each worker sent for training (pipeline RPC messages, as ``/metrics`` counts
  them, plus averaging messages), in total and per worker per optimizer step;
* memory: the peak resident set of each worker's node process (``VmHWM``; its DHT and p2pd
  children not included); stalled time and micro-batches lost from the pipeline engine's counters;
* serving: one holder per block restarts from those checkpoints with ``--inject-delay-ms D`` (each
  hop's round trip gains 2 D) and ``--max-steps 0``, and a client generates ``gen_bytes`` bytes in
  the objective's own fastest mode (``one_sweep``: ``paper`` one traversal for all of them,
  ``pipeline-chunked`` one per chunk of ``chunk_len`` bytes, the autoregressive ones one per byte):
  traversals as counted on the route, and wall time;
* along the way (``curve_every`` > 0): every ``curve_every`` s a client in this process exports the
  chain (one live holder per block) and the snapshots are scored after training on the first
  ``curve_windows`` held-out windows, each against the workers' mean CPU-seconds at that moment.

The references of issue 13 are trained here too, each in a fresh process (``bench/pipeline_refs.py``):
the whole-size model end to end on as many windows as the ``pipeline`` network's block 0 sent (equal
tokens), and the one-block model one worker trains alone, one process scored twice: once its own CPU
time reaches the mean CPU-seconds one ``pipeline`` worker used in the window (the fair reference: a
worker on a real network has its own machine), and after the same wall time as each network (on this
shared machine a network's workers split the cores while that process has one to itself); and along
the way at the CPU-seconds of the network's curve points. All scored on the same held-out windows,
and each reference compared with the chain window by window (``chain_minus``: the mean of the chain's
CE minus the reference's over the windows, with a paired bootstrap 95% interval over windows,
``blocks/stats.py``; one seed, so the interval carries the text's sampling, not the seed's).

Presets: the default (CPU, sized for a 2-core machine), ``tiny`` (seconds, for the test) and
``h200`` (bf16 autocast on one CUDA device shared by every worker, sized for at most 8 minutes on
one H200; its plan is :func:`plan_seconds`). Figures: run it; none are recorded here.

A record made with ``--no-wall-reference`` gets that reference afterwards from :func:`add_wall_reference`
(``bt-node bench pipeline-wall-reference``): the same process, trained with the record's own settings.

About 600 lines: the bench's settings, one network's run and report, its curve, serving and the
references' orchestration belong together; the plot (``pipeline_plot.py``), the references' child
(``pipeline_refs.py``) and the CPU reading (``proc_cpu.py``) are apart.
"""
from __future__ import annotations

import copy
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from blocktrain.bench.pipeline_refs import train_reference
from blocktrain.bench.proc_cpu import cpu_s as _cpu_s, diff as _diff, spread as _spread
from blocktrain.bench.swarm import _env, _metrics, init_blocks
from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import resolve_data
from blocktrain.blocks.default_data import resolve_default
from blocktrain.blocks.evaluate import per_window_chain_ce
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.stats import paired_bootstrap
from blocktrain.blocks.windows import eval_windows
from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.node.swarm.run import typed_settings

FULL_CONFIG = ["d_model=64", "n_heads=2", "layers_per_block=1", "n_blocks=4", "seq_len=288", "target_dim=16",
               "batch_size=8", "warmup_steps=20", "lr=0.002"]
TINY_CONFIG = ["d_model=32", "n_heads=2", "layers_per_block=1", "n_blocks=2", "seq_len=32", "target_dim=8",
               "batch_size=4", "warmup_steps=2", "lr=0.002"]
H200_CONFIG = ["d_model=512", "n_heads=8", "layers_per_block=2", "n_blocks=4", "seq_len=256", "target_dim=64",
               "batch_size=16", "warmup_steps=50", "lr=0.002"]
STOP_GRACE_S = 180.0               # seconds a training worker gets to leave gracefully (final checkpoint)
STARTUP_S, SCORE_S = 40.0, 15.0     # h200 plan: assumed start-up + shutdown of one network, scoring of one model


@dataclass
class PipelineBenchSettings:
    overrides: list[str] = field(default_factory=lambda: list(FULL_CONFIG))
    plan: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 1, 2])     # block per worker
    objectives: list[str] = field(default_factory=lambda: ["pipeline", "forward-streamed", "paper"])
    train_s: float = 120.0
    eval_windows: int = 1024        # protocol v2: at least 1,024 fixed held-out windows
    gen_bytes: int = 256
    delay_ms: float = 25.0
    average_every: int = 10
    average_clock: float = 60.0     # --average-clock of every worker (the node's default; 0: off)
    timeout_s: float = 60.0         # --pipeline-timeout of every worker (the node's default)
    timeout_max_s: float = 600.0    # --pipeline-timeout-max of every worker (the node's default)
    compression: str = "fp32"       # --pipeline-compression of every worker
    inflight: int = 1               # --pipeline-inflight of every worker (the node's default)
    weight_stash: bool = False      # --pipeline-weight-stash of every worker (the node's default)
    flush: bool = False             # --pipeline-flush, and --pipeline-accumulate = inflight, on every worker
    recompute: bool = False         # --pipeline-recompute of every worker (hold inputs, not graphs)
    layer_checkpoint: bool = False  # --pipeline-layer-checkpoint of every worker (one layer's graph at a time)
    data: str = "auto"
    device: str = "cpu"             # --device of every worker and of the references (cuda: bf16 autocast)
    references: bool = True         # train the whole-size and one-block references (issue 13)
    wall_reference: bool = True     # the one-block reference also trains for the same wall time (not only CPU-s)
    whole_reference: bool = True    # train the whole-size reference at equal tokens (target 1)
    curve_every: float = 0.0        # s between chain exports during training (0: no curve)
    curve_windows: int = 256        # held-out windows (the first of eval_windows) each curve point is scored on
    serving: bool = True            # measure each objective's serving cost (a second network per objective)
    preset: str = "cpu"
    seed: int = 0                   # every worker's --seed (worker i: --data-stream i), init_seed; the references' too
    lrs: dict[str, float] = field(default_factory=dict)   # peak lr per arm (objective, "whole", "one_block")
    train_windows: int = 256        # windows of the TRAINING bytes every chain and reference is also scored on
    lr_schedule: str = "constant"   # "cosine": every arm decays to a tenth of its peak over its own budget

    @classmethod
    def tiny(cls) -> "PipelineBenchSettings":
        return cls(overrides=list(TINY_CONFIG), plan=[0, 1, 1], train_s=10.0, eval_windows=8, gen_bytes=4,
                   delay_ms=5.0, average_every=5, preset="tiny")

    @classmethod
    def h200(cls, device: str = "cuda") -> "PipelineBenchSettings":
        """bf16 on one H200 (every worker on it), at most 8 minutes by :func:`plan_seconds`; 32 bytes served
        (an autoregressive traversal costs 4 hops x 2 x 25 ms, whatever the device)."""
        return cls(overrides=list(H200_CONFIG), train_s=30.0, eval_windows=1024, gen_bytes=32, delay_ms=25.0,
                   average_every=20, compression="fp16", inflight=8, device=device, preset="h200")

    def validate(self, cfg: ModelConfig) -> None:
        if sorted(set(self.plan)) != list(range(cfg.n_blocks)):
            raise ValueError(f"the layout {self.plan} must hold every block of {cfg.n_blocks}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.train_s <= 0 or self.eval_windows < 1:
            raise ValueError("--train-seconds and --eval-windows must be positive")
        if "paper" in self.objectives and self.gen_bytes > cfg.seq_len - 1:
            raise ValueError(f"paper generates at most seq_len-1 = {cfg.seq_len - 1} bytes in one sweep; "
                             f"--gen-bytes is {self.gen_bytes}")
        for o in self.objectives:
            get_objective(cfg.replace(objective=o))   # a clear error for an unknown name
        unknown = sorted(set(self.lrs) - set(self.arms()))
        if unknown or not all(v > 0 for v in self.lrs.values()):
            raise ValueError(f"a learning rate per arm: arms are {', '.join(self.arms())}, got "
                             f"{', '.join(f'{k}={v:g}' for k, v in self.lrs.items())}")
        if self.train_windows < 0:
            raise ValueError("--train-windows must be >= 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"--lr-schedule must be constant or cosine, got {self.lr_schedule!r}")

    def base_config(self) -> ModelConfig:
        """The config every arm shares (each network adds its objective): the overrides and the seed's init."""
        sets = [*self.overrides, *([f"init_seed={self.seed}"] if self.seed else [])]
        return ModelConfig.from_dict(typed_settings(sets), source="bench pipeline config")

    def arms(self) -> list[str]:
        """Everything this run trains, each with its own learning rate: the objectives' networks, then the
        references (``one_block`` is one process, scored at the CPU budget and after the wall time)."""
        return [*self.objectives, *(["whole"] if self.references and self.whole_reference else []),
                *(["one_block"] if self.references else [])]


def _peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _slug(name: str) -> str:
    return name.replace("-", "")


class _Network:
    """One objective's training network: start (last block first), train for a wall time, stop."""

    def __init__(self, objective: str, s: PipelineBenchSettings, base: Path, data_used: str):
        self.objective, self.s, self.base = objective, s, base / _slug(objective)
        self.sets = [*s.overrides, f"objective={objective}", *([f"init_seed={s.seed}"] if s.seed else []),
                     *([f"lr={s.lrs[objective]!r}"] if objective in s.lrs else [])]
        self.cfg = ModelConfig.from_dict(typed_settings(self.sets), source="bench pipeline config")
        extra = ["--device", s.device, "--seed", str(s.seed), "--average-every", str(s.average_every),
                 "--average-clock", repr(float(s.average_clock)), "--checkpoint-every", str(10**9),
                 "--pipeline-inflight", str(s.inflight), "--pipeline-compression", s.compression,
                 "--pipeline-timeout", repr(float(s.timeout_s)), "--pipeline-timeout-max", repr(float(s.timeout_max_s)),
                 "--pipeline-weight-stash" if s.weight_stash else "--no-pipeline-weight-stash"]
        if s.flush:
            extra += ["--pipeline-flush", "--pipeline-accumulate", str(s.inflight)]
        if s.recompute:
            extra += ["--pipeline-recompute"]
        if s.layer_checkpoint:
            extra += ["--pipeline-layer-checkpoint"]
        if s.lr_schedule == "cosine":   # each worker decays over the bench's wall time, from its first step
            extra += ["--lr-decay-seconds", repr(float(s.train_s))]
        self.swarm = LocalSwarm(self.base, run_id=f"bench-{_slug(objective)}", overrides=self.sets, data=data_used,
                                extra_args=extra)
        self.order = sorted(range(len(s.plan)), key=lambda i: -s.plan[i])   # workers, highest block first
        self.blocks: list[int] = []                                           # block of swarm.nodes[i]

    def train(self, say: Callable[[str], None]) -> dict:
        s = self.s
        with _env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
            # each worker draws the windows of stream i (its place in the layout) with --seed: a rerun with the
            # same seed trains on the same windows (by default a node's stream comes from its random peer id)
            first = self.order[0]
            self.swarm.start_seed(block=s.plan[first], args=["--data-stream", str(first)])
            self.blocks.append(s.plan[first])
            for i in self.order[1:]:
                self.swarm.start_join(block=s.plan[i], wait=False, args=["--data-stream", str(i)])
                self.blocks.append(s.plan[i])
            for nd in self.swarm.nodes[1:]:
                nd.wait_ready(timeout=240)
        client = self._curve_client() if s.curve_every > 0 else None
        try:
            start = self._poll()
            t0, cpu0 = time.time(), self._cpu()
            say(f"{self.objective}: {len(self.blocks)} workers up; training {s.train_s:.0f}s")
            next_curve = s.curve_every
            while time.time() - t0 < s.train_s:
                time.sleep(min(2.0, max(0.1, s.train_s - (time.time() - t0))))
                now = self._poll()
                if client is not None and time.time() - t0 >= next_curve:
                    next_curve += s.curve_every
                    self._curve_point(client, t0, cpu0, [b["self"]["step"] - a["self"]["step"] for a, b in zip(start, now)])
            end, seconds, cpu1 = self._poll(), time.time() - t0, self._cpu()
        finally:
            if client is not None:
                client.close()
        mets = [_metrics(nd) for nd in self.swarm.nodes]
        mem = [_peak_rss_mib(nd.proc.pid) for nd in self.swarm.nodes]
        # graceful: every worker writes its final checkpoint. A loaded 2-core machine can take over 40 s to
        # finish the in-flight micro-batches and write it; a worker killed first leaves none (an error below)
        self.swarm.stop_all(timeout=STOP_GRACE_S)
        return self._report(start, end, mets, mem, seconds, [_diff(a, b) for a, b in zip(cpu0, cpu1)])

    def _cpu(self) -> list[tuple[float, float] | None]:
        return [_cpu_s(nd.proc.pid) for nd in self.swarm.nodes]

    def _curve_client(self):
        from blocktrain.node.client import NetworkClient
        self.curve: list[dict] = []
        return NetworkClient([self.swarm.seed_maddr], self.swarm.run_id)

    def _curve_point(self, client, t0: float, cpu0: list, steps: list[int]) -> None:
        """Export the chain now (one live holder per block) for scoring after training; a failed export is
        recorded and skipped. ``steps``: each worker's optimizer steps so far (as last polled, <= 2 s old)."""
        wall, cpu = time.time() - t0, [_diff(a, b) for a, b in zip(cpu0, self._cpu())]
        out = self.base / "curve" / f"{len(self.curve):03d}"
        try:
            client.export(out, timeout=60)
            self.curve.append({"wall_s": round(wall, 1), "cpu_s": _spread([c[0] for c in cpu if c])["mean"],
                               "steps": _spread(steps), "dir": str(out)})
        except Exception as e:   # noqa: BLE001 (a loaded machine: the point is lost, the run goes on)
            self.curve.append({"wall_s": round(wall, 1), "error": f"{type(e).__name__}: {e}"})

    def _poll(self) -> list[dict]:
        out = []
        for nd in self.swarm.nodes:
            if not nd.alive:
                raise RuntimeError(f"{self.objective}: node {nd.name} died:\n{nd.tail()}")
            out.append(nd.get("/v1/status", timeout=30))
        return out

    def _report(self, start, end, mets, mem, seconds, cpu) -> dict:
        T = self.cfg.seq_len
        workers = []
        for nd, b, st0, st, m, rss, c in zip(self.swarm.nodes, self.blocks, start, end, mets, mem, cpu):
            pipe, pipe0 = st["self"].get("pipeline") or {}, st0["self"].get("pipeline") or {}
            steps = st["self"]["step"] - st0["self"]["step"]
            t1, t0 = pipe.get("times_s") or {}, pipe0.get("times_s") or {}
            sent = int(m.get("pipeline_wire_bytes_sent_total", 0) + st["averaging"].get("bytes_sent", 0))
            workers.append({
                "name": nd.name, "block": b, "data_stream": (st["self"].get("data") or {}).get("stream"),
                "steps": steps, "lr_last": st["self"].get("lr"),
                "windows": st["self"]["samples_seen"] - st0["self"]["samples_seen"],
                "tokens": (st["self"]["samples_seen"] - st0["self"]["samples_seen"]) * T,
                "bytes_sent": sent, "bytes_sent_per_step": sent / steps if steps else None,
                "pipeline_bytes_sent": int(m.get("pipeline_wire_bytes_sent_total", 0)),
                # the node's pipeline calls and activation bytes since it started, resends included
                "pipeline_calls_out": (pipe.get("traffic") or {}).get("calls_out"),
                "activation_bytes_sent": (pipe.get("traffic") or {}).get("activation_bytes_sent"),
                "averaging_bytes_sent": int(st["averaging"].get("bytes_sent", 0)),
                "averaging_rounds_ok": st["averaging"]["succeeded"], "peak_rss_mib": rss,
                "cpu_s": c and round(c[0], 2), "cpu_s_with_children": c and round(c[1], 2),
                "stalled_s": pipe.get("stalled_s"), "lost": pipe.get("lost"), "completed": pipe.get("completed"),
                "failed_calls": pipe.get("failed_calls"), "retried_same": pipe.get("retried_same"),
                "recomputed": pipe.get("recomputed"),
                "recomputed_stashed": pipe.get("recomputed_stashed"),
                "resent_recomputed": pipe.get("resent_recomputed"), "lost_by_reason": pipe.get("lost_by_reason"),
                "window_steps_deferred": pipe.get("window_steps_deferred"),
                "window_steps_forced": pipe.get("window_steps_forced"),
                "failed_downstream": pipe.get("failed_downstream"), "routed_unannounced": pipe.get("routed_unannounced"),
                "peak_weight_stash_bytes": pipe.get("peak_weight_stash_bytes"),
                "expired_in_queue": pipe.get("expired_in_queue"), "budget": pipe.get("budget"),
                "s_per_step": round(seconds / steps, 4) if steps else None,
                "compute_s": _delta(pipe, pipe0, "compute_s"),
                "times_s": {k: round(v - t0.get(k, 0.0), 3) for k, v in t1.items()},
                "ckpt": str(nd.workdir / "ckpt"),
            })
        per_block = {b: sum(w["tokens"] for w in workers if w["block"] == b) / seconds
                     for b in range(self.cfg.n_blocks)}
        total = sum(w["bytes_sent"] for w in workers)
        steps = sum(w["steps"] for w in workers)
        return {"objective": self.objective, "config": self.cfg.to_dict(), "workers": workers,
                "train_wall_s": round(seconds, 1),
                "tokens_per_s_by_block": per_block, "tokens_per_s": min(per_block.values()),
                "windows_block0": sum(w["windows"] for w in workers if w["block"] == 0),
                "bytes_sent_total": total, "bytes_sent_per_worker_per_step": total / steps if steps else None,
                "peak_rss_mib_max": max((w["peak_rss_mib"] or 0) for w in workers),
                "stalled_s_total": sum(w["stalled_s"] or 0 for w in workers),
                "microbatches_lost": sum(w["lost"] or 0 for w in workers),
                "microbatches_completed": sum(w["completed"] or 0 for w in workers),
                "cpu_s_per_worker": _spread([w["cpu_s"] for w in workers if w["cpu_s"] is not None]),
                "cpu_s_per_worker_with_children": _spread([w["cpu_s_with_children"] for w in workers
                                                           if w["cpu_s_with_children"] is not None]),
                "curve": getattr(self, "curve", [])}


def _delta(end: dict, start: dict, key: str) -> float | None:
    """A counter's growth over the training window (None when the worker does not report it)."""
    return None if end.get(key) is None else round(end[key] - (start.get(key) or 0.0), 3)


def _score_curve(obj, cfg: ModelConfig, curve: list[dict], windows: torch.Tensor) -> None:
    """Score each exported chain of ``curve`` (in place: ``ce``) on ``windows``' device and drop its files."""
    for pt in curve:
        if "dir" not in pt:
            continue
        d = Path(pt.pop("dir"))
        chain = []
        for b in range(cfg.n_blocks):
            m = obj.build_block(b)
            m.load_state_dict(ckpt.load_block(d / ckpt.block_filename(b), expected_config_hash=cfg.config_hash,
                                              expected_block=b).tensors)
            chain.append(m.to(windows.device).eval())
        pt["ce"] = obj.score(obj.local_hops(chain), windows, k=2, generator=torch.Generator().manual_seed(0)).ce
        shutil.rmtree(d, ignore_errors=True)


def _load_chains(cfg: ModelConfig, workers: list[dict], device: torch.device) -> list[list[torch.nn.Module]]:
    """The trained blocks on ``device``, one chain per replica index (the last replica where a block has fewer)."""
    obj = get_objective(cfg)
    by_block: dict[int, list[torch.nn.Module]] = {}
    for w in workers:
        if not (Path(w["ckpt"]) / ckpt.block_filename(w["block"])).exists():
            raise RuntimeError(f"{w['name']} (block {w['block']}) left no final checkpoint in {w['ckpt']} (its "
                               f"node.log beside it says why; it had {STOP_GRACE_S:.0f} s to leave after SIGTERM)")
        c = ckpt.load_block(Path(w["ckpt"]) / ckpt.block_filename(w["block"]), expected_config_hash=cfg.config_hash,
                            expected_block=w["block"])
        m = obj.build_block(w["block"])
        m.load_state_dict(c.tensors)
        by_block.setdefault(w["block"], []).append(m.to(device).eval())
    n = max(len(v) for v in by_block.values())
    return [[by_block[b][min(r, len(by_block[b]) - 1)] for b in range(cfg.n_blocks)] for r in range(n)]


def _serve(cfg: ModelConfig, sets: list[str], chain_ckpts: list[str], s: PipelineBenchSettings, base: Path,
           data_used: str, prompt: bytes) -> dict:
    """One holder per block, restarted from the trained checkpoints with injected delay; one generation in
    ``one_sweep``, each objective's fastest mode (one traversal per byte for an autoregressive chain, per
    chunk for ``pipeline-chunked``, one in all for ``paper``); traversals as the route counted them."""
    obj = get_objective(cfg)
    mode = "one_sweep"
    swarm = LocalSwarm(base, run_id=f"serve-{_slug(obj.name)}", overrides=sets, data=data_used,
                       extra_args=["--device", s.device, "--max-steps", "0", "--average-every", str(10**9),
                                   "--average-period", "1e9", "--average-clock", "0", "--inject-delay-ms", repr(float(s.delay_ms))])
    for b, src in enumerate(chain_ckpts):
        d = base / f"node{b}" / "ckpt"
        d.mkdir(parents=True, exist_ok=True)
        for f in Path(src).glob(Path(ckpt.block_filename(b)).stem + ".*"):   # the block and its optimizer state
            shutil.copy(f, d / f.name)
        ckpt.save_config(d, cfg)
    client = None
    try:
        with _env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
            swarm.start_chain(list(range(cfg.n_blocks)), timeout=240)
        from blocktrain.node.client import NetworkClient
        client = NetworkClient([swarm.seed_maddr], swarm.run_id)
        client.generate(prompt, 1, mode)                      # dial every holder once
        t0 = time.perf_counter()
        out = client.generate(prompt, s.gen_bytes, mode)
        wall = time.perf_counter() - t0
        return {"mode": mode, "bytes": out["bytes_generated"], "traversals": out["traversals"],
                "bytes_per_traversal": out["bytes_generated"] / max(1, out["traversals"]),
                "latency_s": round(wall, 3), "hops_per_traversal": cfg.n_blocks,
                "injected_delay_floor_s": out["traversals"] * cfg.n_blocks * 2 * s.delay_ms / 1000}
    finally:
        if client is not None:
            client.close()
        swarm.stop_all()


def run_bench_pipeline(s: PipelineBenchSettings, *, workdir: str | None = None,
                       on_progress: Callable[[str], None] | None = None) -> dict:
    say = on_progress or (lambda _msg: None)
    base_cfg = s.base_config()
    s.validate(base_cfg)
    own_dir = workdir is None
    base = Path(workdir or tempfile.mkdtemp(prefix="bt-bench-pipeline-"))
    split, data_used = resolve_default(s.data, base_cfg.seq_len, base)
    windows = eval_windows(split.eval, base_cfg.seq_len, s.eval_windows)
    train_w = eval_windows(split.train, base_cfg.seq_len, s.train_windows) if s.train_windows else None
    prompt = bytes(windows[0, :16].tolist())
    # every chain is scored on the workers' device (cuda: the same bf16 autocast as the references and
    # `bench quality`); the references' processes get the CPU copies
    dev = torch.device(s.device)
    windows_d = windows.to(dev)
    train_wd = None if train_w is None else train_w.to(dev)
    t_start, runs = time.time(), {}
    try:
        for name in s.objectives:
            net = _Network(name, s, base, data_used)
            obj, cfg = get_objective(net.cfg), net.cfg
            g = torch.Generator
            ce_init = obj.score(obj.local_hops([m.to(dev) for m in init_blocks(cfg)]), windows_d, k=2,
                                generator=g().manual_seed(0)).ce
            try:
                r = net.train(say)
            finally:
                net.swarm.stop_all()
            chains = _load_chains(cfg, r["workers"], dev)
            ces = [obj.score(obj.local_hops(c), windows_d, k=2, generator=g().manual_seed(0)).ce for c in chains]
            per_window = np.mean([per_window_chain_ce(obj, c, windows_d, k=2)[0] for c in chains], axis=0)
            r.update(chain_ce=sum(ces) / len(ces), chain_ce_by_replica=ces, chain_ce_init=ce_init,
                     ce_kind=obj.ce_kind, chain_ce_per_window=[round(float(x), 6) for x in per_window])
            if train_wd is not None:   # protocol v2: train CE beside held-out CE (how far each arm overfits)
                tr = [obj.score(obj.local_hops(c), train_wd, k=2, generator=g().manual_seed(0)).ce for c in chains]
                r["chain_ce_train"] = sum(tr) / len(tr)
            _score_curve(obj, cfg, r["curve"], windows_d[:s.curve_windows])
            if s.curve_every > 0:   # the end of the curve: the final chains, on the curve's windows
                end = [obj.score(obj.local_hops(c), windows_d[:s.curve_windows], k=2, generator=g().manual_seed(0)).ce
                       for c in chains]
                r["curve"].append({"wall_s": r["train_wall_s"], "cpu_s": r["cpu_s_per_worker"]["mean"],
                                   "steps": _spread([w["steps"] for w in r["workers"]]),
                                   "ce": sum(end) / len(end), "final": True})
            first = {}
            for w in r["workers"]:
                first.setdefault(w["block"], w["ckpt"])
            say(f"{name}: chain CE {r['chain_ce']:.4f} (untrained {ce_init:.4f})")
            r["serving"] = None
            if s.serving:
                say(f"{name}: serving {s.gen_bytes} bytes")
                r["serving"] = _serve(cfg, net.sets, [first[b] for b in range(cfg.n_blocks)], s,
                                      base / f"serve-{_slug(name)}", data_used, prompt)
                say(f"{name}: {r['serving']['traversals']} traversals, {r['serving']['latency_s']:.2f}s")
            runs[name] = r
        refs = _references(s, base_cfg, data_used, windows, runs, say, train_w) if s.references else {}
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)
    shared = {k: v for k, v in base_cfg.to_dict().items() if k != "objective"}   # each run's own: runs[o]["config"]
    return {"bench": "pipeline", "protocol": split.protocol, "data": data_used, "config": shared,
            "lr_by_arm": {a: s.lrs.get(a, base_cfg.lr) for a in s.arms()},
            "train_windows": 0 if train_w is None else len(train_w),
            "settings": asdict(s), "ln256": math.log(256), "runs": runs, "references": refs, "seconds": round(time.time() - t_start, 1),
            "method": ("equal wall time per objective from the moment all workers are up; chain CE offline from the "
                       "workers' final checkpoints on the same held-out windows, mean over replica chains; tokens/s: "
                       "the slowest block's; CPU: node process user+system time in the window (/proc); bytes: pipeline RPC and averaging messages each worker sent (protobuf "
                       "payloads; libp2p framing not included); memory: node process VmHWM; serving: one holder per "
                       "block with --inject-delay-ms, one one_sweep generation after a 1-byte warm-up")}


def _references(s: PipelineBenchSettings, cfg: ModelConfig, data_used: str, windows: torch.Tensor, runs: dict,
                say: Callable[[str], None], train_w: torch.Tensor | None = None) -> dict:
    """Whole-size model end to end at the ``pipeline`` network's tokens (else the first run's); one-block model
    alone, scored at the CPU-seconds one of that network's workers used (mean), at its curve points, and (with
    ``wall_reference``) after the same wall time. Each in a fresh one-thread process (``bench/pipeline_refs.py``)."""
    src = "pipeline" if "pipeline" in runs else next(iter(runs))
    n = max(1, runs[src]["windows_block0"])
    spread = runs[src]["cpu_s_per_worker"]
    marks = [p["cpu_s"] for p in runs[src]["curve"] if "ce" in p]
    say((f"references: whole-size model on {n} windows ({src}'s block 0); " if s.whole_reference else "references: ")
        + f"one-block model to {spread['mean']:.0f} CPU-s (one {src} worker's mean)"
        + (f" and {s.train_s:.0f}s of wall time" if s.wall_reference else ""))
    refs = {}
    sched = s.lr_schedule
    if s.whole_reference:
        refs["whole"] = train_reference({**cfg.to_dict(), "lr": s.lrs.get("whole", cfg.lr)}, data_used,
                                        cfg.reference_layers, windows, windows_n=n, device=s.device, seed=s.seed,
                                        train_w=train_w, schedule=sched)
        refs["whole"]["tokens_matched_to"] = src
    one_cfg = {**cfg.to_dict(), "lr": s.lrs.get("one_block", cfg.lr)}
    both = s.wall_reference and sched == "constant"   # one process read twice; a decay needs one per budget
    one = train_reference(one_cfg, data_used, cfg.layers_per_block, windows,
                          seconds=s.train_s if both else None, cpu_seconds=spread["mean"], marks=marks,
                          curve_w=windows[:s.curve_windows], device=s.device, seed=s.seed, train_w=train_w,
                          schedule=sched)
    at = one.pop("at_cpu")
    same_cpu = {**at, "params": one["params"], "n_layers": one["n_layers"], "peak_rss_mib": one["peak_rss_mib"],
                "cpu_matched_to": src, "worker_cpu_s": spread, "curve": one.pop("curve"),
                "lr_schedule": one["lr_schedule"], "lr_last": one["lr_last"]}   # cosine: its budget's last step
    refs["one_block_cpu"] = same_cpu
    if both:
        refs["one_block"] = one
    elif s.wall_reference:   # cosine: a second process, decaying over the wall time
        refs["one_block"] = _one_block_wall(s, cfg, data_used, windows, train_w)
    chain = runs[src].get("chain_ce_per_window")
    for ref in refs.values():   # the chain minus each reference, window by window
        _chain_minus(ref, src, chain)

    def vs(ref: dict) -> str:
        d = ref.get("chain_minus")
        return f"; chain minus it {d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]" if d else ""
    whole = refs.get("whole")
    msg = (f"references: whole-size CE {whole['ce']:.4f} ({whole['steps']} steps{vs(whole)}), " if whole
           else "references: ") + f"one-block CE {at['ce']:.4f} at {at['cpu_s']:.0f} CPU-s ({at['steps']} steps" \
        + f"{vs(same_cpu)})"
    if s.wall_reference:   # with a cosine schedule, a process of its own (not ``one``)
        wall = refs["one_block"]
        msg += f", {wall['ce']:.4f} after {wall['train_wall_s']:.0f}s of wall time ({wall['steps']} steps{vs(wall)})"
    say(msg)
    return refs


def _one_block_wall(s: PipelineBenchSettings, cfg: ModelConfig, data_used: str, windows: torch.Tensor,
                    train_w: torch.Tensor | None) -> dict:
    """The one-block model alone for ``s.train_s`` of wall time (one thread, a core to itself), its schedule
    decaying over that time, in a process of its own."""
    ref = train_reference({**cfg.to_dict(), "lr": s.lrs.get("one_block", cfg.lr)}, data_used, cfg.layers_per_block,
                          windows, seconds=s.train_s, device=s.device, seed=s.seed, train_w=train_w,
                          schedule=s.lr_schedule)
    ref.pop("at_cpu")
    ref.pop("curve")
    return ref


def _chain_minus(ref: dict, src: str, chain: list[float] | None) -> None:
    if chain and len(chain) >= 2:   # the same windows: paired_bootstrap refuses arrays of unequal length
        ref["chain_minus"] = {"chain": src, **paired_bootstrap(chain, ref["per_window"]).to_dict()}


def add_wall_reference(rec: dict, *, on_progress: Callable[[str], None] | None = None) -> dict:
    """A recorded run's missing one-block reference after the same wall time (``--no-wall-reference`` left it
    out: at 80 minutes it costs 80 more): trained now, in a fresh one-thread process with the record's own
    config, data, seed, learning rate and schedule, scored on the same held-out (and training) windows, and
    compared with the recorded chain window by window. Returns a new record with ``references.one_block``
    (marked ``trained_apart``); ``rec`` is not changed. Run it with the machine to itself, as the bench would."""
    say = on_progress or (lambda _msg: None)
    missing = [k for k in ("settings", "data", "protocol", "runs") if not rec.get(k)]
    if missing:
        raise ValueError(f"the record has no {', '.join(missing)}: not one `bench pipeline --record` wrote")
    if (rec.get("references") or {}).get("one_block"):
        raise ValueError("the record already has the one-block reference after the same wall time")
    names = {f.name for f in fields(PipelineBenchSettings)}
    s = PipelineBenchSettings(**{k: v for k, v in rec["settings"].items() if k in names})
    cfg = s.base_config()   # the run's own: the reference must train what the bench would have
    if s.device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"the run trained on {s.device}: no CUDA device here")
    src = "pipeline" if "pipeline" in rec["runs"] else next(iter(rec["runs"]))
    chain = rec["runs"][src].get("chain_ce_per_window")
    if not isinstance(chain, list) or len(chain) != s.eval_windows or len(chain) < 2:
        raise ValueError(f"the record's {src} chain has no CE for each of its {s.eval_windows} held-out windows")
    data_used = rec["data"]   # the source the run resolved, never "auto"
    split = resolve_data(data_used, seq_len=cfg.seq_len)
    if split.protocol != rec["protocol"]:
        raise ValueError(f"{data_used} reads as protocol {split.protocol} here; the record's is {rec['protocol']}")
    windows = eval_windows(split.eval, cfg.seq_len, s.eval_windows)
    n_train = rec.get("train_windows", s.train_windows)
    train_w = eval_windows(split.train, cfg.seq_len, n_train) if n_train else None
    say(f"one-block model alone for {s.train_s:.0f}s of wall time (seed {s.seed}, lr "
        f"{s.lrs.get('one_block', cfg.lr):g}, {s.lr_schedule}) on {data_used}")
    ref = _one_block_wall(s, cfg, data_used, windows, train_w)
    ref["trained_apart"] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "chain_recorded": rec.get("date")}
    _chain_minus(ref, src, chain)
    d = ref.get("chain_minus")
    say(f"one-block CE {ref['ce']:.4f} after {ref['train_wall_s']:.0f}s ({ref['steps']} steps); chain minus it "
        f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]")
    out = copy.deepcopy(rec)
    out.setdefault("references", {})["one_block"] = ref
    out["settings"]["wall_reference"] = True
    return out


def plan_seconds(s: PipelineBenchSettings) -> dict:
    """A preset's planned wall time: per objective start-up/shutdown + training + scoring + serving (measured
    floor: traversals x hops x 2 x delay, plus a start-up), then both references (the whole-size one at most
    ``train_s``: it runs at least as fast per window as the network it matches). Assumed constants above."""
    cfg = ModelConfig.from_dict(typed_settings(list(s.overrides)), source="bench pipeline config")
    per = {}
    for o in s.objectives:
        trav = 1 if o == "paper" else (math.ceil(s.gen_bytes / cfg.chunk_len) if o == "pipeline-chunked"
                                       else s.gen_bytes) + 1
        serve = STARTUP_S + trav * cfg.n_blocks * 2 * s.delay_ms / 1000 if s.serving else 0.0
        per[o] = STARTUP_S + s.train_s + SCORE_S + serve
    two = s.wall_reference and s.lr_schedule == "cosine"   # the one-block reference: one process per budget
    refs = ((s.train_s if s.wall_reference else s.train_s / 2) + (s.train_s / 2 + SCORE_S if two else 0.0)
            + 2 * SCORE_S + (s.train_s if s.whole_reference else 0.0)) if s.references else 0.0
    return {"per_objective_s": per, "references_s": refs, "total_s": sum(per.values()) + refs}
