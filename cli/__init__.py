"""blocktrain.cli."""
