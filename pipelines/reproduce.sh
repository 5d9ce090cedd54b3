#!/usr/bin/env bash
# The whole pipeline, collect -> analyze -> sweep -> decide -> validate -> report, on the embedded default
# (tiny random-weight Qwen 3.6-architecture model, bundled prompts, CPU), then analyze -> sweep -> decide
# -> report on the real DeepSeek-V2-Lite routing traces when ../shared is present (no model to validate
# there: their checkpoint is not shipped). Each stage names the
# artifacts of the one before (its lineage) and reuses an identical earlier artifact, so a second run
# only re-lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
OVR=("$@")  # extra Hydra overrides for every stage, e.g. output_root=/tmp/out

art_id() { basename "$(tail -1)"; }  # a stage prints its artifact's folder last

# The tiny default's validation: the decided policy and every baseline end to end, at a quarter of the
# experts only (the headline capacity; the conf default is 10/25/50/100%), to keep this run short.
VALIDATE=("validate.capacities=[25%]")

# analyze, sweep, decide (validate when $1 is "validate") and report one set of traces; extra decide
# overrides after the trace list
analyse_and_decide() {
  local validate=$1 traces=$2; shift 2
  echo "== analyze: frequency, drift, locality, transitions, history length on $traces"
  local analysis; analysis=$(moecache analyze "traces=$traces" "${OVR[@]}" | art_id)
  echo "== sweep: every policy x the capacity grid (timed, with sensitivity) on $traces"
  local sweep; sweep=$(moecache sweep "traces=$traces" "${OVR[@]}" | art_id)
  echo "== decide: the pre-registered rule (conf/decide/default.yaml)"
  local decision
  decision=$(moecache decide "decide.sweep=$sweep" "decide.analysis=$analysis" "$@" "${OVR[@]}" | art_id)
  if [ "$validate" = validate ]; then
    echo "== validate: the selected policy and the baselines end to end (tiny model, CPU stand-in)"
    moecache validate "validate.decision=$decision" "${VALIDATE[@]}" "${OVR[@]}"
  fi
  echo "== report"
  moecache report "report.decision=$decision" "${OVR[@]}"
}

# A quarter of the tokens also log the logit-lens token of every MoE layer's input (the token signal
# of the predictive analyses; its cost is measured and excluded from the timings).
LENS=logging.logit_lens.rate=0.25
echo "== collect: multi_request (shuffled MT-Bench conversations)"
MULTI=$(moecache collect workload=multi_request "$LENS" "${OVR[@]}" | art_id)
echo "== collect: long_single (one long context + question)"
LONG=$(moecache collect workload=long_single "$LENS" "${OVR[@]}" | art_id)
echo "== calibrate: CPU expert time (and CUDA / H2D where CUDA is present)"
moecache calibrate "${OVR[@]}"
echo "== simulate: cumulative LFU, timed, on the multi_request trace at 16 / 32 / 64 slots"
moecache simulate policy=lfu "capacity=[16,32,64]" "traces=[$MULTI]" "${OVR[@]}"
analyse_and_decide validate "[$MULTI,$LONG]"

TRACES=../shared/data/traces/deepseek-v2-lite-esft
if [ -d "$TRACES" ]; then
  REAL=()
  for task in intent law summary translation; do
    echo "== import-trace: DeepSeek-V2-Lite esft_${task}"
    REAL+=("$(moecache import-trace trace_import.path="$TRACES/esft_${task}_routing.npz" \
      trace_import.name="esft_${task}" "${OVR[@]}" | art_id)")
  done
  # The ESFT traces are one workload class (teacher-forced samples of one task, many requests each):
  # the rule requires the classes present rather than the tiny model's two.
  analyse_and_decide no-validate "[$(IFS=,; echo "${REAL[*]}")]" decide.workloads.required=null
else
  echo "== DeepSeek-V2-Lite traces: skipped: $TRACES is absent (they ship only with ../shared)"
fi

moecache artifacts list
