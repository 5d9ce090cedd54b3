#!/usr/bin/env bash
# Everything this project measures on an H200 machine, in one go (the device tool's single call):
# the full test suite (GPU tests included), `moecache calibrate` for the Qwen3.6-35B-A3B expert shape,
# a collect on the GPU, and the routing-logger and logit-lens overheads on Qwen3.6-shaped random layers.
# Results go to $OUT (default outputs/h200-session); docs/benchmarks.md records them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/h200-session}
source benchmarks/h200_setup.sh

echo "== tests"; python3 -m pytest -q -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.txt"
echo "== calibrate"; python3 -m moecache.cli calibrate model=qwen3_6_35b_a3b device=cuda 2>&1 | tail -30 | tee "$OUT/calibrate.txt"
cp "$(tail -1 "$OUT/calibrate.txt")/cost_profile.json" "$OUT/cost_profile.json"
echo "== collect on the GPU"; python3 -m moecache.cli collect device=cuda workload.num_requests=4 2>&1 | tail -16 | tee "$OUT/collect.txt"
echo "== logging overhead"; python3 benchmarks/bench_logging.py --model large --device cuda "$@" 2>&1 | grep -v '^\[transformers\]' | tail -8 | tee "$OUT/bench_logging.txt"
echo "== logit-lens overhead"; python3 benchmarks/bench_logit_lens.py --model large --device cuda --layers 8 --prompt-tokens 512 --new-tokens 64 --rounds 7 2>&1 | grep -v '^\[transformers\]' | tail -8 | tee "$OUT/bench_logit_lens.txt"
