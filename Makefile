# torch 2.13.0 first: the CPU wheel on the project's machines' local disk (elsewhere: the normal release).
PY ?= python

.PHONY: install test
install:
	$(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[dev]"
	$(PY) -m compileall -q -j 0 blocks node p2p cli bench >/dev/null

test:
	$(PY) -m pytest -q
