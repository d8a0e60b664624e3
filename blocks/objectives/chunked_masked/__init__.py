"""The ``chunked-masked`` objective: ``objective.py`` (the objective), ``net.py`` (one block's network)."""
from .objective import ChunkedMaskedObjective

__all__ = ["ChunkedMaskedObjective"]
