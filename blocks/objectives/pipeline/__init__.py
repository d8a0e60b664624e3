"""The ``pipeline`` objective: ``objective.py`` (the objective), ``net.py`` (one block: a slice of the
end-to-end model, with the same initialisation)."""
from .net import PipelineBlock, from_reference, to_reference
from .objective import PipelineObjective

__all__ = ["PipelineBlock", "PipelineObjective", "from_reference", "to_reference"]
