#!/usr/bin/env bash
# The runtime core's measurements on an H200 machine in one go (the device tool's single call): the runtime
# and CPU-executor tests (GPU ones included), the transfer engine / overlap / manager / full-size store
# benchmark, and the CPU fallback executor against tokens and threads. Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/h200-runtime}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MOECACHE_OUTPUT_ROOT=${MOECACHE_OUTPUT_ROOT:-/tmp/moecache-outputs}
if [ -d .whl ] && [ -z "${MOECACHE_WHEELS_DONE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)|L3';
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "== runtime tests"; python3 -m pytest -q -p no:cacheprovider tests/runtime tests/sim/test_shape_seam.py 2>&1 | tail -8 | tee "$OUT/runtime_tests.txt"
echo "== runtime benchmark"; python3 benchmarks/bench_runtime.py --device cuda --store-experts "${STORE_EXPERTS:-10240}" 2>&1 | tail -40 | tee "$OUT/bench_runtime.txt"
echo "== CPU fallback executor"; python3 benchmarks/bench_cpu_experts.py --threads 1,4,8,16 --tokens 1,4,16 --experts 1,8 --repeats 30 --warmup 5 2>&1 | tail -60 | tee "$OUT/bench_cpu_experts.txt"
