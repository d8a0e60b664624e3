"""Training along the chain of holders (issue 13): the engine (``engine.py``), its settings
(``settings.py``, cheap to import: the CLI validates flags with it), its figures (``stats.py``), and
``compose.start_pipeline``, which builds it on a node whose run is chain-trained. The route to the
next block's holders is ``routing/pipeline_route.py``; the wire is ``p2p/pipeline_rpc.py`` and
``p2p/pipeline_wire.py``."""
