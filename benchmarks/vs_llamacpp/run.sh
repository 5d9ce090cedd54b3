#!/usr/bin/env bash
# moecache against llama.cpp on the same random weights: the device-side driver, in phases that each fit one
# device call (10 minutes) and pick up what an earlier phase left on the machine (benchmarks/vs_llamacpp/README.md).
#
#   run.sh build                  llama-bench from .vendor/llama.cpp (benchmarks/vs_llamacpp/fetch_llamacpp.sh)
#   run.sh configure              its cmake configuration alone (LLAMA_SRC, BUILD: fetch_llamacpp.sh's CHECK_TRIM)
#   run.sh write SHAPE            the seeded random checkpoint of SHAPE in the Hugging Face layout
#   run.sh convert SHAPE          that checkpoint to a bf16 GGUF with llama.cpp's convert_hf_to_gguf.py
#   run.sh prepare SHAPE          write, then build (unless built) while converting
#   run.sh bench SHAPE            llama-bench, then moecache, at every point (SIDE=llama or SIDE=moecache: one;
#                                 SIDE=moecache_compiled: moecache with runtime.compile=true, saved apart;
#                                 POLICY=static_layers: moecache with that placement policy, saved apart;
#                                 STREAM_MIN_TOKENS=N [STREAM_CHUNK=C]: a prompt's misses streamed to the
#                                 device from N entries, runtime.stream_min_tokens, saved apart; 0: none;
#                                 unset: generate's default, auto)
#   run.sh clean SHAPE            remove SHAPE's checkpoint and GGUF (room for the other shape)
#   run.sh report SHAPE...        the table of every SHAPE's saved results and one JSON line
#   run.sh all SHAPE...           prepare and bench each SHAPE, then report (a machine without time limits)
#
# SHAPE: dsv2 (conf/model/deepseek_v2_lite.yaml, llama.cpp arch deepseek2) or qwen (conf/model/
# qwen3_6_35b_a3b.yaml, arch qwen35moe). Settings (environment):
#   BACKEND=cuda|cpu          llama.cpp's backend and moecache's device (cuda: sm_90; cpu: the tiny CPU proof)
#   WORK=/tmp/vs_llamacpp     build folder, GGUF files, results (disk)
#   CKPT_ROOT=/dev/shm/vs_llamacpp   the Hugging Face checkpoints (memory; the disk holds the GGUF files)
#   LAYERS_DSV2, LAYERS_QWEN  decoder layers kept (default: all 27 of DeepSeek-V2-Lite; 20 of Qwen3.6's 40,
#                             since a full bf16 Qwen3.6 checkpoint, 69 GB, does not fit twice on the machine)
#   SIZE=full|tiny            tiny: hidden sizes and vocabulary cut too (the CPU proof; bench.py TINY)
#   PP=512 TG=128 REPS=3      prefill and decode lengths, repetitions (medians of REPS)
#   THREADS                   CPU threads on both sides (default: the CPUs this process may use, less one:
#                             moecache's CPU expert default)
#   FORCED_TRACE              real DeepSeek-V2-Lite routing (an ESFT .npz) for the trace-forced moecache
#                             runs of dsv2 (default: .vendor/traces/esft_summary_routing.npz if present)
#   LLAMA_ARGS                more llama-bench arguments (default none: llama-bench's defaults)
#   JOBS                      build jobs (default: nproc)
#   OUT                       where results are copied (the device tool's $OUT; they are kept in $WORK/results)
#   ROUND                     results in $WORK/results/roundROUND instead: the sides measured again, in turn,
#                             a round each, so that each round's ratios are of runs close in time
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
HERE=benchmarks/vs_llamacpp
BACKEND=${BACKEND:-cuda}
WORK=${WORK:-/tmp/vs_llamacpp}
CKPT_ROOT=${CKPT_ROOT:-/dev/shm/vs_llamacpp}
BUILD=${BUILD:-$WORK/build}
LLAMA_SRC=${LLAMA_SRC:-$REPO/.vendor/llama.cpp}
RESULTS=$WORK/results${ROUND:+/round$ROUND}  # every phase's results, kept on the machine between calls
OUT=${OUT:-$WORK/results}${ROUND:+/round$ROUND}
JOBS=${JOBS:-$(nproc)}
export THREADS=${THREADS:-$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))}
export PYTHONUNBUFFERED=1 MOECACHE_OUTPUT_ROOT=${MOECACHE_OUTPUT_ROOT:-$WORK/moecache-outputs}
mkdir -p "$WORK" "$RESULTS" "$OUT"

die() { echo "run.sh: $*" >&2; exit 2; }
case "$BACKEND" in cuda|cpu) ;; *) die "BACKEND=$BACKEND: expected cuda or cpu" ;; esac

# Python: the project's .venv here; on the device machine python3, with the wheels of .whl/ (hydra-core,
# omegaconf) installed once into /tmp/site and the repository and kernels/ on PYTHONPATH.
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then
    PYTHON="$REPO/.venv/bin/python"
  else
    PYTHON=python3
    if [ -d .whl ] && [ ! -e /tmp/site/.vs_llamacpp ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && touch /tmp/site/.vs_llamacpp
    fi
    export PYTHONPATH="/tmp/site:$REPO:$REPO/kernels${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

shape_ok() { case "$1" in dsv2|qwen) ;; *) die "shape $1: expected dsv2 or qwen" ;; esac; }
layers_of() { if [ "$1" = dsv2 ]; then echo "${LAYERS_DSV2:-27}"; else echo "${LAYERS_QWEN:-20}"; fi; }
ckpt_of() { echo "$CKPT_ROOT/$1-$(layers_of "$1")l-${SIZE:-full}"; }
gguf_of() { echo "$WORK/$1-$(layers_of "$1")l-${SIZE:-full}.bf16.gguf"; }

# The cmake configuration of llama-bench (LLAMA_SRC into BUILD); the options are written to $BUILD/options.txt.
configure() {
  [ -f "$LLAMA_SRC/VENDOR.json" ] || die "$LLAMA_SRC/VENDOR.json missing: run benchmarks/vs_llamacpp/fetch_llamacpp.sh here first"
  local commit
  commit=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['llama_cpp_commit'])" "$LLAMA_SRC/VENDOR.json")
  # Only what llama-bench links is compiled: libllama, ggml (base, CPU and, for cuda, the CUDA backend
  # with every kernel it ships) and llama-common. Options left at llama.cpp's defaults are not listed.
  local opts=(
    -G Ninja -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE=ON                       # the CPU backend for this machine's CPU (it runs here too)
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_OPENSSL=OFF                    # HTTPS downloads of models; the runs read local files
    -DLLAMA_BUILD_COMMIT="$commit"         # the tree has no git history: the commit the sdist vendors
  )
  if [ "$BACKEND" = cuda ]; then
    opts+=(
      -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real   # sm_90 machine code only (H100/H200), no PTX
      -DGGML_CUDA_NCCL=OFF                 # collectives between several GPUs; these runs use one
    )
  else
    opts+=(-DGGML_CUDA=OFF)
  fi
  mkdir -p "$BUILD"
  # GIT_DIR points nowhere so that no git command of the configure step reads the enclosing repository.
  GIT_DIR=/nonexistent cmake -S "$LLAMA_SRC" -B "$BUILD" "${opts[@]}" >"$BUILD/configure.log" 2>&1 \
    || { tail -30 "$BUILD/configure.log"; die "cmake configure failed ($BUILD/configure.log)"; }
  { echo "llama.cpp $commit ($LLAMA_SRC/VENDOR.json)"; echo "cmake ${opts[*]}"; } >"$BUILD/options.txt"
}

build() {
  local start=$SECONDS
  configure
  local configured=$SECONDS
  cmake --build "$BUILD" --target llama-bench -j "$JOBS" >"$BUILD/build.log" 2>&1 \
    || { tail -40 "$BUILD/build.log"; die "build failed ($BUILD/build.log)"; }
  {
    cat "$BUILD/options.txt"
    echo "cmake --build --target llama-bench -j $JOBS"
    echo "configure $((configured - start)) s, build $((SECONDS - configured)) s"
    grep -E '^(GGML_(CUDA|CPU|NATIVE|AVX|AMX|FMA|F16C|BMI2|SSE42|LLAMAFILE|OPENMP|BLAS|BACKEND_DL|STATIC|LTO)[A-Z0-9_]*|LLAMA_(BUILD|OPENSSL)[A-Z0-9_]*|BUILD_SHARED_LIBS|CMAKE_CUDA_ARCHITECTURES|CMAKE_BUILD_TYPE|CMAKE_(C|CXX|CUDA)_COMPILER):' \
      "$BUILD/CMakeCache.txt" | sort
    "$BUILD/bin/llama-bench" --version 2>&1 || true
  } >"$BUILD/build-info.txt"
  cp "$BUILD/build-info.txt" "$OUT/build-info.txt"
  sed -n 4p "$BUILD/build-info.txt"
  echo "llama-bench: $BUILD/bin/llama-bench"
}

write() {
  local shape=$1 dir
  dir=$(ckpt_of "$shape")
  if [ -f "$dir/config.json" ]; then echo "checkpoint $dir exists"; return; fi
  mkdir -p "$CKPT_ROOT"
  local device=cuda; [ "$BACKEND" = cpu ] && device=cpu
  # Written under a temporary name and renamed when complete: a call stopped mid-write leaves no checkpoint.
  rm -rf "$dir.part"
  "$PYTHON" "$HERE/bench.py" write --shape "$shape" --layers "$(layers_of "$shape")" --size "${SIZE:-full}" \
    --device "$device" --out "$dir.part"
  mv "$dir.part" "$dir"
}

convert() {
  local shape=$1 dir gguf
  dir=$(ckpt_of "$shape"); gguf=$(gguf_of "$shape")
  [ -f "$dir/config.json" ] || die "no checkpoint at $dir: run.sh write $shape first"
  if [ -f "$gguf" ]; then echo "GGUF $gguf exists"; return; fi
  rm -f "$gguf.part"
  local need free
  need=$(du -sb "$dir" | cut -f1); free=$(df -B1 --output=avail "$WORK" | tail -1)
  [ "$need" -lt "$free" ] || die "the GGUF of $dir needs about $need bytes; $WORK has $free free"
  local start=$SECONDS
  "$PYTHON" "$HERE/convert.py" --llama "$LLAMA_SRC" "$dir" "$gguf.part" >"$WORK/convert-$shape.log" 2>&1 \
    || { tail -20 "$WORK/convert-$shape.log"; die "conversion failed ($WORK/convert-$shape.log)"; }
  mv "$gguf.part" "$gguf"
  echo "converted $dir -> $gguf ($(du -h "$gguf" | cut -f1)) in $((SECONDS - start)) s"
}

# The host's CPU speed beside each side's run: the CPU executor's cold 8-expert call of SHAPE at one token
# (benchmarks/bench_cpu_experts.py, THREADS threads), its JSON line into $RESULTS/SHAPE-NAME-host-WHEN.json;
# `report` sets the probes of a shape side by side (a host whose speed moves between the two sides' runs
# makes their ratio meaningless). HOST_PROBE=0: none.
host_probe() {
  local shape=$1 name=$2 when=$3 probe_shape=qwen3.6
  [ "${HOST_PROBE:-1}" = 0 ] && return 0
  [ "$shape" = dsv2 ] && probe_shape=dsv2-lite
  "$PYTHON" benchmarks/bench_cpu_experts.py --backends cpp --dtypes bfloat16 --shapes "$probe_shape" \
    --threads "$THREADS" --tokens 1 --experts 8 --modes cold --repeats 30 --warmup 3 --max-pool-mib 1024 \
    2>/dev/null | tail -1 >"$RESULTS/$shape-$name-host-$when.json" || echo "host probe of $name ($when) failed"
}

bench() {
  local shape=$1 dir gguf side forced=()
  dir=$(ckpt_of "$shape"); gguf=$(gguf_of "$shape")
  local trace=${FORCED_TRACE:-$REPO/.vendor/traces/esft_summary_routing.npz}
  if [ "$shape" = dsv2 ] && [ -f "$trace" ]; then forced=(--forced-trace "$trace"); fi
  local device=cuda; [ "$BACKEND" = cpu ] && device=cpu
  local common=(--shape "$shape" --checkpoint "$dir" --threads "$THREADS" --pp "${PP:-512}" --tg "${TG:-128}"
                --reps "${REPS:-3}" --results "$RESULTS")
  local policy=()  # POLICY: moecache's placement policy instead of generate's default (e.g. static_layers)
  [ -z "${POLICY:-}" ] || policy=(--policy "$POLICY")
  # STREAM_MIN_TOKENS=N: a prompt's misses used by N entries streamed to the device (runtime.stream_min_tokens;
  # results apart, -stream; 0: none, -nostream); unset: generate's default (auto)
  local stream=() tag=${POLICY:+-$POLICY}
  if [ -n "${STREAM_MIN_TOKENS:-}" ]; then
    stream=(--stream-min-tokens "$STREAM_MIN_TOKENS" ${STREAM_CHUNK:+--stream-chunk "$STREAM_CHUNK"})
    if [ "$STREAM_MIN_TOKENS" = 0 ]; then tag="$tag-nostream"; else tag="$tag-stream"; fi
  fi
  local rc=0  # a side's failure: the other sides still run and every saved result is still copied out
  for side in ${SIDE:-llama moecache}; do
    local name=$side
    case "$side" in llama) ;; moecache) name="moecache$tag" ;; moecache_compiled) name="moecache$tag-compiled" ;; esac
    host_probe "$shape" "$name" before
    case "$side" in
      llama)
        [ -x "$BUILD/bin/llama-bench" ] || die "no llama-bench in $BUILD: run.sh build first"
        [ -f "$gguf" ] || die "no GGUF at $gguf: run.sh convert $shape first"
        # shellcheck disable=SC2086  # LLAMA_ARGS: words for llama-bench
        "$PYTHON" "$HERE/bench.py" llama "${common[@]}" --gguf "$gguf" --llama-bench "$BUILD/bin/llama-bench" \
          --llama-src "$LLAMA_SRC" --llama-args ${LLAMA_ARGS:-} 2>&1 | tee "$RESULTS/$shape-llama.txt" || rc=$? ;;
      moecache)
        [ -f "$dir/config.json" ] || die "no checkpoint at $dir: run.sh write $shape first"
        "$PYTHON" "$HERE/bench.py" moecache "${common[@]}" --device "$device" "${forced[@]}" "${policy[@]}" \
          "${stream[@]}" 2>&1 | tee "$RESULTS/$shape-moecache$tag.txt" || rc=$? ;;
      moecache_compiled)
        [ -f "$dir/config.json" ] || die "no checkpoint at $dir: run.sh write $shape first"
        "$PYTHON" "$HERE/bench.py" moecache "${common[@]}" --device "$device" "${forced[@]}" "${policy[@]}" \
          "${stream[@]}" --compile 2>&1 | tee "$RESULTS/$shape-moecache$tag-compiled.txt" || rc=$? ;;
      *) die "SIDE=$side: expected llama, moecache and/or moecache_compiled" ;;
    esac
    host_probe "$shape" "$name" after
  done
  [ "$OUT" = "$RESULTS" ] || cp "$RESULTS/$shape"-*.json "$RESULTS/$shape"-*.txt "$RESULTS/$shape"-*.stderr "$OUT/" 2>/dev/null || true
  return "$rc"
}

# The machine, into $OUT/env.txt: GPU, CPU, memory, the free space where checkpoints and GGUF files go.
environment() {
  mkdir -p "$CKPT_ROOT"
  { nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>/dev/null || echo "no nvidia-smi"
    lscpu | grep -E 'Model name|^CPU\(s\)|Thread|L3' || true
    grep -E 'MemTotal|MemAvailable' /proc/meminfo
    echo "transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown)"
    df -h "$WORK" "$CKPT_ROOT"
    "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  } 2>&1 | tee "$OUT/env.txt"
}

# Write the checkpoint, then build llama-bench (unless built) while converting it: the build's compilers
# and the converter (one core) overlap, and nothing is measured meanwhile.
prepare() {
  local shape=$1 pid=
  environment
  write "$shape"
  if [ ! -x "$BUILD/bin/llama-bench" ]; then
    build >"$WORK/build-phase.log" 2>&1 &
    pid=$!
  fi
  convert "$shape"
  if [ -n "$pid" ]; then
    wait "$pid" || { cat "$WORK/build-phase.log"; die "build failed"; }
    cat "$WORK/build-phase.log"
  fi
}

# Remove a shape's checkpoint and GGUF (the disk and /dev/shm cannot hold both shapes at once).
clean() {
  rm -rf "$(ckpt_of "$1")" "$(ckpt_of "$1").part" "$(gguf_of "$1")" "$(gguf_of "$1").part"
  echo "removed the $1 checkpoint and GGUF"
}

report() {
  "$PYTHON" "$HERE/bench.py" report --results "$RESULTS" --shapes "$@" | tee "$RESULTS/report.md"
  [ "$OUT" = "$RESULTS" ] || cp "$RESULTS/report.md" "$OUT/"
}

[ $# -ge 1 ] || die "usage: run.sh build | write SHAPE | convert SHAPE | bench SHAPE | report SHAPE... | all SHAPE..."
phase=$1; shift
case "$phase" in
  build) build ;;
  configure) configure ;;
  write|convert|bench|prepare|clean)
    [ $# -eq 1 ] || die "usage: run.sh $phase SHAPE (dsv2 or qwen)"
    shape_ok "$1"; "$phase" "$1" ;;
  report)
    [ $# -ge 1 ] || die "usage: run.sh report SHAPE..."
    for s in "$@"; do shape_ok "$s"; done
    report "$@" ;;
  all)
    [ $# -ge 1 ] || die "usage: run.sh all SHAPE..."
    for s in "$@"; do shape_ok "$s"; done
    for s in "$@"; do prepare "$s"; bench "$s"; done
    report "$@" ;;
  *) die "unknown phase $phase: expected build, configure, write, convert, prepare, bench, clean, report or all" ;;
esac
