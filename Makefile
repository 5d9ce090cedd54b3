# moecache: one-command set-up, tests, the default pipeline and benchmarks.
# `make test` and `make reproduce` each do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel; override (e.g. TORCH_SPEC=torch) on a CUDA machine.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.moecache-setup

.PHONY: setup test test-gpu reproduce bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -x -p no:cacheprovider

test-gpu: setup
	$(PY) -m pytest -q -m gpu

reproduce: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" bash pipelines/reproduce.sh

bench: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" bash pipelines/bench.sh

lint: setup
	$(VENV)/bin/ruff check moecache kernels tests benchmarks
	$(VENV)/bin/ruff format --check moecache kernels tests benchmarks

clean:
	rm -rf outputs/*/ .pytest_cache
