#!/usr/bin/env bash
# `make compat`: the newest releases pyproject.toml allows, installed into a scratch environment
# ($COMPAT_VENV), through a fast smoke subset of the tests. torch stays at the lock's CPU wheel (every newer
# torch on the package index is a multi-GB CUDA build); everything else is the newest allowed. A failure,
# of the install or of a test, is printed as a WARNING with the versions and exits 0: drift to act on
# (`make lock`, a fix), seen the day it happens, not a broken commit.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3} COMPAT_VENV=${COMPAT_VENV:-.venv-compat} LOCK=${LOCK:-requirements-dev.lock}
# the tests that exercise what a new dependency release breaks first: transformers' modules imported with
# the repository root on sys.path, the model adapters and loader, the offloaded runtime, the CLI
SMOKE=(tests/test_imports.py tests/models tests/runtime/test_offload.py tests/test_cli.py)

TORCH=$(grep -E '^torch==' "$LOCK" | cut -d' ' -f1)
LOG=$(mktemp)
versions() {  # the versions of the distributions moecache leans on, in the scratch environment
  "$COMPAT_VENV/bin/python" -m pip list --format=freeze 2>/dev/null | tr '\n' ' ' | grep -oiE \
    '\b(torch|transformers|kernels|huggingface.hub|tokenizers|safetensors|hydra.core|omegaconf|typer|rich|pyarrow|datasets|numpy|numba|triton|pytest)==[^ ]+' |
    tr '\n' ' '
}
warn() {
  echo "WARNING: make compat: $1 with the newest releases pyproject.toml allows (the lock is unaffected): $(versions)"
  tail -40 "$LOG"
  exit 0
}
"$PYTHON" -m venv --clear "$COMPAT_VENV" >"$LOG" 2>&1 || warn "creating $COMPAT_VENV failed"
"$COMPAT_VENV/bin/python" -m pip install -q --upgrade pip >>"$LOG" 2>&1 || warn "upgrading pip failed"
"$COMPAT_VENV/bin/python" -m pip install -q "$TORCH" >>"$LOG" 2>&1 || warn "installing $TORCH failed"
"$COMPAT_VENV/bin/python" -m pip install -q --upgrade --upgrade-strategy eager -c <(echo "$TORCH") -e '.[dev]' \
  >>"$LOG" 2>&1 || warn "installing the newest releases failed"
"$COMPAT_VENV/bin/python" -m pytest -q -x -p no:cacheprovider "${SMOKE[@]}" >"$LOG" 2>&1 || warn "the smoke tests failed"
echo "make compat: the smoke tests pass with the newest releases pyproject.toml allows: $(versions)"
