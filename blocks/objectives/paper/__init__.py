"""The ``paper`` objective: ``objective.py`` (the objective), ``net.py`` (one block's network)."""
from .objective import PaperObjective

__all__ = ["PaperObjective"]
