#!/usr/bin/env bash
# The slot_moe kernel on an H200, in one device call (~8 min): the GPU tests of tests/kernels, the tuning
# script for the Qwen3.6-35B-A3B shape (bounded), then the benchmark. Everything is printed and written
# to $OUT (default outputs/h200-kernels): tests.txt, tune.txt + the tuned config JSON, bench.txt.
# Needs no install: kernels/ (the folder holding the moecache_kernels package) goes on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/h200-kernels}
mkdir -p "$OUT" kernels/moecache_kernels/configs
export PYTHONPATH="$PWD/kernels:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
TUNE_S=${TUNE_S:-150}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import onnxruntime; print('onnxruntime', onnxruntime.__version__)" 2>&1 | tail -1
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1; } | tee "$OUT/env.txt"

echo "== GPU tests (tests/kernels)"
python3 -m pytest tests/kernels -q -p no:cacheprovider -rs 2>&1 | tail -30 | tee "$OUT/tests.txt"

echo "== tune (Qwen3.6-35B-A3B shape, ${TUNE_S} s budget)"
python3 benchmarks/tune_slot_moe.py --hidden 2048 --inter 512 --experts 256 --top-k 8 \
  --budget-s "$TUNE_S" --out-dir "$OUT/configs" 2>&1 | tail -40 | tee "$OUT/tune.txt"
# the benchmark below uses the configs just tuned; the file's name (commas, '=') does not travel back
# from the device tool's $OUT, so its content is printed and copied as tuned-config.json too
for f in "$OUT"/configs/*.json; do echo "$f:"; cat "$f"; cp "$f" kernels/moecache_kernels/configs/; cp "$f" "$OUT/tuned-config.json"; done | tee -a "$OUT/tune.txt"

echo "== bench"
python3 benchmarks/bench_slot_moe.py --quick "$@" 2>&1 | tail -200 | tee "$OUT/bench.txt"
