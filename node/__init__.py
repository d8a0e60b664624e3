"""blocktrain.node."""
