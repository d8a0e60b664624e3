"""Benchmarks (`bt-node bench ...`): each prints a table and a JSON object; see BENCHMARKS.md."""
