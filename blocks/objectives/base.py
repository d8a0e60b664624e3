"""The objective interface.

An objective says (1) what one block is (``build_block``), (2) the block's local loss on a batch
of byte windows (a step on block b touches only block b), and (3) how the blocks compose into a
chain to score real text and to generate. The chain side receives *hops* (see ``chain.py``), not
modules, so the same objective drives local blocks and remote peers.

Chain-trained objectives (``chain_training`` "backprop" or "streamed", issue 13) do not train a
block on its own: block b trains on the state it *receives* from block b-1 along the chain. They
add two differentiable pieces, which the network's pipeline engine (``node/pipeline``) and the
single-process reference (``chain_train.py``) both run:

* ``stage_forward(block, b, h_in, context) -> h_out``: block b's output state from its input state
  (block 0: from the bytes ``context``; ``h_in`` is None), with gradients;
* ``stage_loss(block, b, h_out, targets) -> (loss, stats)``: the loss block b computes from its own
  output, for the blocks where ``stage_has_loss(b)`` (backprop: the last block only; streamed:
  every block, each with its own head).

"backprop": the loss's gradient w.r.t. each stage's input travels back to the stage before (the
whole model trained end to end). "streamed": no gradient crosses blocks; block b's input arrives
detached (greedy / DGL-style training on what the chain actually hands it).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from ..chain import Hop
from ..config import ModelConfig


MODES = ("one_sweep", "autoregressive")
MAX_GENERATE_BYTES = 1024       # the most bytes one generation request may ask for, in any mode
DEFAULT_GENERATE_BYTES = 64     # what a request that names no length gets (capped by the mode's limit)


@dataclass
class ScoreResult:
    ce: float                 # nats/byte of the chain's predictive distribution (K-sample average)
    ce_k1: float              # nats/byte of a single chain sample (K=1)
    k: int
    tokens: int               # bytes scored
    ce_kind: str              # "exact" (a true cross entropy) or "bound" (an upper bound on it)
    extra: dict = field(default_factory=dict)


class NotBlockLocalError(ValueError):
    """The objective's blocks cannot compute a loss alone (they train through the chain)."""


CHAIN_TRAINING = ("local", "backprop", "streamed")


class Objective(ABC):
    name: str = ""
    ce_kind: str = "exact"
    needs_upstream: bool = False   # does block b train on the outputs of blocks < b (read-only)?
    chain_training: str = "local"  # "local": block-local steps; "backprop" / "streamed": along the chain

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    @abstractmethod
    def build_block(self, b: int) -> nn.Module:
        """A fresh block b (its own parameters only; the shared target is rebuilt from the seed)."""

    @abstractmethod
    def local_loss(self, block: nn.Module, b: int, windows: torch.Tensor,
                   generator: torch.Generator | None = None,
                   upstream: Sequence[nn.Module] | None = None) -> tuple[torch.Tensor, dict]:
        """Block b's loss on windows (N, seq_len+1) of bytes; returns (loss, float stats).
        ``upstream``: read-only snapshots of blocks 0..b-1, for objectives that ``needs_upstream``."""

    @abstractmethod
    def make_hop(self, block: nn.Module, b: int) -> Hop:
        """A local callable that runs block b as one hop of the chain."""

    @abstractmethod
    def score(self, hops: Sequence[Hop], windows: torch.Tensor, k: int = 4,
              generator: torch.Generator | None = None) -> ScoreResult:
        """Held-out nats/byte of the composed chain, predicting byte t+1 from bytes <= t."""

    def score_per_window(self, hops: Sequence[Hop], windows: torch.Tensor, k: int = 4,
                         seed: int = 0) -> tuple[list[float], list[dict]]:
        """Each window's :meth:`score` alone, window i with its own generator seeded ``seed + i`` (so a
        window's figure does not depend on what is scored beside it); returns the CEs and the
        ``extra`` dicts. This loop is the definition; an objective may compute the same in batches."""
        out = [self.score(hops, windows[i:i + 1], k=k, generator=torch.Generator().manual_seed(seed + i))
               for i in range(windows.shape[0])]
        return [r.ce for r in out], [r.extra for r in out]

    @abstractmethod
    def block_alone_ce(self, block: nn.Module, b: int, windows: torch.Tensor,
                       generator: torch.Generator | None = None) -> float:
        """Nats/byte of block b alone at its own noise level with an uninformative input."""

    @abstractmethod
    def generate_one_sweep(self, hops: Sequence[Hop], prompt: bytes, n_bytes: int, *,
                           temperature: float = 0.0,
                           generator: torch.Generator | None = None) -> bytes:
        """A whole continuation in ONE traversal of the block stack (each hop called once)."""

    @abstractmethod
    def generate_autoregressive(self, hops: Sequence[Hop], prompt: bytes, n_bytes: int, *,
                                temperature: float = 0.0,
                                generator: torch.Generator | None = None) -> bytes:
        """The baseline: one traversal of the block stack per generated byte."""

    # -- chain training (chain_training != "local") ------------------------------------------------
    @property
    def block_local(self) -> bool:
        """True when a block trains alone (``local_loss``); False when it trains along the chain."""
        return self.chain_training == "local"

    def stage_forward(self, block: nn.Module, b: int, h_in: torch.Tensor | None,
                      context: torch.Tensor | None) -> torch.Tensor:
        """Block b's output state (N, T, state_dim) from ``h_in`` (block 0: from ``context`` (N, T)
        bytes), differentiable w.r.t. ``h_in`` and the block's parameters."""
        raise NotBlockLocalError(f"objective {self.name!r} is block-local: it has no chain stages")

    def stage_loss(self, block: nn.Module, b: int, h_out: torch.Tensor,
                   targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The loss block b computes from its own output ``h_out`` against ``targets`` (N, T) bytes,
        for blocks where ``stage_has_loss(b)``; returns (loss, float stats)."""
        raise NotBlockLocalError(f"objective {self.name!r} is block-local: it has no chain stages")

    def stage_has_loss(self, b: int) -> bool:
        """Whether block b computes a loss of its own in chain training."""
        return False

    # -- shared helpers --------------------------------------------------------------------------
    def generate_limit(self, mode: str) -> int:
        """The most bytes one ``generate`` call may ask for in ``mode``. Generators that slide the
        window (chunks, byte by byte) are bounded only by MAX_GENERATE_BYTES; an objective whose
        one-sweep continuation must fit in one window says less."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: use one_sweep or autoregressive")
        return MAX_GENERATE_BYTES

    def generate_default(self, mode: str) -> int:
        """The length a request that names none gets: valid for every config."""
        return min(DEFAULT_GENERATE_BYTES, self.generate_limit(mode))

    def generate(self, hops: Sequence[Hop], prompt: bytes, n_bytes: int, mode: str, *,
                 temperature: float = 0.0, generator: torch.Generator | None = None) -> bytes:
        """``mode`` "one_sweep" or "autoregressive": the generator of that name."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: use one_sweep or autoregressive")
        gen = self.generate_one_sweep if mode == "one_sweep" else self.generate_autoregressive
        return gen(hops, prompt, n_bytes, temperature=temperature, generator=generator)

    @property
    def train_tokens_per_window(self) -> int:
        """Positions one training window occupies in a block's forward (for FLOP counts)."""
        return self.cfg.seq_len

    def upstream_blocks(self, b: int) -> int:
        """How many other blocks' forwards one training step of block b runs (for FLOP counts)."""
        return 0

    def state_dim(self) -> int:
        """Size of the last axis of the state passed between hops."""
        return self.cfg.target_dim

    def local_hops(self, blocks: Sequence[nn.Module]) -> list[Hop]:
        return [self.make_hop(m, b) for b, m in enumerate(blocks)]

    def check_block(self, b: int) -> None:
        if not 0 <= b < self.cfg.n_blocks:
            raise IndexError(f"block index {b} out of range [0, {self.cfg.n_blocks})")

    def check_hops(self, hops: Sequence[Hop]) -> None:
        if len(hops) != self.cfg.n_blocks:
            raise ValueError(f"{len(hops)} hops, but the config has n_blocks = {self.cfg.n_blocks}")

