#!/usr/bin/env bash
# One device-tool call's worth of H200 measurements, by section (each bounded by `timeout`, the whole
# under the tool's 10-minute limit): `bash benchmarks/h200_round.sh SECTION...`, sections runtime,
# runtime_quick, manager, kernels, decode, forced.
# runtime: the runtime / validation / calibration GPU tests, bench_runtime (copy, overlap, manager),
#   bench_cpu_experts with kt-kernel where .whl/kt is carried; STORE_EXPERTS=10240 adds the full-size
#   store (register time, peak RSS) (runtime_quick: the device, manager and
#   decode-loop GPU tests, bench_runtime copy and manager).
# kernels: tests/kernels' GPU tests (KERNEL_TESTS= their -k), tuning the Qwen3.6 decode (TUNE_TOKENS, default
#   1 4 16; prefill entries kept), bench_slot_moe at T = 1, 4, 16. prefill_shape: tune another shape's
#   prefill (SHAPE=, PREFILL_TOKENS=, TUNE_S=; entries of other T kept) and bench it at T = 4096 beside
#   Qwen3.6 (PREFILL_BENCH=0: no bench).
# manager: bench_runtime's manager section (SPLIT_PROFILE=<cost_profile.json>: again with on_miss=split),
#   and bench_copy_enqueue (one copy's host cost, torch's and the driver's).
# decode: bench_decode on the full Qwen3.6 shape (all resident: fused vs split host points; COMPILE=1 adds
#   --compile; SKIP= its --skip list, default hf; DECODE_S its time limit, default 420 s).
# forced: bench_decode's validate baselines at 25% under real DeepSeek-V2-Lite traces (TRACES="law intent",
#   POLICY=, WARM= untimed requests first, REQUESTS=, NEW= tokens, COMPILE=1, FORCED_S= limit per trace).
# fidelity: calibrate (fast loop) + validate on the DeepSeek-V2-Lite shape (MODEL=, MODEL_TAG=), forced (DECISION=, FORCING= ids
#   in .device-data/outputs; REQUESTS=, NEW=, STRATEGIES=, ON_MISS=, CAL_S=, VAL_S=; PROFILE= a cost_profile.json
#   path instead of calibrating; TAG= a suffix for the output files; VAL_ENV="K=V ..." validate's environment,
#   e.g. MOECACHE_CPU_HOST_THREAD=idle; FORCE=1 validate with force=true (a new run though the config is
#   unchanged, as it is under another environment)).
# prefill_all: bench_slot_moe at T = PREFILL_TOKENS (default 512 4096) for every shape, as shipped.
# profile: profile_slot_moe (each launch's device time; PROFILE_SHAPES=, PROFILE_TOKENS=).
# gputests: `pytest -m gpu $TESTS -k $TESTS_K` (TESTS_S limit). prefill: tune the Qwen3.6 prefill (T = 512,
#   4096; TUNE_S budget), bench_slot_moe at T = 512, 4096.
# Results go to $OUT; docs/benchmarks.md records them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/h200-round}
source benchmarks/h200_setup.sh
cat "$OUT/env.txt"
QWEN=conf/model/qwen3_6_35b_a3b.yaml
for section in "$@"; do
  case "$section" in
  runtime)
    echo "== runtime GPU tests"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime tests/validation tests/test_calibration.py 2>&1 | tail -12 | tee "$OUT/runtime_tests.txt"
    echo "== bench_runtime"
    timeout 120 python3 benchmarks/bench_runtime.py --device cuda \
      --sections copy,overlap,manager${STORE_EXPERTS:+,store --store-experts $STORE_EXPERTS} 2>&1 | tail -24 | tee "$OUT/bench_runtime.txt"
    echo "== bench_cpu_experts (cpp, torch, kt)"
    if [ -d .whl/kt ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-kt .whl/kt/*.whl; fi
    PYTHONPATH=/tmp/site-kt:${PYTHONPATH:-} timeout 200 python3 benchmarks/bench_cpu_experts.py --backends cpp,torch,kt \
      --dtypes bfloat16 --shapes qwen3.6 --threads 8,15,16 --tokens 1,16 --experts 1,8 --repeats 20 --warmup 3 \
      --max-pool-mib 1024 2>"$OUT/kt_stderr.txt" | tail -40 | tee "$OUT/bench_cpu_experts.txt" ;;
  runtime_quick)
    echo "== device, manager and decode-loop GPU tests"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_device.py tests/runtime/test_manager_gpu.py \
      tests/runtime/test_decode_loop.py -k "not compiled" 2>&1 | tail -6 | tee "$OUT/runtime_quick_tests.txt"
    echo "== bench_runtime copy, manager"
    timeout 100 python3 benchmarks/bench_runtime.py --device cuda --sections copy,manager 2>&1 | tail -16 | tee "$OUT/bench_runtime_quick.txt" ;;
  manager)
    echo "== bench_runtime manager"
    timeout 100 python3 benchmarks/bench_runtime.py --device cuda --sections manager 2>&1 | tail -12 | tee "$OUT/bench_runtime_manager.txt"
    if [ -n "${SPLIT_PROFILE:-}" ]; then
      echo "== bench_runtime manager, on_miss=split weighing $SPLIT_PROFILE"
      timeout 100 python3 benchmarks/bench_runtime.py --device cuda --sections manager --on-miss split \
        --cost-profile "$SPLIT_PROFILE" 2>&1 | tail -14 | tee "$OUT/bench_runtime_manager_split.txt"
    fi
    echo "== bench_copy_enqueue (DeepSeek-V2-Lite expert)"
    timeout 60 python3 benchmarks/bench_copy_enqueue.py 2>&1 | tail -8 | tee "$OUT/bench_copy_enqueue.txt" ;;
  kernels)
    echo "== kernel GPU tests"
    PYTHONPATH=$PWD/kernels:$PWD timeout 150 python3 -m pytest tests/kernels -q -p no:cacheprovider -m gpu -k "${KERNEL_TESTS:-decode_is_bit_identical or graph}" 2>&1 | tail -8 | tee "$OUT/kernel_tests.txt"
    echo "== tune the Qwen3.6 decode"
    PYTHONPATH=$PWD/kernels:$PWD timeout $(( ${TUNE_S:-100} + 40 )) python3 benchmarks/tune_slot_moe.py --hidden 2048 --inter 512 --experts 256 --top-k 8 \
      --tokens ${TUNE_TOKENS:-1 4 16} --budget-s "${TUNE_S:-100}" \
      --merge-from kernels/moecache_kernels/configs --out-dir "$OUT/configs" 2>&1 | tail -20 | tee "$OUT/tune.txt"
    for f in "$OUT"/configs/*.json; do cp "$f" kernels/moecache_kernels/configs/; cp "$f" "$OUT/tuned-qwen3_6.json"; done
    echo "== bench_slot_moe T = 1, 4, 16"
    PYTHONPATH=$PWD/kernels:$PWD timeout 120 python3 benchmarks/bench_slot_moe.py --quick --tokens 1 4 16 2>&1 | tail -40 | tee "$OUT/bench_slot_moe.txt" ;;
  profile)
    echo "== profile_slot_moe: each launch's device time (PROFILE_SHAPES, PROFILE_TOKENS)"
    PYTHONPATH=$PWD/kernels:$PWD timeout 150 python3 benchmarks/profile_slot_moe.py --shapes ${PROFILE_SHAPES:-qwen3.6 qwen3-30b} \
      --tokens ${PROFILE_TOKENS:-1 4096} 2>&1 | tail -40 | tee "$OUT/profile_slot_moe.txt" ;;
  prefill_all)
    echo "== bench_slot_moe T = ${PREFILL_TOKENS:-512 4096}, every shape (the shipped configs)"
    PYTHONPATH=$PWD/kernels:$PWD timeout 240 python3 benchmarks/bench_slot_moe.py --quick --tokens ${PREFILL_TOKENS:-512 4096} 2>&1 | tail -80 | tee "$OUT/bench_slot_moe_prefill_all.txt" ;;
  gputests)
    echo "== GPU tests: ${TESTS} -k ${TESTS_K:-.}"
    PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-} timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS ${TESTS_K:+-k "$TESTS_K"} \
      2>&1 | tail -12 | tee "$OUT/gpu_tests.txt" ;;
  prefill)
    echo "== tune the Qwen3.6 prefill (T = 512, 4096)"
    PYTHONPATH=$PWD/kernels:$PWD timeout $(( ${TUNE_S:-200} + 40 )) python3 benchmarks/tune_slot_moe.py --hidden 2048 --inter 512 --experts 256 \
      --top-k 8 --tokens 512 4096 --budget-s "${TUNE_S:-200}" --merge-from kernels/moecache_kernels/configs --out-dir "$OUT/configs" 2>&1 | tail -20 | tee "$OUT/tune_prefill.txt"
    for f in "$OUT"/configs/*.json; do cp "$f" kernels/moecache_kernels/configs/; cp "$f" "$OUT/tuned-prefill-qwen3_6.json"; done
    echo "== bench_slot_moe T = 512, 4096"
    PYTHONPATH=$PWD/kernels:$PWD timeout 150 python3 benchmarks/bench_slot_moe.py --quick --tokens 512 4096 2>&1 | tail -40 | tee "$OUT/bench_slot_moe_prefill.txt" ;;
  prefill_shape)
    # tune the prefill (T = 4096) of one more shape of bench_slot_moe's (SHAPE=dsv2-lite, qwen3-30b, large),
    # then bench_slot_moe at T = 4096 for it and Qwen3.6
    read -r H I E K <<<"$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_slot_moe import SHAPES; print(*SHAPES['${SHAPE:-dsv2-lite}'])")"
    echo "== tune the ${SHAPE:-dsv2-lite} prefill (H $H, I $I, E $E, K $K; T = ${PREFILL_TOKENS:-4096})"
    PYTHONPATH=$PWD/kernels:$PWD timeout $(( ${TUNE_S:-90} + 40 )) python3 benchmarks/tune_slot_moe.py --hidden $H --inter $I --experts $E \
      --top-k $K --tokens ${PREFILL_TOKENS:-4096} --budget-s "${TUNE_S:-90}" --merge-from kernels/moecache_kernels/configs --out-dir "$OUT/configs" 2>&1 | tail -20 | tee "$OUT/tune_prefill_${SHAPE:-dsv2-lite}.txt"
    for f in "$OUT"/configs/E=$E,N=$I,device_name=*,dtype=bfloat16.json; do
      cp "$f" kernels/moecache_kernels/configs/ && cp "$f" "$OUT/tuned-prefill-${SHAPE:-dsv2-lite}.json"
    done
    [ "${PREFILL_BENCH:-1}" = 0 ] && continue
    echo "== bench_slot_moe T = 4096, ${SHAPE:-dsv2-lite} and qwen3.6"
    PYTHONPATH=$PWD/kernels:$PWD timeout 150 python3 benchmarks/bench_slot_moe.py --quick --tokens 4096 --shapes qwen3.6 ${SHAPE:-dsv2-lite} 2>&1 | tail -20 | tee "$OUT/bench_slot_moe_4096.txt" ;;
  decode)
    echo "== bench_decode Qwen3.6, all resident, fused vs split"
    timeout ${DECODE_S:-420} python3 benchmarks/bench_decode.py --model $QWEN --capacities 100% --prompt-tokens 512 \
      --new-tokens 64 --skip "${SKIP:-hf}" ${COMPILE:+--compile} 2>&1 | grep -v '^\[transformers\]' | tail -30 | tee "$OUT/bench_decode_qwen.txt" ;;
  forced)
    for t in ${TRACES:-law}; do
      echo "== bench_decode DeepSeek-V2-Lite, forced by the $t trace, 25%"
      timeout "${FORCED_S:-540}" python3 benchmarks/bench_decode.py --model conf/model/deepseek_v2_lite.yaml --dtype bfloat16 \
        --strategies all --policy "${POLICY:-transition_prefetch}" --capacities 25% --forced-trace ".device-data/esft_${t}_routing.npz" \
        --warm-requests "${WARM:-0}" --requests "${REQUESTS:-2}" --prompt-tokens 32 --new-tokens "${NEW:-64}" ${COMPILE:+--compile} \
        2>&1 | grep -v '^\[transformers\]' | tail -30 | tee "$OUT/bench_decode_forced_$t.txt"
    done ;;
  fidelity)
    # Issue 13's fidelity on the H200: calibrate the DeepSeek-V2-Lite shape (random weights, the fast loop's
    # non-expert time), then validate the decision DECISION forced by the trace import FORCING (both made
    # on the dev VM into .device-data/outputs: import-trace, analyze, sweep, decide) with that profile;
    # ON_MISS: the selected policy's validate.on_miss (cpu, split).
    # MODEL= another conf/model (e.g. qwen3_6_35b_a3b with a FORCING import reshaped onto it), MODEL_TAG= its
    # file suffix (default dsv2); CAPACITIES= validate.capacities (default [25%]); FORCING may be a list
    # ("[a,b]": held-out fidelity, docs/validation.md); CAL_ARGS= / VAL_ARGS= extra calibrate / validate overrides.
    ROOT=output_root=$PWD/.device-data/outputs
    MT=${MODEL_TAG:-dsv2}
    M="model=${MODEL:-deepseek_v2_lite} model.path=null model.random.seed=0 device=cuda $ROOT"
    if [ -n "${PROFILE:-}" ]; then  # a profile calibrated before (a cost_profile.json path): no calibrate
      case "$PROFILE" in /*) PROF=$PROFILE ;; *) PROF=$PWD/$PROFILE ;; esac
    else
      echo "== calibrate ${MODEL:-deepseek_v2_lite} (cost.runtime.step=fast)"
      timeout "${CAL_S:-300}" python3 -m moecache.cli calibrate $M cost.runtime.step=fast "cost.dtypes=[bfloat16]" \
        cost.repeats=20 ${CAL_ARGS:-} 2>&1 | grep -v '^\[transformers\]' | tail -40 | tee "$OUT/calibrate_$MT.txt"
      CAL=$(tail -1 "$OUT/calibrate_$MT.txt")
      PROF=$CAL/cost_profile.json
      cp "$PROF" "$OUT/cost_profile_$MT.json" || exit 1
    fi
    echo "== validate, fast loop, with that profile"
    timeout "${VAL_S:-300}" env ${VAL_ENV:-} python3 -m moecache.cli validate validate.decision="$DECISION" $M validate.forced_trace="$FORCING" \
      validate.forced_requests="${REQUESTS:-2}" validate.forced_max_tokens="${NEW:-33}" "validate.capacities=${CAPACITIES:-[25%]}" \
      "validate.strategies=[${STRATEGIES:-all_resident,all_cpu,lru_sync,selected}]" validate.loop=fast \
      validate.cost_profile="$PROF" validate.on_miss="${ON_MISS:-cpu}" ${FORCE:+force=true} ${VAL_ARGS:-} 2>&1 | grep --line-buffered -v '^\[transformers\]' \
      | tee "$OUT/validate_$MT${TAG:-}.log" | tail -60 | tee "$OUT/validate_$MT${TAG:-}.txt"  # .log: every line as it comes
    VAL=$(tail -1 "$OUT/validate_$MT${TAG:-}.txt")
    cp "$VAL/validation.json" "$OUT/validation_$MT${TAG:-}.json"
    for table in runs agreement fidelity latency; do cp "$VAL/$table.parquet" "$OUT/${table}_$MT${TAG:-}.parquet"; done
    # one file (the tool returns no deep folders), of the traces the runs kept (a repeat's median one):
    # what rejudge_fidelity.py and fidelity_sensitivity.py replay; every repeat's stays in $VAL
    python3 -c "import json, sys; print('\n'.join(r['trace'] for r in json.load(open(sys.argv[1]))['runs']))" \
      "$VAL/validation.json" | tar -C "$VAL" -czf "$OUT/traces_$MT${TAG:-}.tgz" -T -
    echo "== the runs' CPU path per call against the profile's (entries at one token each)"
    python3 - "$OUT/validation_$MT${TAG:-}.json" "$PROF" <<'PY'
import json, sys
from moecache.cost_profile import CostProfile
runs = json.load(open(sys.argv[1]))["runs"]
costs = CostProfile.load(sys.argv[2]).runtime_costs()
for r in runs:
    us, n = r.get("decode_cpu_path_us_per_call"), r.get("decode_cpu_entries_per_call")
    if us is not None:
        model = costs.cpu_call_us + n * float(costs.cpu_expert_us(1))
        print(f"{r['strategy']:16s} run {us:8.1f} us/call, {n:.2f} entries; profile {model:8.1f} us; manager "
              f"{r['decode_manager_us_per_visit']:.1f} us/visit, read-back wait "
              f"{r.get('decode_readback_wait_us_per_visit') or 0:.1f} us/visit")
for r in runs:
    errors = json.loads(r["fidelity_errors"]) if r.get("fidelity_errors") else None
    if errors:
        phases = "; ".join(f"{k} {v['measured_ms']:.2f} -> {v['predicted_ms']:.2f} ms/token ({v['error_pct']:+.1f}%)"
                           for k, v in errors.get("phases", {}).items())
        print(f"{r['strategy']:16s} time/token {errors['time_per_token_error_pct']:+.1f}%: {phases}")
    anchored = json.loads(r["fidelity_errors_anchored"]) if r.get("fidelity_errors_anchored") else None
    if anchored:
        print(f"{r['strategy']:16s} anchored on this validate's own runs: time/token "
              f"{anchored['time_per_token_error_pct']:+.1f}%")
check = json.load(open(sys.argv[1])).get("machine_check")
for probe in (check or {}).get("probes", []):
    print(f"machine since calibrate ({probe['probe']}): {probe['change_pct_before']:+.1f}% before the runs,"
          f" {probe['change_pct_after']:+.1f}% after{' (changed)' if check['changed'] else ''}")
PY
    ;;
  *) echo "unknown section $section"; exit 2 ;;
  esac
done
