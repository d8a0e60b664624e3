"""The trained model outside the network: load a checkpoint directory, generate and score text with
every block run locally. No network code; ``blocktrain.blocks`` runs where hivemind is absent.

    from blocktrain.blocks import load
    model = load("runs/local")             # a directory from ``bt-node export`` or ``train-local --out``
    model.generate("The history of", max_bytes=64)["text"]
    model.score("Some held-out text.")     # nats/byte of the chain (a bound for bound objectives)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import checkpoint as ckpt
from .chain import CountingHop
from .config import ModelConfig
from .device import module_device, pick_device
from .objectives import Objective, get_objective
from .windows import text_windows


def load_blocks(directory: str | Path, device: torch.device | str = "cpu"
                ) -> tuple[ModelConfig, Objective, list[nn.Module]]:
    """The config, objective and every block of a checkpoint directory, on ``device``."""
    cfg, saved = ckpt.load_checkpoint_dir(directory)
    objective = get_objective(cfg)
    blocks = []
    for b in range(cfg.n_blocks):
        m = objective.build_block(b)
        try:
            m.load_state_dict(saved[b].tensors)
        except RuntimeError as e:          # names or shapes that do not fit this objective's block
            raise ckpt.CheckpointError(f"{saved[b].path}: not a {cfg.objective} block {b} of its config: "
                                       f"{str(e).splitlines()[0]}") from None
        blocks.append(m.to(device))
    return cfg, objective, blocks


@dataclass
class Model:
    """All blocks of one run, in memory. ``generate`` and ``score`` run the chain over local hops."""
    cfg: ModelConfig
    objective: Objective
    blocks: list[nn.Module]
    directory: Path | None = None

    def hops(self) -> list[CountingHop]:
        return [CountingHop(h) for h in self.objective.local_hops(self.blocks)]

    def generate(self, prompt: str | bytes, max_bytes: int = 64, mode: str = "one_sweep", *,
                 temperature: float = 0.0, seed: int | None = 0) -> dict:
        """Continue ``prompt`` by ``max_bytes`` bytes. Returns the text and bytes generated, the mode,
        the route (every block, ``peer`` "local"), the traversals of the stack and the time taken."""
        data = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
        hops = self.hops()
        g = torch.Generator().manual_seed(seed if seed is not None else time.time_ns() % 2**31)
        t0 = time.perf_counter()
        out = self.objective.generate(hops, data, max_bytes, mode, temperature=temperature, generator=g)
        seconds = time.perf_counter() - t0
        return {"text": out.decode("utf-8", errors="replace"), "bytes": out, "bytes_generated": len(out),
                "mode": mode, "route": [{"block": b, "peer": "local"} for b in range(len(hops))],
                "traversals": hops[0].calls, "seconds": seconds, "latency_ms": round(seconds * 1000, 2)}

    def score(self, text: str | bytes, k: int = 2, seed: int = 0) -> float:
        """Nats/byte of the chain on ``text`` (at least 2 bytes; ``ce_kind`` says exact or bound)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        windows = text_windows(data, self.cfg.seq_len).to(module_device(self.blocks[0]))
        res = self.objective.score(self.objective.local_hops(self.blocks), windows, k=k,
                                   generator=torch.Generator().manual_seed(seed))
        return res.ce

    @property
    def ce_kind(self) -> str:
        return self.objective.ce_kind


def load(directory: str | Path, device: str = "auto") -> Model:
    """Load a directory written by ``bt-node export`` or ``bt-node train-local --out``.

    ``device``: "auto" (CUDA when available), "cpu" or "cuda". Raises ``CheckpointError`` (a
    ``ValueError``) naming the directory or file when it is missing or not a usable checkpoint."""
    cfg, objective, blocks = load_blocks(directory, pick_device(device))
    return Model(cfg, objective, blocks, Path(directory))
