"""blocktrain.blocks: the model, pure PyTorch (no network code). ``load(DIR)`` gives a trained model
from a checkpoint directory, to generate and score text locally (``model.py``)."""
from .model import Model, load

__all__ = ["Model", "load"]
