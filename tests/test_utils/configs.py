"""Shared test helpers: tiny configs and the location of ../shared data."""
from __future__ import annotations

from pathlib import Path

import pytest

from blocktrain.blocks.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
WIKITEXT = SHARED_DATA / "wikitext-2-raw"


def tiny_config(**kw) -> ModelConfig:
    base = dict(d_model=32, n_heads=2, layers_per_block=1, n_blocks=3, seq_len=32, target_dim=16,
                batch_size=4, warmup_steps=0)
    base.update(kw)
    return ModelConfig(**base)


def need_wikitext() -> Path:
    if not (WIKITEXT / "wiki.valid.raw").exists():
        pytest.skip(f"shared WikiText data not found at {WIKITEXT} (tests read it from ../shared/data)")
    return WIKITEXT
