"""Shared test helpers: tiny configs and the text corpus every test that needs real text reads."""
from __future__ import annotations

from pathlib import Path

from blocktrain.blocks.config import ModelConfig

#: one public-domain book shipped with the tests (tests/data/lord-arthur-savile/README.md): a
#: train.txt/test.txt folder, so no test depends on data outside the repository
TEST_CORPUS = Path(__file__).resolve().parents[1] / "data" / "lord-arthur-savile"
#: the protocol label resolve_data gives TEST_CORPUS
TEST_CORPUS_PROTOCOL = "train.txt/test.txt"


def tiny_config(**kw) -> ModelConfig:
    base = dict(d_model=32, n_heads=2, layers_per_block=1, n_blocks=3, seq_len=32, target_dim=16,
                batch_size=4, warmup_steps=0)
    base.update(kw)
    return ModelConfig(**base)
