#!/usr/bin/env bash
# Benchmarks (never timed unit tests): each prints a table and ends with one JSON line.
# Record results in docs/benchmarks.md with date, machine and command.
set -euo pipefail
cd "$(dirname "$0")/.."
python benchmarks/bench_logging.py --model tiny --device cpu --threads 1
python benchmarks/bench_step.py
if ls outputs/import_trace/*/trace.parquet >/dev/null 2>&1; then
  python benchmarks/bench_sim.py
  python benchmarks/bench_cli_sim.py
else
  echo "bench_sim, bench_cli_sim: skipped: no imported trace under outputs/ (run make reproduce first)"
fi
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  python benchmarks/bench_logging.py --model large --device cuda
fi
