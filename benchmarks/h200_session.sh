#!/usr/bin/env bash
# Everything this project measures on an H200 machine, in one go (the device tool's single call):
# the full test suite (GPU tests included), `moecache calibrate` for the Qwen3.6-35B-A3B expert shape,
# a collect on the GPU, and the routing-logger and logit-lens overheads on Qwen3.6-shaped random layers.
# Results go to $OUT (default outputs/h200-session); docs/benchmarks.md records them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/h200-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MOECACHE_OUTPUT_ROOT=${MOECACHE_OUTPUT_ROOT:-/tmp/moecache-outputs}
# Packages the machine lacks travel as wheels in .whl/ (hydra-core, omegaconf, typer, ...).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)';
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"; } >"$OUT/env.txt" 2>&1

echo "== tests"; python3 -m pytest -q -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.txt"
echo "== calibrate"; python3 -m moecache.cli calibrate model=qwen3_6_35b_a3b device=cuda 2>&1 | tail -30 | tee "$OUT/calibrate.txt"
cp "$(tail -1 "$OUT/calibrate.txt")/cost_profile.json" "$OUT/cost_profile.json"
echo "== collect on the GPU"; python3 -m moecache.cli collect device=cuda workload.num_requests=4 2>&1 | tail -16 | tee "$OUT/collect.txt"
echo "== logging overhead"; python3 benchmarks/bench_logging.py --model large --device cuda "$@" 2>&1 | grep -v '^\[transformers\]' | tail -8 | tee "$OUT/bench_logging.txt"
echo "== logit-lens overhead"; python3 benchmarks/bench_logit_lens.py --model large --device cuda --layers 8 --prompt-tokens 512 --new-tokens 64 --rounds 7 2>&1 | grep -v '^\[transformers\]' | tail -8 | tee "$OUT/bench_logit_lens.txt"
