"""``bt-node bench compression``: what the averaging codec alone does to quality, with nothing else varying.

``bench swarm`` measures real networks, where rounds happen whenever replicas find each other: two
runs of the same setting already differ by up to 0.03 nats/byte, more than the 0.01 the fp16 goal
asks to resolve. This benchmark removes that noise. The bench swarm's workers (same config, same
step-0 weights, same data streams and noise seeds per worker) train in ONE process, in lock step,
and every ``average_every`` steps the replicas of each block average their parameters through the
all-reduce hivemind runs, with the codec under test applied exactly where hivemind applies it:

    butterfly all-reduce over g replicas: the concatenated parameters are cut into parts and each
    replica reduces a contiguous range of them; the others send it their copy ENCODED (codec round
    trip), it averages them with its own exact copy and sends each sender back the difference
    between the average and what that sender sent, ENCODED (see ``butterfly_average``).

The codecs are hivemind's own (``Float16Compression``, ``Uniform8BitQuantization``, none). Every
run is identical but for the codec, so its chain CE difference from the fp32 run is the codec's
effect on quality and nothing else. Bytes on the wire are not simulated here: ``bench swarm``
measures those on real networks.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.windows import eval_windows
from blocktrain.blocks.objectives import get_objective
from blocktrain.p2p.averager import COMPRESSIONS, make_compression, patch_8bit_decoder
from blocktrain.p2p.offline_wire import butterfly_average
from blocktrain.bench.swarm import FULL_CONFIG, TINY_CONFIG
from blocktrain.blocks.default_data import resolve_default
from blocktrain.node.swarm.run import typed_settings
from blocktrain.node.trainer import BlockTrainer

FP16_CE_TARGET = 0.01   # issue 5: fp16 averaging within 0.01 nats/byte of fp32


@dataclass
class CompressionBenchSettings:
    overrides: list[str] = field(default_factory=lambda: list(FULL_CONFIG))
    plan: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 1, 2])   # block per worker (bench swarm's)
    steps: int = 200
    average_every: int = 10
    compressions: list[str] = field(default_factory=lambda: list(COMPRESSIONS))
    eval_windows: int = 64
    k: int = 2
    seed: int = 0
    data: str = "auto"

    @classmethod
    def tiny(cls) -> "CompressionBenchSettings":
        return cls(overrides=list(TINY_CONFIG), plan=[0, 1, 1], steps=20, average_every=5,
                   eval_windows=8, k=1)

    def validate(self, n_blocks: int) -> None:
        if self.steps < 1 or self.average_every < 1:
            raise ValueError(f"--steps and --average-every must be >= 1, got {self.steps}, {self.average_every}")
        if sorted(set(self.plan)) != list(range(n_blocks)):
            raise ValueError(f"the plan {self.plan} must hold every block 0..{n_blocks - 1}")
        bad = [c for c in self.compressions if c not in COMPRESSIONS]
        if bad:
            raise ValueError(f"unknown compression {bad[0]!r}: use {', '.join(COMPRESSIONS)}")


def _train_network(cfg: ModelConfig, s: CompressionBenchSettings, split, compression: str | None) -> list[BlockTrainer]:
    """The bench swarm's workers, trained in lock step; ``compression=None``: one worker per block, no averaging."""
    plan = s.plan if compression is not None else list(range(cfg.n_blocks))
    codec = make_compression(compression) if compression is not None else None
    workers = [BlockTrainer(cfg, b, split.train, split.eval, seed=s.seed, worker_id=w) for w, b in enumerate(plan)]
    for step in range(1, s.steps + 1):
        for w in workers:
            w.train_step()
        if codec is not None and step % s.average_every == 0:
            for b in range(cfg.n_blocks):
                group = [w for w in workers if w.block_index == b]
                if len(group) < 2:
                    continue
                averaged = butterfly_average([list(w.module.parameters()) for w in group], codec)
                with torch.no_grad():
                    for w, tensors in zip(group, averaged):
                        for p, a in zip(w.module.parameters(), tensors):
                            p.copy_(a)
    return workers


def _chain(cfg, workers: list[BlockTrainer]) -> list[torch.nn.Module]:
    """The first replica of every block (after the last round all replicas of a block agree)."""
    return [next(w for w in workers if w.block_index == b).module for b in range(cfg.n_blocks)]


def _flat(modules) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for m in modules for p in m.parameters()])


def run_bench_compression(s: CompressionBenchSettings, *, say=lambda msg: None) -> dict:
    cfg = ModelConfig.from_dict(typed_settings(s.overrides), source="bench compression config")
    s.validate(cfg.n_blocks)
    patch_8bit_decoder()
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")   # hivemind's 8-bit codec on new torch
    split, data_used = resolve_default(s.data, cfg.seq_len, _cache_dir())
    windows = eval_windows(split.eval, cfg.seq_len, s.eval_windows)
    obj = get_objective(cfg)
    t0 = time.time()
    runs: dict[str, dict] = {}
    chains: dict[str, list[torch.nn.Module]] = {}
    for name in ["baseline", *dict.fromkeys(s.compressions)]:
        say(f"training {name} ...")
        t1 = time.time()
        workers = _train_network(cfg, s, split, None if name == "baseline" else name)
        chain = _chain(cfg, workers)
        for m in chain:
            m.eval()
        ce = obj.score(obj.local_hops(chain), windows, k=s.k, generator=torch.Generator().manual_seed(0)).ce
        spread = max((float((_flat([w.module]) - _flat([chain[w.block_index]])).norm()) for w in workers), default=0.0)
        runs[name] = {"chain_ce": ce, "workers": len(workers), "replica_spread_l2": spread,
                      "seconds": round(time.time() - t1, 1)}
        chains[name] = chain
        say(f"  {name}: chain CE {ce:.4f}")
    goals = {}
    if "fp32" in chains:
        ref = _flat(chains["fp32"])
        for name in chains:
            if name in ("fp32", "baseline"):
                continue
            rel = float((_flat(chains[name]) - ref).norm() / ref.norm())
            runs[name]["weights_rel_l2_vs_fp32"] = rel
            runs[name]["delta_ce_vs_fp32"] = runs[name]["chain_ce"] - runs["fp32"]["chain_ce"]
        if "fp16" in runs:
            d = runs["fp16"]["delta_ce_vs_fp32"]
            goals["fp16_ce_within_0.01"] = {"delta_ce": d, "met": abs(d) <= FP16_CE_TARGET}
    return {
        "bench": "compression", "protocol": split.protocol, "data": data_used, "config_hash": cfg.config_hash,
        "config": cfg.to_dict(), "settings": asdict(s), "ce_kind": obj.ce_kind, "ln256": math.log(256),
        "runs": runs, "goals": goals, "seconds": round(time.time() - t0, 1), "torch_threads": torch.get_num_threads(),
        "method": ("bench swarm's workers trained in one process in lock step from the same step-0 weights, data "
                   "streams and noise seeds; every average_every steps each block's replicas average their "
                   "parameters by a simulated butterfly all-reduce that applies hivemind's codec where hivemind "
                   "does (parts sent to their reducer and reduced parts sent back are encoded and decoded); runs "
                   "differ only in the codec; chain CE of the first replica of every block on the same held-out "
                   "windows and noise (K as given)"),
    }


def _cache_dir():
    import tempfile
    from pathlib import Path
    return Path(tempfile.gettempdir()) / "blocktrain-bench-compression"
