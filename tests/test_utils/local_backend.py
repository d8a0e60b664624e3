"""The HTTP API's backend over a real objective and real blocks in the test process (no network)."""
from __future__ import annotations

import torch

from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.model import Model
from blocktrain.blocks.objectives import get_objective
from blocktrain.node import generation


class LocalBackend:
    """The API's backend over a real objective and real blocks on this machine (no network):
    what the node does for /v1/generate, minus the routing."""

    def __init__(self, cfg: ModelConfig):
        obj = get_objective(cfg)
        torch.manual_seed(0)
        self.model = Model(cfg, obj, [obj.build_block(b).eval() for b in range(cfg.n_blocks)])

    def generate_limits(self):
        return generation.limits(self.model.objective)

    def generate(self, prompt, max_bytes, mode, seed, temperature):
        out = self.model.generate(prompt, max_bytes, mode, temperature=temperature, seed=seed)
        out.pop("bytes")
        return out
