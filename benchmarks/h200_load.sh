#!/usr/bin/env bash
# The loader on an H200 machine, in one device call: the DeepSeek-V2-Lite shape written as a random
# checkpoint in the Hugging Face layout (CKPT, default /tmp/ckpt-dsv2), then benchmarks/bench_load.py on it
# (disk rate, cold and warm `moecache generate`, then cold loads at the reading-thread counts READ_SWEEP,
# default 4,8; the default count is 2), then the random Qwen3.6 shape (SECTIONS="dsv2 qwen").
# Needs no install: the repository and kernels/ go on PYTHONPATH, the wheels of .whl/ into /tmp/site.
# Results go to $OUT (default outputs/h200-load); docs/benchmarks.md records them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/h200-load}
CKPT=${CKPT:-/tmp/ckpt-dsv2}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD:$PWD/kernels" PYTHONUNBUFFERED=1 MOECACHE_OUTPUT_ROOT=/tmp/moecache-outputs
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)'
  grep -E 'MemTotal|MemAvailable' /proc/meminfo; df -h /tmp | tail -1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
  2>&1 | tee "$OUT/env.txt"
for section in ${SECTIONS:-dsv2 qwen}; do
  case "$section" in
  dsv2)
    [ -d "$CKPT" ] || timeout 300 python3 benchmarks/bench_load.py --write "$CKPT" --model deepseek_v2_lite 2>&1 | tail -3 | tee "$OUT/write.txt"
    du -sh "$CKPT" | tee -a "$OUT/write.txt"
    timeout 600 python3 benchmarks/bench_load.py --checkpoint "$CKPT" --model deepseek_v2_lite --capacity "${CAPACITY:-25%}" \
      --read-threads "${READ_SWEEP-4,8}" 2>&1 | tail -11 | tee "$OUT/load_dsv2.txt" ;;
  qwen)
    timeout 300 python3 benchmarks/bench_load.py --random --model qwen3_6_35b_a3b --capacity "${CAPACITY:-25%}" \
      2>&1 | tail -8 | tee "$OUT/load_qwen.txt" ;;
  esac
done
