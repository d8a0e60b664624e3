"""blocktrain.blocks: the model, pure PyTorch (no network code). ``load(DIR)`` gives a trained model
from a checkpoint directory, to generate and score text locally (``model.py``).

``Model`` and ``load`` are imported on first use, so that ``blocks.config`` and the other torch-free
modules (config, budget) can be read without loading PyTorch (``bt-node status --http``, ``--help``)."""
from __future__ import annotations

__all__ = ["Model", "load"]


def __getattr__(name: str):
    if name in __all__:
        from . import model
        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
