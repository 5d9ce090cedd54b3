#!/usr/bin/env bash
# Fetch llama.cpp's source, trimmed, into .vendor/llama.cpp (run here, where the package index is reachable;
# the device machine has no network and gets the tree through the device tool's `carry`).
#
# The source is the one llama-cpp-python vendors in its source distribution on the package index, downloaded
# with pip (pinned: LLAMA_CPP_PYTHON_VERSION, default below, its sha256 checked against SDIST_SHA256). Kept:
# what the llama-bench target compiles (CMake files, src/, include/, common/, vendor/, ggml/ with its CPU
# and CUDA backends, the tools that tools/CMakeLists.txt configures) and what convert_hf_to_gguf.py imports
# (conversion/, gguf-py/). Removed: docs, test models, tests, examples, benchmarks data, the web UI and server,
# the other ggml backends (Metal, Vulkan, SYCL, ...: configured only when switched on), CI files.
# No file of src/, ggml/src/ggml-cpu, ggml/src/ggml-cuda, common/ or tools/llama-bench is removed.
#
# Writes .vendor/llama.cpp/VENDOR.json (the sdist, its sha256, the llama.cpp commit its changelog names,
# the ggml version, what was removed) and prints the trimmed size. Also copies the real DeepSeek-V2-Lite
# routing trace the trace-forced runs replay (../shared/data/traces/deepseek-v2-lite-esft, MIT, with its
# README and licence) into .vendor/traces: ../shared does not travel to the device machine.
#
#   benchmarks/vs_llamacpp/fetch_llamacpp.sh            # from the repository root or anywhere
#   FORCE=1 benchmarks/vs_llamacpp/fetch_llamacpp.sh    # replace an existing .vendor/llama.cpp
#   CHECK_TRIM=1 ...                                    # and prove the trim changes nothing llama-bench compiles
#
# CHECK_TRIM=1 configures llama-bench (run.sh configure: the device build's options) from the full vendored
# tree and from the trimmed one for the CPU (and for CUDA sm_90 with CHECK_TRIM_CUDA=1, on a machine with the
# CUDA toolkit: nvcc and cuBLAS), and compares what ninja would run to build llama-bench (`ninja -t commands`:
# every compile and link) and the sources of CMake's unity files, each tree's and build folder's path
# replaced by one name: identical lists mean an identical llama-bench. It also compares, file by file, the
# folders llama-bench's CPU and CUDA builds compile from (the CUDA backend globs its sources from its own
# folder): none may differ.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
# sha256 of llama_cpp_python-0.3.36.tar.gz as the package index served it (checked below; empty: not checked).
SDIST_SHA256=${SDIST_SHA256-$([ "$VERSION" = 0.3.36 ] && echo 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e)}
DEST=${LLAMA_DEST:-$REPO/.vendor/llama.cpp}   # where the trimmed tree goes
PYTHON=${PYTHON:-python3}
[ -x "$REPO/.venv/bin/python" ] && PYTHON="$REPO/.venv/bin/python"

if [ -e "$DEST" ] && [ -z "${FORCE:-}" ]; then
  echo "fetch_llamacpp: $DEST exists (FORCE=1 replaces it)" >&2
  exit 2
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# The source distribution only (no wheel, no dependencies).
"$PYTHON" -m pip download -q --no-binary :all: --no-deps -d "$TMP" "llama-cpp-python==$VERSION"
SDIST="$TMP/llama_cpp_python-$VERSION.tar.gz"
[ -f "$SDIST" ] || { echo "fetch_llamacpp: pip saved no $SDIST" >&2; exit 2; }
SHA=$(sha256sum "$SDIST" | cut -d' ' -f1)
if [ -n "$SDIST_SHA256" ] && [ "$SHA" != "$SDIST_SHA256" ]; then
  echo "fetch_llamacpp: $SDIST has sha256 $SHA, expected $SDIST_SHA256" >&2
  exit 2
fi

# The vendored tree and the sdist's changelog (it names the llama.cpp commit each release vendors).
TOP="llama_cpp_python-$VERSION"
tar -xzf "$SDIST" -C "$TMP" "$TOP/vendor/llama.cpp" "$TOP/CHANGELOG.md"
SRC="$TMP/$TOP/vendor/llama.cpp"

# Paths removed, relative to the llama.cpp root. Each is outside the llama-bench target and outside what
# convert_hf_to_gguf.py imports; configure-time references were checked (tools/CMakeLists.txt adds ui,
# server and cli only with LLAMA_BUILD_SERVER, rpc only with GGML_RPC, tuning only with GGML_METAL;
# ggml/src/CMakeLists.txt adds a backend's folder only when that backend is on; app/ only with
# LLAMA_BUILD_APP; examples/ and pocs/ only with LLAMA_BUILD_EXAMPLES; tests/ only with LLAMA_BUILD_TESTS).
REMOVED=(
  .git .github .devops .gemini .pi ci docs models tests examples benches media pocs app scripts skills
  grammars flake.nix build-xcframework.sh AGENTS.md CLAUDE.md CODEOWNERS CONTRIBUTING.md SECURITY.md
  convert_hf_to_gguf_update.py convert_llama_ggml_to_gguf.py convert_lora_to_gguf.py
  tools/ui tools/server tools/cli tools/rpc tools/tuning gguf-py/tests
  ggml/src/ggml-blas ggml/src/ggml-cann ggml/src/ggml-et ggml/src/ggml-hexagon ggml/src/ggml-hip
  ggml/src/ggml-metal ggml/src/ggml-musa ggml/src/ggml-opencl ggml/src/ggml-openvino ggml/src/ggml-rpc
  ggml/src/ggml-sycl ggml/src/ggml-virtgpu ggml/src/ggml-vulkan ggml/src/ggml-webgpu ggml/src/ggml-zdnn
  ggml/src/ggml-zendnn
)
for path in "${REMOVED[@]}"; do
  rm -rf "${SRC:?}/$path"
done
# What the trim must keep (the build and the converter fail without them).
for path in CMakeLists.txt src include common vendor ggml/src/ggml-cpu ggml/src/ggml-cuda tools/llama-bench \
  convert_hf_to_gguf.py conversion gguf-py/gguf; do
  [ -e "$SRC/$path" ] || { echo "fetch_llamacpp: $path is missing from the vendored tree" >&2; exit 2; }
done

COMMIT=$(sed -n 's/.*update llama.cpp to ggml-org\/llama.cpp@\([0-9a-f]\{7,40\}\).*/\1/p' "$TMP/$TOP/CHANGELOG.md" | head -1)
GGML_VERSION=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$SRC/ggml/CMakeLists.txt" | paste -sd.)
[ -n "$COMMIT" ] || { echo "fetch_llamacpp: no llama.cpp commit in the sdist's CHANGELOG.md" >&2; exit 2; }
"$PYTHON" - "$SRC/VENDOR.json" "$VERSION" "$SHA" "$COMMIT" "$GGML_VERSION" "${REMOVED[@]}" <<'EOF'
import json, sys
out, version, sha, commit, ggml, *removed = sys.argv[1:]
json.dump({
    "source": f"llama-cpp-python=={version} sdist (pip download --no-binary :all: --no-deps), vendor/llama.cpp",
    "sdist_sha256": sha,
    "llama_cpp_commit": commit,
    "llama_cpp_commit_from": "the sdist's CHANGELOG.md, the entry of this release",
    "ggml_version": ggml,
    "removed": removed,
}, open(out, "w"), indent=1)
EOF

if [ -n "${CHECK_TRIM:-}" ]; then
  FULL="$TMP/full"
  mkdir -p "$FULL"
  tar -xzf "$SDIST" -C "$FULL" --strip-components=3 "$TOP/vendor/llama.cpp"
  rm -f "$FULL/.git"  # a submodule pointer to a git folder the sdist does not have
  cp "$SRC/VENDOR.json" "$FULL/"
  for dir in src include common vendor ggml/include ggml/cmake ggml/src/ggml-cpu ggml/src/ggml-cuda tools/llama-bench; do
    diff -rq "$FULL/$dir" "$SRC/$dir" >/dev/null || { echo "fetch_llamacpp: trim check: $dir differs" >&2; exit 2; }
  done
  echo "trim check: src include common vendor ggml/include ggml/cmake ggml/src/ggml-cpu ggml/src/ggml-cuda tools/llama-bench are identical in both trees"
  backends=(cpu)
  [ -n "${CHECK_TRIM_CUDA:-}" ] && backends+=(cuda)
  for backend in "${backends[@]}"; do
    for tree in full trimmed; do
      src=$([ "$tree" = full ] && echo "$FULL" || echo "$SRC")
      BACKEND=$backend LLAMA_SRC=$src BUILD="$TMP/build-$tree-$backend" WORK="$TMP/work" PYTHON="$PYTHON" \
        "$REPO/benchmarks/vs_llamacpp/run.sh" configure
      { ninja -C "$TMP/build-$tree-$backend" -t commands llama-bench
        find "$TMP/build-$tree-$backend" -path '*Unity*' -name '*.cxx' | sort | xargs cat
      } | sed -e "s#$TMP/build-$tree-$backend#BUILD#g" -e "s#$src#SRC#g" >"$TMP/commands-$tree-$backend.txt"
    done
    if cmp -s "$TMP/commands-full-$backend.txt" "$TMP/commands-trimmed-$backend.txt"; then
      echo "trim check ($backend): llama-bench's $(grep -c . "$TMP/commands-full-$backend.txt") build lines are identical in the full and the trimmed tree"
    else
      diff "$TMP/commands-full-$backend.txt" "$TMP/commands-trimmed-$backend.txt" | head -20
      echo "fetch_llamacpp: trim check ($backend): the trimmed tree builds llama-bench differently" >&2
      exit 2
    fi
  done
fi

rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$SRC" "$DEST"
TRACES="$REPO/../shared/data/traces/deepseek-v2-lite-esft"
if [ -f "$TRACES/esft_summary_routing.npz" ]; then
  mkdir -p "$REPO/.vendor/traces"
  install -m 0644 "$TRACES/esft_summary_routing.npz" "$TRACES/README.md" "$TRACES/LICENSE-CODE" "$REPO/.vendor/traces/"
  echo "trace: $REPO/.vendor/traces/esft_summary_routing.npz"
else
  echo "fetch_llamacpp: no $TRACES/esft_summary_routing.npz: the trace-forced runs will be skipped" >&2
fi
echo "llama.cpp $COMMIT (ggml $GGML_VERSION) from llama-cpp-python $VERSION -> $DEST"
echo "trimmed tree: $(du -sh "$DEST" | cut -f1) ($(find "$DEST" -type f | wc -l) files); .vendor: $(du -sh "$REPO/.vendor" | cut -f1); .whl: $(du -sh "$REPO/.whl" 2>/dev/null | cut -f1)"
