"""The ``forward-residual`` objective: ``objective.py`` (the objective), ``net.py`` (one block's network)."""
from .objective import ForwardResidualObjective

__all__ = ["ForwardResidualObjective"]
