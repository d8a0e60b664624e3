"""blocktrain.p2p."""
