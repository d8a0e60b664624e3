"""Test support code: process drivers, test nodes, hostile peers, tiny configs."""
