#!/usr/bin/env bash
# Benchmarks (never timed unit tests): each prints a table and ends with one JSON line.
# Record results in docs/benchmarks.md with date, machine and command.
set -euo pipefail
cd "$(dirname "$0")/.."
python benchmarks/bench_logging.py --model tiny --device cpu --threads 1
python benchmarks/bench_step.py
python benchmarks/bench_cpu_experts.py --threads 1,2 --tokens 1,4,16 --repeats 20 --max-pool-mib 1024
if ls outputs/import_trace/*/trace.parquet >/dev/null 2>&1; then
  python benchmarks/bench_sim.py
  python benchmarks/bench_cli_sim.py
else
  echo "bench_sim, bench_cli_sim: skipped: no imported trace under outputs/ (run make reproduce first)"
fi
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  python benchmarks/bench_logging.py --model large --device cuda
  python benchmarks/bench_runtime.py --device cuda --store-experts 0
  python benchmarks/bench_slot_moe.py --quick
else
  python benchmarks/bench_runtime.py --device standin --store-experts 0 --sections manager
  echo "bench_slot_moe, the CUDA sections of bench_runtime: skipped: needs CUDA"
fi
