"""``bt-node swarm``: a whole local network in one command.

Starts N real node processes on 127.0.0.1 (block 0 seeds the run, the others join; by default
every block has a holder and block 1 has two, so same-block averaging happens: every 10 steps and,
so that replicas whose steps drift apart under load still meet, at each 5 s of the wall clock:
``--average-clock 5``; CI once saw 0 rounds in a 10-s swarm without it), trains for the
budget while showing progress, then measures chain CE on held-out text and generates text
through the chain of holders, and shuts everything down (or keeps serving). Whatever ends it early
(an error, a signal that raises in the caller's thread) stops every node it started.
"""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Callable

from blocktrain.blocks.config import ModelConfig
from blocktrain.node.client import NetworkClient
from blocktrain.blocks.default_data import resolve_default
from blocktrain.node.options import NEW_RUN_OBJECTIVE
from blocktrain.node.swarm.launcher import LocalSwarm

# Small enough that 5 node processes train usefully on a 2-core laptop in two minutes.
SWARM_DEFAULTS = ["d_model=64", "n_heads=2", "layers_per_block=1", "n_blocks=4", "seq_len=64",
                  "target_dim=16", "batch_size=8", "warmup_steps=20", "lr=0.002"]


def plan_blocks(n_nodes: int, n_blocks: int) -> list[int]:
    """Block per node: one holder for every block first, then replicas from block 1 onward."""
    if n_nodes < n_blocks:
        raise ValueError(f"--nodes {n_nodes} cannot cover {n_blocks} blocks")
    extra = [1 + (i % max(1, n_blocks - 1)) if n_blocks > 1 else 0 for i in range(n_nodes - n_blocks)]
    return list(range(n_blocks)) + extra


def run_swarm(*, nodes: int | None, budget_s: float, data: str, overrides: list[str], http_port: int | None,
              keep_running: bool, workdir: str | None, prompt: bytes, gen_bytes: int,
              on_progress: Callable[[list[dict], float], None] | None = None,
              average_every: int = 10, average_clock: float = 5.0) -> dict:
    sets = [*SWARM_DEFAULTS, f"objective={NEW_RUN_OBJECTIVE}", *overrides]   # a later --set wins
    cfg = ModelConfig.from_dict(typed_settings(sets), source="swarm config")
    n = nodes or cfg.n_blocks + 1
    blocks = plan_blocks(n, cfg.n_blocks)
    base = Path(workdir or tempfile.mkdtemp(prefix="bt-swarm-"))
    split, data_used = resolve_default(data, cfg.seq_len, base)
    t_start = time.time()
    swarm = LocalSwarm(base, run_id="swarm", overrides=sets, data=data_used,
                       extra_args=["--average-every", str(average_every), "--average-clock", repr(float(average_clock)),
                                   "--device", "cpu"])
    client = None
    handed_over = False   # True once the caller owns the running swarm (keep_running)
    try:
        swarm.start_chain(blocks, seed_args=["--eval-every", "30"], http_port=http_port)
        client = NetworkClient([swarm.seed_maddr], "swarm")
        ce_start = client.chain_ce(split.eval, n_windows=16, k=2)
        t0 = time.time()
        while time.time() - t0 < budget_s:
            time.sleep(2.0)
            if on_progress:
                on_progress(_statuses(swarm), min(1.0, (time.time() - t0) / budget_s))
            dead = [nd.name for nd in swarm.nodes if not nd.alive]
            if dead:
                first = next(nd for nd in swarm.nodes if not nd.alive)
                raise RuntimeError(f"node(s) {', '.join(dead)} died:\n{first.tail()}")
        sts = _statuses(swarm)
        ce_end = client.chain_ce(split.eval, n_windows=16, k=2)
        gen = client.generate(prompt, gen_bytes, "one_sweep", seed=0)
        rounds = {}
        for s in sts:
            if s:
                b = s["self"]["block"]
                rounds[b] = max(rounds.get(b, 0), s["averaging"]["succeeded"])
        replicated = [b for b in set(blocks) if blocks.count(b) > 1]
        res = {
            "chain_ce": ce_end["chain_ce"], "chain_ce_k1": ce_end["chain_ce_k1"], "ce_kind": ce_end["ce_kind"],
            "chain_ce_start": ce_start["chain_ce"], "ln256": math.log(256),
            "averaging_rounds": sum(rounds.get(b, 0) for b in replicated),
            "averaging_rounds_by_block": {str(b): r for b, r in sorted(rounds.items())},
            "generated": gen["text"], "prompt": prompt.decode("utf-8", "replace"), "route": gen["route"],
            "nodes": [{"name": nd.name, "block": b, "peer_id": nd.info.get("peer_id"), "http": nd.url,
                       "step": (s or {}).get("self", {}).get("step")}
                      for nd, b, s in zip(swarm.nodes, blocks, sts)],
            "protocol": split.protocol, "data": data_used, "config_hash": cfg.config_hash, "objective": cfg.objective,
            "seconds": round(time.time() - t_start, 1), "train_seconds": budget_s, "workdir": str(base),
        }
        if keep_running:
            res["first_node_http"] = swarm.nodes[0].url
        handed_over = keep_running
        return res | {"_swarm": swarm if keep_running else None}
    finally:
        if client is not None:
            client.close()
        if not handed_over:
            swarm.stop_all()


def typed_settings(sets: list[str]) -> dict:
    """["key=value", ...] -> {key: value}, values parsed as JSON where they parse (numbers, bools)."""
    import json
    out = {}
    for kv in sets:
        k, v = kv.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _statuses(swarm: LocalSwarm) -> list[dict | None]:
    out = []
    for nd in swarm.nodes:
        try:
            out.append(nd.get("/v1/status", timeout=10))
        except Exception:
            out.append(None)
    return out
