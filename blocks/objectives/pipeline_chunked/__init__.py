"""The ``pipeline-chunked`` objective: ``objective.py`` (the objective), ``net.py`` (one block: a
``pipeline`` block run on a clean stream and a stream of masked chunk queries)."""
from .net import PipelineChunkedBlock, build_chunked_block, chunk_query_mask
from .objective import PipelineChunkedObjective

__all__ = ["PipelineChunkedBlock", "PipelineChunkedObjective", "build_chunked_block", "chunk_query_mask"]
