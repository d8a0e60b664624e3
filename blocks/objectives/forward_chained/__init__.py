"""The ``forward-chained`` objective: ``objective.py`` (the objective), ``net.py`` (one block's network)."""
from .objective import ForwardChainedObjective

__all__ = ["ForwardChainedObjective"]
