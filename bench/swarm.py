"""``bt-node bench swarm``: gossip-averaged replicas vs one worker per block, at equal per-block steps.

(Over 400 lines on purpose: a run's lifecycle (``_Run``: launch, equal starting weights, final round,
scoring through the network) and the driver that compares runs read best in one file.)

Each *run* is a real local network of ``bt-node seed|join`` processes on 127.0.0.1 (one torch
thread each):

* ``baseline``: one worker per block, averaging off;
* ``avg-fp32`` / ``avg-fp16`` / ``avg-8bit``: the averaged layout (default: 6 workers over 4 blocks,
  blocks 1 and 2 held twice) with gossip averaging every ``average_every`` local steps, the
  all-reduce sending fp32, fp16 or 8-bit values (``--averaging-compression``).

Equal per-block steps: before a run starts, every worker's checkpoint directory gets the same
step-0 initial block (so no replica inherits another's step count by downloading its state), and
every worker runs with ``--max-steps N``: each one takes exactly N local optimizer steps. The run
ends when all have; the chain is then scored on the SAME held-out windows of the evaluation split
for every run (through the network, one chain per replica choice, the mean reported), with the
same starting-noise seed.

Bytes: every averager process counts the serialized protobuf bytes of every message it writes to
or reads from a libp2p stream (matchmaking, all-reduce parts, state sharing; measured, not
computed; libp2p's own framing/encryption, TCP/IP headers and DHT records not included). Hop RPC
bytes come from the node's RPC counters (``/metrics``). The analytic all-reduce payload
(2 (g-1)/g x parameters x bytes per value, per formed round of g peers) is reported next to the
measurement as a cross-check.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.windows import eval_windows
from blocktrain.blocks.objectives import get_objective
from blocktrain.blocks.default_data import resolve_default
from blocktrain.node.http.jobs import run_job
from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.node.swarm.run import typed_settings

AVERAGED_FP16_BYTES_TARGET = 0.55     # issue 5: fp16 averaging moves <= 0.55x the bytes of fp32 ...
AVERAGED_FP16_CE_TARGET = 0.01        # ... with CE within 0.01
AVERAGED_CE_GOAL = 0.05               # averaged CE within 0.05 of one-worker-per-block (paper +0.026)
BYTES_PER_VALUE = {"fp32": 4.0, "fp16": 2.0, "8bit": 1.0}
PAPER = {"chain_ce_one_worker_per_block": 1.359, "chain_ce_six_workers_averaged": 1.385, "delta": 0.026}

FULL_CONFIG = ["d_model=96", "n_heads=4", "layers_per_block=2", "n_blocks=4", "seq_len=128",
               "target_dim=16", "batch_size=16", "warmup_steps=30", "lr=0.002"]
TINY_CONFIG = ["d_model=32", "n_heads=2", "layers_per_block=1", "n_blocks=2", "seq_len=32",
               "target_dim=8", "batch_size=4", "warmup_steps=5", "lr=0.002"]


@dataclass
class SwarmBenchSettings:
    overrides: list[str] = field(default_factory=lambda: list(FULL_CONFIG))
    averaged_plan: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 1, 2])   # block per worker
    max_steps: int = 200
    average_every: int = 10
    compressions: list[str] = field(default_factory=lambda: ["fp32", "fp16", "8bit"])
    eval_windows: int = 64
    k: int = 2
    curve_windows: int = 16
    curve_every_s: float = 20.0
    max_wait_s: float = 900.0
    data: str = "auto"
    threads_per_worker: int = 1
    concurrent: bool = False        # run all networks at once (tiny mode: saves start-up time)

    @classmethod
    def tiny(cls) -> "SwarmBenchSettings":
        return cls(overrides=list(TINY_CONFIG), averaged_plan=[0, 1, 1], max_steps=40, average_every=5,
                   compressions=["fp32"], eval_windows=8, k=1, curve_windows=4, curve_every_s=1e9,
                   max_wait_s=150.0, concurrent=True)


@contextlib.contextmanager
def _env(**values: str):
    """Environment for the node processes started inside (their torch thread count)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def init_blocks(cfg: ModelConfig) -> list[torch.nn.Module]:
    """Every block exactly as a node's trainer initialises it (seed init_seed + block)."""
    obj = get_objective(cfg)
    out = []
    for b in range(cfg.n_blocks):
        torch.manual_seed(cfg.init_seed + b)
        out.append(obj.build_block(b))
    return out


def _write_init(ckpt_dir: Path, cfg: ModelConfig, blocks, b: int) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt.save_config(ckpt_dir, cfg)
    ckpt.save_block(ckpt_dir / ckpt.block_filename(b), blocks[b].state_dict(), config=cfg, block_index=b,
                    step=0, samples_seen=0)


def _metrics(node) -> dict[str, float]:
    import httpx
    r = httpx.get(node.url + "/metrics", timeout=15)
    r.raise_for_status()
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.partition(" ")
            out[name.removeprefix("blocktrain_")] = float(v)
    return out


class _Run:
    """One local network of the benchmark: start, poll, score, stop."""

    def __init__(self, name: str, plan: list[int], averaging: bool, compression: str, cfg: ModelConfig,
                 sets: list[str], s: SwarmBenchSettings, base: Path, data_used: str, init):
        self.name, self.plan, self.averaging, self.compression = name, plan, averaging, compression
        self.cfg, self.s, self.base = cfg, s, base / name
        every = s.average_every if averaging else 10**9
        extra = ["--device", "cpu", "--max-steps", str(s.max_steps), "--average-every", str(every),
                 "--average-period", "1e9", "--checkpoint-every", str(10**9),
                 *([] if averaging else ["--average-clock", "0"]),   # an arm without averaging has none at all
                 "--averaging-compression", compression]
        self.swarm = LocalSwarm(self.base, run_id=f"bench-{name}", overrides=sets, data=data_used,
                                extra_args=extra)
        for i, b in enumerate(plan):
            _write_init(self.base / f"node{i}" / "ckpt", cfg, init, b)
        self.client = None
        self.curve: list[dict] = []
        self.t_launch = self.t_ready = self.t_first_ready = self.t_done = None
        self.statuses: list[dict] = []
        self.metrics: list[dict] = []
        self.final_rounds: list[dict] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def launch(self) -> None:
        self.t_launch = time.time()
        with _env(OMP_NUM_THREADS=str(self.s.threads_per_worker), MKL_NUM_THREADS=str(self.s.threads_per_worker)):
            self.swarm.start_seed(block=self.plan[0])
            self.t_first_ready = time.time()
            for b in self.plan[1:]:
                self.swarm.start_join(block=b, wait=False)

    def wait_ready(self) -> None:
        for nd in self.swarm.nodes[1:]:
            nd.wait_ready(timeout=240)
        self.t_ready = time.time()
        from blocktrain.node.client import NetworkClient
        self.client = NetworkClient([self.swarm.seed_maddr], self.swarm.run_id)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self.swarm.stop_all()

    # -- measuring --------------------------------------------------------------------------------
    def poll(self) -> list[dict]:
        out = []
        for nd in self.swarm.nodes:
            if not nd.alive:
                raise RuntimeError(f"{self.name}: node {nd.name} died:\n{nd.tail()}")
            out.append(nd.get("/v1/status", timeout=30))
        return out

    def wait_rounds_idle(self, timeout: float = 60.0) -> None:
        """Let rounds still running (the one every worker starts at its last step) finish first."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            busy = [st for st in self.poll() if st["averaging"]["attempted"] > sum(
                st["averaging"][k] for k in ("succeeded", "rejected", "failed"))]
            if not busy:
                return
            time.sleep(1.0)

    def final_round(self, attempts: int = 3) -> list[dict]:
        """One explicit averaging round for every replicated block once all workers are done
        (POST /v1/average on all replicas at once, each a job polled to its end; a block whose round
        did not form is retried)."""
        import threading
        groups: dict[int, list] = {}
        for nd, b in zip(self.swarm.nodes, self.plan):
            groups.setdefault(b, []).append(nd)
        todo = {b: nds for b, nds in groups.items() if len(nds) > 1}
        log = []
        for attempt in range(attempts):
            if not todo:
                break
            verdicts: dict[str, dict] = {}

            def ask(nd):
                try:
                    job = run_job(nd.url, "/v1/average", timeout=120)   # an operator job: 202, then poll
                    verdicts[nd.name] = job["result"] if job["status"] == "done" else \
                        {"accepted": None, "reason": f"averaging job failed: {job['error']}"}
                except Exception as e:  # reported, retried
                    verdicts[nd.name] = {"accepted": None, "reason": f"{type(e).__name__}: {e}"}

            ths = [threading.Thread(target=ask, args=(nd,)) for nds in todo.values() for nd in nds]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            for b in list(todo):
                vs = [verdicts[nd.name] for nd in todo[b]]
                log.append({"block": b, "attempt": attempt + 1, "accepted": [v.get("accepted") for v in vs]})
                if all(v.get("accepted") for v in vs):
                    del todo[b]
        return log

    def steps(self, sts: list[dict]) -> list[int]:
        return [st["self"]["step"] for st in sts]

    def bytes_sent(self, sts: list[dict]) -> int:
        return sum(st["averaging"].get("bytes_sent", 0) for st in sts)

    def peers(self, replica: int) -> list[str]:
        """The chain through replica ``replica`` of every block (the last one where there are fewer)."""
        by_block: dict[int, list[str]] = {}
        for nd, b in zip(self.swarm.nodes, self.plan):
            by_block.setdefault(b, []).append(nd.info["peer_id"])
        return [by_block[b][min(replica, len(by_block[b]) - 1)] for b in range(self.cfg.n_blocks)]

    @property
    def n_chains(self) -> int:
        return max(self.plan.count(b) for b in range(self.cfg.n_blocks))

    def score(self, windows: torch.Tensor, k: int, replica: int = 0) -> float:
        from blocktrain.node.routing.hops import call_remote
        client = self.client.hop_client
        hops = [(lambda req, b=b, p=p: call_remote(client, p, b, req, timeout=20.0)[0])
                for b, p in enumerate(self.peers(replica))]
        obj = self.client.objective
        return obj.score(hops, windows, k=k, generator=torch.Generator().manual_seed(0)).ce

    def curve_point(self, windows: torch.Tensor, k: int, sts: list[dict]) -> None:
        steps = self.steps(sts)
        self.curve.append({"t": round(time.time() - self.t_first_ready, 2), "ce": self.score(windows, k),
                           "min_step": min(steps), "mean_step": sum(steps) / len(steps),
                           "bytes_sent": self.bytes_sent(sts)})

    # -- report -------------------------------------------------------------------------------------
    def report(self, final: dict[int, float], n_params: dict[int, int]) -> dict:
        sts, mets = self.statuses, self.metrics
        workers = []
        for nd, b, st, m in zip(self.swarm.nodes, self.plan, sts, mets):
            av = st["averaging"]
            hist = av.get("history", [])
            g = [h[1] for h in hist]
            expected = sum(2 * (gs - 1) / gs * n_params[b] * BYTES_PER_VALUE[self.compression] for gs in g if gs > 1)
            workers.append({
                "name": nd.name, "block": b, "peer_id": nd.info["peer_id"], "steps": st["self"]["step"],
                "loss": st["self"]["loss"],
                "rounds": {k: av.get(k, 0) for k in ("attempted", "succeeded", "rejected", "failed", "partial")},
                "group_sizes": g,
                "averaging_bytes_sent": av.get("bytes_sent", 0), "averaging_bytes_received": av.get("bytes_received", 0),
                "averaging_messages_sent": av.get("messages_sent", 0),
                "allreduce_payload_bytes_analytic": int(expected),
                "rpc_bytes_sent": int(m.get("rpc_server_bytes_sent_total", 0) + m.get("rpc_client_bytes_sent_total", 0)),
                "rpc_bytes_received": int(m.get("rpc_server_bytes_received_total", 0)
                                          + m.get("rpc_client_bytes_received_total", 0)),
            })
        replicated = sorted({b for b in self.plan if self.plan.count(b) > 1})
        per_block = {}
        for b in replicated:
            ws = [w for w in workers if w["block"] == b]
            formed = [len(w["group_sizes"]) for w in ws]
            sizes = [gs for w in ws for gs in w["group_sizes"]]
            per_block[str(b)] = {
                "replicas": len(ws), "rounds_attempted": [w["rounds"]["attempted"] for w in ws],
                "rounds_formed": formed, "rounds_succeeded": [w["rounds"]["succeeded"] for w in ws],
                "mean_group_size": (sum(sizes) / len(sizes)) if sizes else 0.0,
                "participation": (sum(sizes) / len(sizes) / len(ws)) if sizes else 0.0,
                "formed_fraction": (sum(formed) / max(1, sum(w["rounds"]["attempted"] for w in ws))),
            }
        sent = sum(w["averaging_bytes_sent"] for w in workers)   # training traffic: the averagers'; each byte once
        formed_total = sum(len(w["group_sizes"]) for w in workers)
        rounds = {k: sum(w["rounds"][k] for w in workers)
                  for k in ("attempted", "succeeded", "rejected", "failed", "partial")}
        ces = [final[r] for r in sorted(final)]
        return {
            "name": self.name, "workers_n": len(self.plan), "plan": self.plan, "averaging": self.averaging,
            "compression": self.compression if self.averaging else None,
            "chain_ce": sum(ces) / len(ces), "chain_ce_by_replica": ces,
            "rounds": rounds, "rounds_by_block": per_block,
            "bytes_sent_total": sent,
            "bytes_received_total": sum(w["averaging_bytes_received"] for w in workers),
            "rpc_bytes_sent_total": sum(w["rpc_bytes_sent"] for w in workers),
            "rpc_bytes_received_total": sum(w["rpc_bytes_received"] for w in workers),
            "allreduce_payload_bytes_analytic_total": sum(w["allreduce_payload_bytes_analytic"] for w in workers),
            "averaging_bytes_sent_per_formed_round": sent / formed_total if formed_total else None,
            "gb_moved": sent / 1e9,
            "startup_s": round(self.t_ready - self.t_launch, 1),
            "train_wall_s": round(self.t_done - self.t_first_ready, 1),
            "final_rounds": self.final_rounds, "workers": workers, "curve": self.curve,
        }


def run_bench_swarm(s: SwarmBenchSettings, *, workdir: str | None = None,
                    on_progress: Callable[[str], None] | None = None) -> dict:
    say = on_progress or (lambda _msg: None)
    sets = list(s.overrides)
    cfg = ModelConfig.from_dict(typed_settings(sets), source="bench swarm config")
    if s.eval_windows > 64 or s.curve_windows > 64:
        raise ValueError("eval windows are scored in one hop batch: at most 64")
    if sorted(set(s.averaged_plan)) != list(range(cfg.n_blocks)):
        raise ValueError(f"the averaged layout {s.averaged_plan} must hold every block of {cfg.n_blocks}")
    for c in s.compressions:
        if c not in BYTES_PER_VALUE:
            raise ValueError(f"unknown compression {c!r}: use fp32, fp16 or 8bit")
    own_dir = workdir is None
    base = Path(workdir or tempfile.mkdtemp(prefix="bt-bench-swarm-"))
    split, data_used = resolve_default(s.data, cfg.seq_len, base)
    windows = eval_windows(split.eval, cfg.seq_len, s.eval_windows)
    curve_w = windows[: s.curve_windows]
    init = init_blocks(cfg)
    obj = get_objective(cfg)
    n_params = {b: sum(p.numel() for p in m.parameters()) for b, m in enumerate(init)}
    ce_init = obj.score(obj.local_hops(init), windows, k=s.k, generator=torch.Generator().manual_seed(0)).ce
    ce_init_curve = obj.score(obj.local_hops(init), curve_w, k=s.k, generator=torch.Generator().manual_seed(0)).ce

    specs = [("baseline", list(range(cfg.n_blocks)), False, "fp32")]
    specs += [(f"avg-{c}", list(s.averaged_plan), True, c) for c in s.compressions]
    t0 = time.time()
    results = {}
    groups = [specs] if s.concurrent else [[sp] for sp in specs]
    try:
        for group in groups:
            runs = [_Run(n, p, a, c, cfg, sets, s, base, data_used, init) for n, p, a, c in group]
            try:
                for r in runs:
                    say(f"{r.name}: starting {len(r.plan)} workers (blocks {r.plan})")
                    r.launch()
                for r in runs:
                    r.wait_ready()
                    r.curve.append({"t": 0.0, "ce": ce_init_curve, "min_step": 0, "mean_step": 0.0, "bytes_sent": 0})
                    say(f"{r.name}: all {len(r.plan)} workers up after {r.t_ready - r.t_launch:.0f}s")
                _train(runs, s, curve_w, say)
                for r in runs:
                    final = {i: r.score(windows, s.k, replica=i) for i in range(r.n_chains)}
                    results[r.name] = r.report(final, n_params)
                    say(f"{r.name}: chain CE {results[r.name]['chain_ce']:.4f}")
            finally:
                for r in runs:
                    r.stop()
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)
    return _summary(cfg, s, split, data_used, ce_init, n_params, results, time.time() - t0)


def _train(runs: list[_Run], s: SwarmBenchSettings, curve_w: torch.Tensor, say) -> None:
    last_curve = {r.name: time.time() for r in runs}
    last_say = 0.0
    pending = list(runs)
    while pending:
        time.sleep(1.0)
        for r in list(pending):
            sts = r.poll()
            steps = r.steps(sts)
            if min(steps) >= s.max_steps:
                r.t_done = time.time()
                r.curve_point(curve_w, s.k, sts)
                if r.averaging:
                    r.wait_rounds_idle()
                    r.final_rounds = r.final_round()
                    sts = r.poll()
                    r.curve_point(curve_w, s.k, sts)
                    r.curve[-1]["after_final_round"] = True
                r.statuses = sts
                r.metrics = [_metrics(nd) for nd in r.swarm.nodes]
                pending.remove(r)
                say(f"{r.name}: every worker at {s.max_steps} steps after {r.t_done - r.t_first_ready:.0f}s")
                continue
            if time.time() - r.t_first_ready > s.max_wait_s:
                raise TimeoutError(f"{r.name}: workers at steps {steps} after {s.max_wait_s:.0f}s "
                                   f"(target {s.max_steps}); the machine may be overloaded")
            if time.time() - last_curve[r.name] >= s.curve_every_s:
                r.curve_point(curve_w, s.k, sts)
                last_curve[r.name] = time.time()
            if time.time() - last_say >= 10:
                av = sum(st["averaging"]["succeeded"] for st in sts)
                say(f"{r.name}: steps {steps}, rounds ok {av}")
                last_say = time.time()


def _summary(cfg, s, split, data_used, ce_init, n_params, results, seconds) -> dict:
    base = results["baseline"]
    comp = {}
    for name, r in results.items():
        if name == "baseline":
            continue
        gain = ce_init - r["chain_ce"]
        r["ce_minus_baseline"] = r["chain_ce"] - base["chain_ce"]
        r["ce_gain_per_gb"] = gain / r["gb_moved"] if r["gb_moved"] > 0 else None
        comp[name] = r["ce_minus_baseline"]
    goals = {}
    if "avg-fp32" in results:
        d = results["avg-fp32"]["ce_minus_baseline"]
        goals["averaged_within_0.05"] = {"delta_ce": d, "met": d <= AVERAGED_CE_GOAL, "paper_delta": PAPER["delta"]}
        f32 = results["avg-fp32"]
        for c in ("fp16", "8bit"):
            r = results.get(f"avg-{c}")
            if r is None or not f32["averaging_bytes_sent_per_formed_round"] or not r["averaging_bytes_sent_per_formed_round"]:
                continue
            per_round = r["averaging_bytes_sent_per_formed_round"] / f32["averaging_bytes_sent_per_formed_round"]
            total = r["bytes_sent_total"] / f32["bytes_sent_total"] if f32["bytes_sent_total"] else None
            dce = r["chain_ce"] - f32["chain_ce"]
            goals[f"{c}_vs_fp32"] = {"bytes_ratio_per_round": per_round, "bytes_ratio_total": total,
                                     "delta_ce": dce,
                                     "met": per_round <= AVERAGED_FP16_BYTES_TARGET and abs(dce) <= AVERAGED_FP16_CE_TARGET}
    return {
        "bench": "swarm", "protocol": split.protocol, "data": data_used, "config": cfg.to_dict(),
        "config_hash": cfg.config_hash, "params_per_block": [n_params[b] for b in range(cfg.n_blocks)],
        "settings": asdict(s), "ce_kind": get_objective(cfg).ce_kind, "ce_init": ce_init,
        "ln256": math.log(256), "runs": results, "ce_minus_baseline": comp, "goals": goals, "paper": PAPER,
        "seconds": round(seconds, 1),
        "method": ("bytes moved: serialized protobuf bytes of every libp2p stream message each worker's averager "
                   "process sent (measured inside that process; excludes libp2p framing/encryption, TCP/IP headers "
                   "and DHT records); hop-RPC bytes (/metrics) are listed apart: during training they are the "
                   "bench's own CE probes; equal per-block steps via --max-steps "
                   "from a shared step-0 checkpoint; CE: the chain through the network on the same held-out "
                   "windows and noise seed for every run, mean over replica chains"),
    }
