"""Registry of objectives: the block-local ones and the chain-trained ``pipeline``,
``pipeline-chunked`` and ``forward-streamed``. ``get_objective(cfg)`` builds the one the config names."""
from __future__ import annotations

from ..config import ConfigError, ModelConfig
from .base import CHAIN_TRAINING, NotBlockLocalError, Objective, ScoreResult
from .chunked_continuous import ChunkedContinuousObjective
from .chunked_masked import ChunkedMaskedObjective
from .forward_chained import ForwardChainedObjective
from .forward_residual import ForwardResidualObjective
from .forward_streamed import ForwardStreamedObjective
from .paper import PaperObjective
from .pipeline import PipelineObjective
from .pipeline_chunked import PipelineChunkedObjective

OBJECTIVES: dict[str, type[Objective]] = {
    PaperObjective.name: PaperObjective,
    ChunkedMaskedObjective.name: ChunkedMaskedObjective,
    ForwardChainedObjective.name: ForwardChainedObjective,
    ChunkedContinuousObjective.name: ChunkedContinuousObjective,
    ForwardResidualObjective.name: ForwardResidualObjective,
    PipelineObjective.name: PipelineObjective,
    ForwardStreamedObjective.name: ForwardStreamedObjective,
    PipelineChunkedObjective.name: PipelineChunkedObjective,
}

DEFAULT_OBJECTIVE = "paper"


def get_objective(cfg: ModelConfig) -> Objective:
    try:
        cls = OBJECTIVES[cfg.objective]
    except KeyError:
        raise ConfigError(
            f"field 'objective': unknown objective {cfg.objective!r}; known: {', '.join(sorted(OBJECTIVES))}"
        ) from None
    return cls(cfg)


__all__ = ["CHAIN_TRAINING", "OBJECTIVES", "DEFAULT_OBJECTIVE", "NotBlockLocalError", "Objective", "ScoreResult",
           "get_objective"]
