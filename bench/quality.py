"""bench quality, protocol v1 (``--protocol v1``): the objective's chain vs end-to-end references at
EQUAL training FLOPs, interleaved in one run.

Trains the objective's B blocks, an autoregressive reference of the whole depth and one of one
block's depth, each taking as many steps as the chain's measured training FLOPs buy it (no
network: everything in this process), then scores all on the same held-out windows. Protocol v2
(the default; issue 13) is in ``quality_v2.py``.
"""
from __future__ import annotations

import torch

from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import DataSplit
from blocktrain.blocks.local_run import LocalRun


def quality_run(cfg: ModelConfig, split: DataSplit, device: torch.device, *, seed: int = 0,
                upstream_every: int = 1) -> LocalRun:
    """The blocks and both references, set to take equal training FLOPs (train it, then :func:`quality_result`)."""
    return LocalRun(cfg, split, device, seed=seed, reference=True, small_reference=True, match_flops=True,
                    upstream_every=upstream_every)


def quality_result(run: LocalRun, *, k: int = 4, eval_windows: int = 64) -> dict:
    """Score a trained :func:`quality_run` on the held-out windows; adds the FLOPs and steps each took."""
    res = run.evaluate(n_windows=eval_windows, k=k)
    flops = run.flops()
    res["flops_each"] = {"chain": flops["chain"], "reference": flops.get("reference"),
                         "single_block_reference": flops.get("reference_1block")}
    res["steps_each"] = {tr.name: tr.steps for tr in run.trainees}
    if run.objective.needs_upstream:
        res["upstream_every"] = run.upstream_every
    return res
