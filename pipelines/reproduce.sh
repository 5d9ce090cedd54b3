#!/usr/bin/env bash
# The whole pipeline on the embedded default (tiny random-weight Qwen 3.6-architecture model,
# bundled prompts, CPU), then the real DeepSeek-V2-Lite routing traces when ../shared is present.
# Each stage reuses an identical earlier artifact, so a second run only re-lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
OVR=("$@")  # extra Hydra overrides for every stage, e.g. output_root=/tmp/out

echo "== collect: multi_request (shuffled MT-Bench conversations)"
MULTI=$(moecache collect workload=multi_request "${OVR[@]}" | tail -1)
echo "== collect: long_single (one long context + question)"
moecache collect workload=long_single "${OVR[@]}"
echo "== calibrate: CPU expert time (and CUDA / H2D where CUDA is present)"
moecache calibrate "${OVR[@]}"

TRACES=../shared/data/traces/deepseek-v2-lite-esft
if [ -d "$TRACES" ]; then
  for task in intent law summary translation; do
    echo "== import-trace: DeepSeek-V2-Lite esft_${task}"
    moecache import-trace trace_import.path="$TRACES/esft_${task}_routing.npz" trace_import.name="esft_${task}" "${OVR[@]}"
  done
else
  echo "== import-trace: skipped: $TRACES is absent (the real DeepSeek-V2-Lite traces ship only with ../shared)"
fi

echo "== simulate: cumulative LFU, timed, on the multi_request trace at 16 / 32 / 64 slots"
moecache simulate policy=lfu "capacity=[16,32,64]" "traces=[$MULTI]" "${OVR[@]}"
echo "== sweep: every policy x the capacity grid x every trace above (timed, with sensitivity)"
moecache sweep "${OVR[@]}"

moecache artifacts list
