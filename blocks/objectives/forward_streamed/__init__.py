"""The ``forward-streamed`` objective (``objective.py``); its block is forward-chained's network."""
from .objective import ForwardStreamedObjective

__all__ = ["ForwardStreamedObjective"]
