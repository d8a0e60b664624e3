"""Generation and scoring through a Router: the one place both the node's API and the client use."""
from __future__ import annotations

import time

import torch

from blocktrain.blocks.objectives.base import MODES
from blocktrain.node.routing.router import RouteLog, Router


def generate(objective, router: Router, prompt: bytes, n_bytes: int, mode: str, *, seed: int | None = 0,
             temperature: float = 0.0) -> dict:
    route = RouteLog()
    hops = router.hops(route)
    g = torch.Generator().manual_seed(seed if seed is not None else time.time_ns() % 2**31)
    t0 = time.perf_counter()
    out = objective.generate(hops, prompt, n_bytes, mode, temperature=temperature, generator=g)
    seconds = time.perf_counter() - t0
    return {"text": out.decode("utf-8", errors="replace"), "bytes": out, "bytes_generated": len(out),
            "mode": mode, "route": route.route(), "traversals": route.calls // router.n_blocks,
            "seconds": seconds, "latency_ms": round(seconds * 1000, 2), "failovers": route.failovers,
            "bytes_out": route.bytes_out, "bytes_in": route.bytes_in}


def limits(objective) -> dict[str, dict[str, int]]:
    """Per mode: the most bytes one request may ask for and the default length (both valid for
    this run's objective and seq_len)."""
    return {m: {"max": objective.generate_limit(m), "default": objective.generate_default(m)} for m in MODES}


def score(objective, router: Router, windows: torch.Tensor, k: int) -> dict:
    route = RouteLog()
    res = objective.score(router.hops(route), windows, k=k, generator=torch.Generator().manual_seed(0))
    return {"chain_ce": res.ce, "chain_ce_k1": res.ce_k1, "ce_kind": res.ce_kind, "k": res.k,
            "tokens": res.tokens, "route": route.route()}
