# Sourced by the H200 scripts (benchmarks/h200_session.sh, benchmarks/h200_round.sh): from the repository
# root, with OUT set, install what the device machine lacks and record the environment in $OUT/env.txt.
# Packages the machine lacks travel as wheels in .whl/ (hydra-core, omegaconf, fla, ...; the device tool's
# `carry`); the package itself is installed editable, without dependencies.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MOECACHE_OUTPUT_ROOT=${MOECACHE_OUTPUT_ROOT:-/tmp/moecache-outputs}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)|L3';
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__)"; } >"$OUT/env.txt" 2>&1
