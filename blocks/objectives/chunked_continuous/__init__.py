"""The ``chunked-continuous`` objective: ``objective.py`` (the objective), ``net.py`` (one block's network)."""
from .objective import ChunkedContinuousObjective

__all__ = ["ChunkedContinuousObjective"]
