# moecache: one-command set-up, tests, the default pipeline and benchmarks.
# `make test` and `make reproduce` each do the whole set-up on a fresh machine, from the lock.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU development environment, exact versions with hashes (pipelines/lock.py); `make lock` refreshes it.
LOCK := requirements-dev.lock
# The CPU wheel the lock is resolved with; a newer torch is a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.moecache-setup
# The scratch environment of `make compat`: the newest releases pyproject.toml allows.
COMPAT_VENV ?= .venv-compat

.PHONY: setup lock compat test test-gpu reproduce bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes --no-deps -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) pipelines/lock.py check $(LOCK)
	touch $(STAMP)

# Resolve pyproject.toml's ranges afresh into the lock (on purpose: commit the result after `make test`).
lock:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) pipelines/lock.py write $(LOCK) "$(TORCH_SPEC)"

# The newest releases pyproject.toml allows, in a scratch environment, through a fast smoke subset:
# a failure is reported as a warning with the versions (it is drift to act on, not a broken commit).
compat: setup
	PYTHON=$(PYTHON) COMPAT_VENV=$(COMPAT_VENV) LOCK=$(LOCK) bash pipelines/compat.sh

test: setup
	$(PY) -m pytest -q -x -p no:cacheprovider

test-gpu: setup
	$(PY) -m pytest -q -m gpu

reproduce: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" bash pipelines/reproduce.sh

bench: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" bash pipelines/bench.sh

lint: setup
	$(VENV)/bin/ruff check moecache kernels tests benchmarks pipelines
	$(VENV)/bin/ruff format --check moecache kernels tests benchmarks pipelines

clean:
	rm -rf outputs/*/ .pytest_cache $(COMPAT_VENV)
