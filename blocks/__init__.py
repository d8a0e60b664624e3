"""blocktrain.blocks."""
