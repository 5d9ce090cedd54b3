#!/usr/bin/env bash
# The open H200 measurements as one queue that outlives the device tool's 10-minute calls: `start` copies
# the repository to $MC and runs the queue there in a process session of its own (setsid), so it keeps
# running between calls while the machine is held; `wait S` returns after S seconds or when the queue is
# done, with every result so far in $OUT/res.tgz. Each call must follow the previous one within the
# machine's warm window, or the machine (and the queue) is given back.
#
#   here, first:   bash benchmarks/h200_queue.sh devprep   (the fidelity part's artifacts, into .device-data)
#   device call 1: bash benchmarks/h200_queue.sh start && bash benchmarks/h200_queue.sh wait 540
#                  (carry: .whl .vendor/llama.cpp .vendor/traces .device-data)
#   later calls:   bash benchmarks/h200_queue.sh wait 570
#
# The queue, in the order its results matter; each step's failure is logged and the next one runs:
#   1. the DeepSeek-V2-Lite random checkpoint in the Hugging Face layout, on the disk (benchmarks/vs_llamacpp
#      run.sh write: the same checkpoint serves the loader benchmark and the llama.cpp comparison);
#   2. the loader (benchmarks/h200_load.sh on that checkpoint, cold and warm, then the random Qwen3.6 shape);
#   3. at once: llama-bench's build (nice), the GPU tests (`pytest -m gpu`), the checkpoint's GGUF conversion
#      (nothing is timed while the build runs);
#   4. moecache beside llama.cpp on the DeepSeek-V2-Lite shape (run.sh bench dsv2: llama.cpp, moecache as
#      generate runs by default, compiled, compiled with static_layers; then report);
#   5. held-out fidelity and output agreement (benchmarks/h200_round.sh fidelity): calibrate the
#      DeepSeek-V2-Lite shape (fast loop), then
#      validate forced by the ESFT law and intent traces at 10/25/50% (ids in .device-data/ids.txt: the
#      import, sweep and decide artifacts `devprep` makes on the dev machine into .device-data/outputs);
#      `fidelity_qwen` (not in the default PARTS) the same on the Qwen3.6 shape with those traces reshaped
#      there (devprep puts the two .npz files in .vendor/traces);
#   6. `llama_qwen`: the Qwen3.6 shape beside llama.cpp (write; build unless built, while converting; bench,
#      moecache compiled too);
#   6a. `llama_qwen_static`: the same, llama.cpp and moecache compiled with static_layers only;
#   6b. `llama_dsv2`: 1, 3 and 4 without the loader and the GPU tests (carry .vendor/traces for the forced rows);
#   6c. `llama_lfu`: both shapes beside llama.cpp, moecache compiled with its default policy (lfu) only;
#   6d. `stream_dsv2`: the runtime's GPU tests, then DeepSeek-V2-Lite beside llama.cpp with a prompt's misses
#       streamed (generate's default; NOSTREAM=1: and not); `clean_dsv2` frees its checkpoint and GGUF;
#   6e. `llama_qwen_rounds`: the Qwen3.6 shape beside llama.cpp in rounds (llama.cpp, lfu and static_layers
#       compiled back to back in each);
#   6f. `llama_dsv2_rounds`: DeepSeek-V2-Lite beside llama.cpp in rounds (llama.cpp, then generate's default
#       compiled, back to back in each);
#   6g. `split_misses`: a decode visit's misses split between the CPU executor and copies over the host link;
#   6h. `decode_stream`: a share of each decode visit's misses on the device: its GPU tests and an A/B of the
#       compiled decode step on both shapes;
#   7. `decode_compiled`: DeepSeek-V2-Lite all resident and all on the CPU, compiled and not (bench_decode.py);
#   8. `decode_qwen`: where an offloaded Qwen3.6 step's time goes: bench_decode.py on the 20 layers of the
#      llama.cpp table, all resident and every expert on the CPU, compiled, with the host point's read-back
#      wait, manager and CPU-path time per MoE layer; every expert on the CPU and 50% uncompiled; each
#      offloaded run with the layer's visit deferred (the default) and before its CPU half (--visit-first);
#   9. `decode_qwen_policies`: 50% and 25% with static_layers (llama.cpp's split) and with lfu; the CPU
#      path alone at 1, 2, 4 and 8 experts per call.
#   10. `fla_qwen`: the Qwen3.6 shape's decode with flash-linear-attention's kernels and without (carry
#      .whl-fla);
#   11. `profile_qwen`: the compiled Qwen3.6 step's device time by kernel kind, all resident and at 50%;
#   12. `agreement_whole` / `agreement_whole_qwen`: whole-model output agreement over hundreds of positions per
#      workload (carry .device-data; the Qwen3.6 one .vendor/traces too);
#   13. `router_topk`: the routers' one-launch top-k, its GPU tests and an A/B of the decode step;
#       `topk_tests`: its GPU tests alone; `topk_bench`: the kernel alone against torch.topk at each num_warps.
#   14. `host_point`: the host point's Python around the CPU executor with the caches cold, this host's CPU.
#   15. `pages`: the CPU path's cold call with its weights in huge pages and in base pages.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
MC=${MC:-/tmp/mc}                 # the queue's own copy of the repository
RES=${RES:-/tmp/res}              # results (returned as $OUT/res.tgz)
CK=${CK:-/tmp/ck}                 # Hugging Face checkpoints (disk: the loader's cold read needs one)
VS=${VS:-/tmp/vsw}                # llama.cpp build, GGUF files, its results
MCO=${MCO:-/tmp/mco}              # moecache's output root (the fidelity part's: .device-data/outputs)

log() { echo "[$(date +%T)] $*" | tee -a "$RES/progress.txt"; }

step() {  # step NAME SECONDS COMMAND...: one logged, time-limited step; its output in $RES/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  log "start $name"
  timeout "$limit" "$@" >"$RES/$name.log" 2>&1
  local rc=$?
  log "end $name rc=$rc ($((SECONDS - t0)) s)"
  return $rc
}

# llama.cpp's driver, with the queue's folders (WORK, CKPT_ROOT, BUILD, LLAMA_SRC: exported by pipeline).
VS_RUN=(env OUT="$RES/vs" bash benchmarks/vs_llamacpp/run.sh)
DSV2_CKPT="$CK/dsv2-${LAYERS_DSV2:-27}l-${SIZE:-full}"  # where run.sh writes the dsv2 checkpoint (its ckpt_of)

# The parts, run in the order of PARTS. Default: what issue 29 still lacks on a GPU, `llama_dsv2` (the
# DeepSeek-V2-Lite shape beside llama.cpp on one machine, moecache compiled with its default policy and
# with static_layers; carry .vendor/llama.cpp .vendor/traces); the Qwen3.6 shape the same: `llama_qwen`; where an offloaded Qwen3.6 step's time goes: `decode_qwen_policies
# decode_qwen`; the kernel's decode variants A/B: `kernel`; issue 30's: `agreement_long fidelity
# fidelity_qwen`; the whole round: `load tests_llama bench fidelity llama_qwen
# decode_compiled decode_qwen decode_qwen_policies fidelity_qwen`; the GPU tests while the checkpoint is
# written, without llama.cpp: `tests_write load fidelity`; the kernel's A/B with a retune: `kernel`.
# run.sh write keeps a checkpoint that is there; the step is logged once.
write_dsv2() { [ -f "$DSV2_CKPT/config.json" ] || step write_dsv2 400 "${VS_RUN[@]}" write dsv2; }

part_load() {
  write_dsv2
  step load 800 env OUT="$RES/load" CKPT="$DSV2_CKPT" SECTIONS="dsv2 qwen" bash benchmarks/h200_load.sh
}

part_tests() { step gputests 900 python3 -m pytest -q -p no:cacheprovider -m gpu; }

part_tests_runtime() { step gputests_runtime 600 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime; }

part_tests_decode() {  # the fast decode loop's GPU tests alone
  step gputests_decode 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_decode_loop.py
}

# The slot-pool kernel after its rounding points went in (transformers' numerics: the decode down launch
# reduces each expert's dot product on its own, a cross-warp reduction per k where there was one per
# token): its GPU tests; its decode table (docs/benchmarks.md) on the shipped configs; the Qwen3.6 decode
# retuned for that launch (the entries come back under configs/ in res.tgz and are used by what follows
# in this queue); the decode table again; the prefill table.
part_kernel() {
  part_kernel_check
  step tune_decode_qwen 300 python3 benchmarks/tune_slot_moe.py --hidden 2048 --inter 512 --experts 256 \
    --top-k 8 --tokens 1 4 16 --budget-s 200 --merge-from kernels/moecache_kernels/configs --out-dir "$RES/configs"
  cp "$RES"/configs/*.json kernels/moecache_kernels/configs/ || log "no retuned decode entries"
  step slot_moe_decode_tuned 400 python3 benchmarks/bench_slot_moe.py --quick --tokens 1 4 16
  part_kernel_prefill
}

# The kernel's GPU tests and its decode table on the shipped configs, without the retune; its prefill table.
part_kernel_check() {
  step gputests_kernels 600 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels
  step slot_moe_decode 400 python3 benchmarks/bench_slot_moe.py --quick --tokens 1 4 16
}

# Output agreement on the GPU (the kernel's rounding points): dev's two commands (docs/benchmarks.md).
part_agreement() {
  step agreement_dsv2 600 python3 benchmarks/bench_agreement.py --model conf/model/deepseek_v2_lite.yaml \
    --layers 3 --trace .vendor/traces/esft_law_routing.npz --requests 2 --positions 160 --prompt-tokens 64
  step agreement_qwen 600 python3 benchmarks/bench_agreement.py --model conf/model/qwen3_6_35b_a3b.yaml \
    --layers 4 --requests 2 --positions 160 --prompt-tokens 64
}

# Qwen3.6's agreement over 8 requests (1,280 teacher-forced positions): whether its top-1 gap to eager's
# at 320 positions (0.966-0.972 against 0.981 on the H100) is a near-tie coin or systematic.
part_agreement_long() {
  step agreement_qwen_long 600 python3 benchmarks/bench_agreement.py --model conf/model/qwen3_6_35b_a3b.yaml \
    --layers 4 --requests 8 --positions 160 --prompt-tokens 64
}

part_kernel_prefill() { step slot_moe_prefill 400 python3 benchmarks/bench_slot_moe.py --quick --tokens 512 4096; }

part_tests_write() {  # the GPU tests while the checkpoint is written (nothing is timed meanwhile)
  part_tests &
  local tests=$!
  write_dsv2
  wait "$tests"
}

part_tests_llama() {
  write_dsv2
  ( step build 1200 nice -n 10 "${VS_RUN[@]}" build ) &
  local build=$!
  part_tests &
  local tests=$!
  step convert_dsv2 1200 "${VS_RUN[@]}" convert dsv2
  wait "$build" "$tests"
}

part_bench() {
  step bench_llama 600 env SIDE=llama "${VS_RUN[@]}" bench dsv2
  step bench_moecache 900 env SIDE=moecache "${VS_RUN[@]}" bench dsv2
  step bench_moecache_compiled 900 env SIDE=moecache_compiled "${VS_RUN[@]}" bench dsv2
  step bench_static_compiled 900 env SIDE=moecache_compiled POLICY=static_layers "${VS_RUN[@]}" bench dsv2
  step report 60 "${VS_RUN[@]}" report dsv2
}

# DeepSeek-V2-Lite beside llama.cpp without the GPU tests: the checkpoint, llama-bench's build (nice)
# while the GGUF converts, then `bench` (llama.cpp; moecache as generate runs by default, compiled, and
# compiled with llama.cpp's placement; each with the forced rows where .vendor/traces holds the trace).
part_llama_dsv2() {
  write_dsv2
  ( step build 1200 nice -n 10 "${VS_RUN[@]}" build ) &
  local build=$!
  step convert_dsv2 1200 "${VS_RUN[@]}" convert dsv2
  wait "$build"
  part_bench
}

part_fidelity() { fidelity deepseek_v2_lite "$LAW" "$INT" dsv2; }

# DeepSeek-V2-Lite decode with torch.compile (generate's runtime.compile=true) beside the graphs-only loop
# the llama.cpp comparison runs, all resident (fused and split) and every expert on the CPU (a host point
# and the CPU path at every MoE layer): the llama.cpp table's vocabulary (the real model's), pp512 / tg128.
part_decode_compiled() {
  step decode_compiled 900 python3 benchmarks/bench_decode.py --model conf/model/deepseek_v2_lite.yaml \
    --vocab 102400 --capacities 100%,0% --skip hf,eager,unmodified --compile --prompt-tokens 512 --new-tokens 128
}

# The Qwen3.6 shape offloaded, its step taken apart: the llama.cpp table's 20 layers and vocabulary, pp512 /
# tg128, compiled as in its compiled column, with the host point's read-back wait, manager and CPU-path
# time per MoE layer; then every expert on the CPU and 50% (lfu, generate's default) uncompiled. Every
# offloaded run twice (--visit-first): each layer's visit at the next host point (the default) and before
# its CPU half, an A/B on one machine; then the host point's calls alone, warm and with the caches swept.
part_decode_qwen() {
  step decode_qwen 900 python3 benchmarks/bench_decode.py --model conf/model/qwen3_6_35b_a3b.yaml --layers 20 \
    --capacities 100%,0% --skip hf,eager,unmodified --compile --visit-first --prompt-tokens 512 --new-tokens 128
  step decode_qwen_ab 600 python3 benchmarks/bench_decode.py --model conf/model/qwen3_6_35b_a3b.yaml \
    --layers 20 --capacities 0%,50% --policy lfu --skip hf,eager,unmodified --visit-first --prompt-tokens 512 \
    --new-tokens 128
  # the manager's calls and the CPU half's Python on this host, warm and with 64 MiB swept before each
  step host_point_calls 300 python3 benchmarks/bench_runtime.py --device null --sections manager,cpu_call \
    --capacity 0 --sweep-mib 64
}

# The Qwen3.6 shape at 50% and 25% with llama.cpp's placement (static_layers: whole layers resident, the
# rest on the CPU: no host point at a resident layer, one at a CPU layer) beside lfu's (experts of every
# layer resident, every layer a partial CPU call), each again with every layer split, one model build; the same with the CPU team's OpenMP threads spinning between calls (OMP_WAIT_POLICY=ACTIVE:
# no wake-up at each call); then the CPU path alone at 1-8 experts per call, whose in-place cost at 50%
# (3.7 experts, 416-558 us per call) was near the 8-expert call's (624 us).
part_decode_qwen_policies() {
  local qwen=(python3 benchmarks/bench_decode.py --model conf/model/qwen3_6_35b_a3b.yaml --layers 20
    --skip hf,eager,unmodified --prompt-tokens 512 --new-tokens 128)
  step decode_qwen_policies 600 "${qwen[@]}" --capacities 50%,25% --policy static_layers,lfu --split-all --rounds 2
  step decode_qwen_active 400 env OMP_WAIT_POLICY=ACTIVE "${qwen[@]}" --capacities 50%,25% --policy static_layers,lfu
  step cpu_experts_calls 300 python3 benchmarks/bench_cpu_experts.py --backends cpp --dtypes bfloat16 \
    --shapes qwen3.6 --threads 14,15,16 --tokens 1 --experts 1,2,4,8 --modes cold --gap-us 0,300 \
    --repeats 30 --warmup 3 --max-pool-mib 1024
}

# A share of each decode visit's misses run on the device (runtime.decode_stream_share,
# moecache/runtime/decode_stream.py): its GPU tests, then an A/B of the compiled decode step, lfu at 50% and 25%
# (a third of the misses, rounded down: one of 3-5, two of 6-8), in rounds on both shapes.
part_decode_stream() {
  step gputests_decode_stream 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_decode_stream.py
  local common=(--skip hf,eager,unmodified --prompt-tokens 512 --new-tokens 128 --capacities 50%,25% --policy lfu
    --compile --decode-stream-share 0.34 --rounds 2)
  step decode_stream_qwen 600 python3 benchmarks/bench_decode.py --model conf/model/qwen3_6_35b_a3b.yaml --layers 20 \
    "${common[@]}"
  step decode_stream_dsv2 600 python3 benchmarks/bench_decode.py --model conf/model/deepseek_v2_lite.yaml \
    --vocab 102400 "${common[@]}"
}

# The Qwen3.6 shape beside llama.cpp (run.sh's LAYERS_QWEN layers): the dsv2 files make room first; its
# checkpoint goes to /dev/shm, since the disk cannot hold it and its GGUF at once. moecache compiled with
# its default policy and with llama.cpp's placement (static_layers), then as generate runs by default.
part_llama_qwen() {
  local q=(env CKPT_ROOT=/dev/shm/ck "${VS_RUN[@]}")
  step clean_dsv2 120 "${VS_RUN[@]}" clean dsv2
  step prepare_qwen 1500 "${q[@]}" prepare qwen  # write; then llama-bench's build (unless built) while converting
  step bench_llama_qwen 600 env SIDE=llama "${q[@]}" bench qwen
  step bench_moecache_compiled_qwen 900 env SIDE=moecache_compiled "${q[@]}" bench qwen
  step bench_static_compiled_qwen 900 env SIDE=moecache_compiled POLICY=static_layers "${q[@]}" bench qwen
  step bench_moecache_qwen 900 env SIDE=moecache "${q[@]}" bench qwen
  local shapes=qwen  # with dsv2's where this machine measured them too
  [ ! -f "$VS/results/dsv2-llama.json" ] || shapes="dsv2 qwen"
  # shellcheck disable=SC2086  # shapes: words
  step report_qwen 60 "${VS_RUN[@]}" report $shapes
}

# The Qwen3.6 shape beside llama.cpp again with only the columns that decide the decode target: llama.cpp
# and moecache compiled with llama.cpp's placement (static_layers), on a fresh machine (no dsv2 files).
part_llama_qwen_static() {
  local q=(env CKPT_ROOT=/dev/shm/ck "${VS_RUN[@]}")
  step prepare_qwen 1500 "${q[@]}" prepare qwen
  step bench_llama_qwen 600 env SIDE=llama "${q[@]}" bench qwen
  step bench_static_compiled_qwen 900 env SIDE=moecache_compiled POLICY=static_layers "${q[@]}" bench qwen
  step report_qwen 60 "${VS_RUN[@]}" report qwen
}

# Both shapes beside llama.cpp with moecache's default policy (lfu) compiled, one machine: DeepSeek-V2-Lite
# (its checkpoint on the disk; llama-bench's build while the GGUF converts; the forced rows where
# .vendor/traces holds the trace), then, its files removed, the Qwen3.6 shape (checkpoint in /dev/shm).
part_llama_lfu() {
  local q=(env CKPT_ROOT=/dev/shm/ck "${VS_RUN[@]}")
  write_dsv2
  step prepare_dsv2 1500 "${VS_RUN[@]}" prepare dsv2
  step bench_llama 600 env SIDE=llama "${VS_RUN[@]}" bench dsv2
  step bench_moecache_compiled 900 env SIDE=moecache_compiled "${VS_RUN[@]}" bench dsv2
  step report 60 "${VS_RUN[@]}" report dsv2
  step clean_dsv2 120 "${VS_RUN[@]}" clean dsv2
  step prepare_qwen 1500 "${q[@]}" prepare qwen
  step bench_llama_qwen 600 env SIDE=llama "${q[@]}" bench qwen
  step bench_moecache_compiled_qwen 900 env SIDE=moecache_compiled "${q[@]}" bench qwen
  step report_qwen 60 "${VS_RUN[@]}" report dsv2 qwen
}

# The Qwen3.6 shape beside llama.cpp in ROUNDS rounds (default 2), each round llama.cpp, lfu compiled and
# static_layers compiled back to back (run.sh ROUND=r: results apart, with the host probes), so that each
# round's ratios are of runs minutes apart on a host whose speed drifts.
part_llama_qwen_rounds() {
  local q=(env CKPT_ROOT=/dev/shm/ck "${VS_RUN[@]}") r
  step prepare_qwen 1500 "${q[@]}" prepare qwen
  for r in $(seq "${ROUNDS:-2}"); do
    step "bench_llama_qwen_r$r" 600 env ROUND="$r" SIDE=llama "${q[@]}" bench qwen
    step "bench_moecache_compiled_qwen_r$r" 900 env ROUND="$r" SIDE=moecache_compiled "${q[@]}" bench qwen
    step "bench_static_compiled_qwen_r$r" 900 env ROUND="$r" SIDE=moecache_compiled POLICY=static_layers \
      "${q[@]}" bench qwen
    step "report_qwen_r$r" 60 env ROUND="$r" "${VS_RUN[@]}" report qwen
  done
}

# DeepSeek-V2-Lite beside llama.cpp in ROUNDS rounds (default 2), each llama.cpp then moecache compiled as
# generate runs by default (lfu, a prompt's misses streamed) back to back, results per round (run.sh ROUND=r).
part_llama_dsv2_rounds() {
  local r
  write_dsv2
  step prepare_dsv2 1500 "${VS_RUN[@]}" prepare dsv2
  for r in $(seq "${ROUNDS:-2}"); do
    step "bench_llama_r$r" 600 env ROUND="$r" SIDE=llama "${VS_RUN[@]}" bench dsv2
    step "bench_moecache_compiled_r$r" 900 env ROUND="$r" SIDE=moecache_compiled "${VS_RUN[@]}" bench dsv2
    step "report_r$r" 60 env ROUND="$r" "${VS_RUN[@]}" report dsv2
  done
}

# A prompt's misses streamed to the device (runtime.stream_min_tokens, moecache/runtime/streamed_misses.py):
# the runtime's GPU tests (streaming is generate's default where the slots are on CUDA), then DeepSeek-V2-Lite
# beside llama.cpp on one machine, moecache compiled as generate runs by default (the prompt's experts used
# by at least 32 of a visit's entries streamed), then llama.cpp (its build and conversion after the timed
# run); NOSTREAM=1 adds the same run with streaming off (STREAM_MIN_TOKENS=0) for the A/B.
part_stream_dsv2() {
  part_tests_runtime
  write_dsv2
  step bench_moecache_compiled 900 env SIDE=moecache_compiled "${VS_RUN[@]}" bench dsv2
  step prepare_dsv2 1500 "${VS_RUN[@]}" prepare dsv2
  step bench_llama 600 env SIDE=llama "${VS_RUN[@]}" bench dsv2
  step report 60 "${VS_RUN[@]}" report dsv2
  [ "${NOSTREAM:-0}" = 1 ] || return 0
  step bench_moecache_compiled_nostream 900 env SIDE=moecache_compiled STREAM_MIN_TOKENS=0 "${VS_RUN[@]}" bench dsv2
  step report_nostream 60 "${VS_RUN[@]}" report dsv2
}

# A decode visit's misses split between the CPU and the host link (benchmarks/bench_split_misses.py): do the
# executor and the copies slow each other down? 6 and 4 misses a visit (lfu's at 25% and 50% on Qwen3.6).
part_split_misses() {
  step split_misses_6 300 python3 benchmarks/bench_split_misses.py --misses 6
  step split_misses_4 300 python3 benchmarks/bench_split_misses.py --misses 4
}

part_clean_dsv2() { step clean_dsv2 120 "${VS_RUN[@]}" clean dsv2; }

# The Qwen3.6 shape's linear-attention layers through flash-linear-attention (transformers uses its Triton
# kernels where the `fla` package imports; else its PyTorch reference) against without, one machine:
# bench_decode.py all resident and at 50% (static_layers), graphs only and compiled. The wheels come from
# `.whl-fla` (carry it; made here by `pip download --no-deps -d .whl-fla flash-linear-attention==0.6.0
# fla-core==0.6.0 einops==0.8.2`), installed apart so that every other part runs without them.
part_fla_qwen() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .whl-fla/*.whl
  local qwen=(python3 benchmarks/bench_decode.py --model conf/model/qwen3_6_35b_a3b.yaml --layers 20
    --skip hf,eager,unmodified --prompt-tokens 512 --new-tokens 128 --capacities 100%,50% --policy static_layers
    --compile)
  step decode_qwen_nofla 600 "${qwen[@]}"
  step decode_qwen_fla 600 env PYTHONPATH="/tmp/fla:$PYTHONPATH" "${qwen[@]}"
}

# Where the all-resident Qwen3.6 step's device time goes (benchmarks/profile_decode.py, the llama.cpp
# table's 20 layers, compiled: its 2.865 ms against llama.cpp's 2.742), then the same at 50% with
# llama.cpp's placement.
part_profile_qwen() {
  local p=(python3 benchmarks/profile_decode.py --model conf/model/qwen3_6_35b_a3b.yaml --layers 20 --vocab 32768
    --compile --new-tokens 64 --top 20)
  step profile_qwen 600 "${p[@]}"
  step profile_qwen_static50 600 "${p[@]}" --capacity 50% --policy static_layers
}

# The routers' top-k as one launch (moecache/runtime/router_topk.py): its GPU tests (the kernel is CUDA
# torch.topk's order, ties included, or the probe refuses the router), then the decode step with it and
# with torch's topk, one model each (bench_decode.py --router-topk-ab, two rounds in alternating order):
# the Qwen3.6 llama.cpp shape all resident and at 50% with llama.cpp's placement, compiled and not; the
# DeepSeek-V2-Lite shape all resident and at 25% (lfu).
part_router_topk() {
  part_topk_tests
  step router_topk_qwen 600 python3 benchmarks/bench_decode.py --model conf/model/qwen3_6_35b_a3b.yaml --layers 20 \
    --capacities 100%,50% --policy static_layers --skip hf,eager,unmodified --prompt-tokens 512 --new-tokens 128 \
    --compile --router-topk-ab --rounds 2
  step router_topk_dsv2 600 python3 benchmarks/bench_decode.py --model conf/model/deepseek_v2_lite.yaml \
    --vocab 102400 --capacities 100%,25% --policy lfu --skip hf,eager,unmodified --prompt-tokens 512 \
    --new-tokens 128 --compile --router-topk-ab
}

part_topk_tests() {
  step gputests_topk 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_topk_rows.py \
    tests/runtime/test_router_topk.py
}

# The host point's Python around the CPU executor, caches cold (benchmarks/bench_host_point.py: the CPU
# stand-in, so this host's CPU; capacity 0 and 50% lfu).
part_host_point() {
  step host_point_0 120 python3 benchmarks/bench_host_point.py
  step host_point_50 120 python3 benchmarks/bench_host_point.py --capacity 50% --policy lfu
}

# The CPU path's weights in huge pages against base pages (moecache/models/host_pages.py), this host:
# the kernel's THP mode, then bench_cpu_experts.py's cold 8-expert call at 15 threads on a pool of each.
part_pages() {
  step pages 300 bash -c 'cat /sys/kernel/mm/transparent_hugepage/enabled; python3 benchmarks/bench_cpu_experts.py \
    --backends cpp --dtypes bfloat16 --shapes qwen3.6,dsv2-lite --threads 15 --tokens 1 --experts 8 --modes cold \
    --pages base,huge,base,huge --repeats 50'
}

# The routers' top-k alone: torch.topk against the kernel at each num_warps, one captured graph of a decode
# step's router calls (benchmarks/bench_topk_rows.py).
part_topk_bench() { step topk_bench 300 python3 benchmarks/bench_topk_rows.py; }

# Whole-model output agreement over hundreds of teacher-forced positions per workload (issue 30; validate's
# fidelity parts feed 122): no cost profile; all_resident and the decision's selected policy at 10/25/50%,
# forced by law (9 requests x 120 fed tokens: 1,089 positions) and by intent (22 x 45: 1,012); the timed
# runs 9 tokens a request. agreement_whole_qwen: the same on the Qwen3.6 shape, the traces reshaped here,
# law 9 x 60 fed tokens (549 positions) and intent 22 x 25 (572): its transformers forward costs more.
# AGREE_WORKLOADS_<tag>: the workloads to run (default "law intent").
agreement_whole() {  # agreement_whole MODEL LAW_ID INTENT_ID TAG [LAW_TOKENS INTENT_TOKENS]
  local model=$1 tag=$4 m=(model="$1" model.path=null model.random.seed=0 device=cuda
    "output_root=$MC/.device-data/outputs")
  local -A trace=([law]=$2 [intent]=$3) requests=([law]=9 [intent]=22) tokens=([law]=${5:-120} [intent]=${6:-45})
  local w which="AGREE_WORKLOADS_$tag"
  for w in ${!which:-law intent}; do
    step "agreement_whole_${tag}_$w" 1200 python3 -m moecache.cli validate validate.decision="$DE" "${m[@]}" \
      validate.forced_trace="${trace[$w]}" validate.forced_requests="${requests[$w]}" validate.forced_max_tokens=9 \
      "validate.capacities=[10%,25%,50%]" "validate.strategies=[all_resident,selected]" validate.loop=fast \
      validate.agreement_requests="${requests[$w]}" validate.agreement_tokens="${tokens[$w]}" \
      validate.agreement_float32=false
    local out
    out=$(grep -E "^/" "$RES/agreement_whole_${tag}_$w.log" | tail -1)
    [ -z "$out" ] || cp "$out/agreement.parquet" "$RES/agreement_whole_${tag}_$w.parquet"
    [ -z "$out" ] || cp "$out/validation.json" "$RES/agreement_whole_${tag}_$w.json"
  done
  # both workloads' positions pooled (benchmarks/pool_agreement.py), where both have run on this machine
  local runs=("$RES"/agreement_whole_"${tag}"_*.parquet)
  [ "${#runs[@]}" -lt 2 ] || step "agreement_pooled_$tag" 60 python3 benchmarks/pool_agreement.py "${runs[@]}"
}

part_agreement_whole() { agreement_whole deepseek_v2_lite "$LAW" "$INT" dsv2; }

part_agreement_whole_qwen() {
  import_qwen_traces
  agreement_whole qwen3_6_35b_a3b "${QWEN_IDS[0]}" "${QWEN_IDS[1]}" qwen 60 25
}

# law and intent reshaped onto the Qwen3.6 routing shape (docs/trace-format.md), imported once per queue;
# QWEN_IDS: their import ids
import_qwen_traces() {
  [ "${#QWEN_IDS[@]}" -eq 2 ] && return
  local task
  for task in law intent; do
    step "import_${task}_qwen" 300 python3 -m moecache.cli import-trace \
      "trace_import.path=.vendor/traces/esft_${task}_routing.npz" "trace_import.name=esft_${task}_qwen" \
      trace_import.reshape=qwen3_6_35b_a3b "output_root=$MC/.device-data/outputs"
    QWEN_IDS+=("$(basename "$(grep -E "^/" "$RES/import_${task}_qwen.log" | tail -1)")")
  done
}
QWEN_IDS=()

part_fidelity_qwen() {
  import_qwen_traces
  fidelity qwen3_6_35b_a3b "${QWEN_IDS[0]}" "${QWEN_IDS[1]}" qwen
}

# fidelity MODEL TRACE_A TRACE_B TAG: h200_round.sh's fidelity section, held out on A and B; every
# offloaded run REPEATS times (default 3: validate.repeats, the median repeat kept), about that many
# times the runs' share of the part's time. Output agreement only with AGREE=1 (2 requests x 60 tokens
# teacher-forced after each run's first repeat, one decode forward a token through transformers: most of
# a run's time); the agreement_whole parts measure it over 1,000+ positions.
fidelity() {
  local model=$1 a=$2 b=$3 tag=$4 f32=true total agree=validate.agreement_requests=0
  # The float32 truth widens the model in place (about twice its bytes on the device): only where that fits.
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  { [ "$total" -gt 100000 ] && [ "$tag" = dsv2 ]; } || f32=false
  [ "${AGREE:-0}" = 1 ] && agree="validate.agreement_requests=2 validate.agreement_tokens=60 validate.agreement_float32=$f32"
  step "fidelity_$tag" 1600 env OUT="$RES/fidelity_$tag" MODEL="$model" MODEL_TAG="$tag" DECISION="$DE" \
    FORCING="[$a,$b]" CAPACITIES="[10%,25%,50%]" CAL_S=400 VAL_S=1200 \
    STRATEGIES=all_resident,all_cpu,n_cpu_moe,lru_sync,hindsight_static,selected \
    VAL_ARGS="$agree validate.repeats=${REPEATS:-3}" \
    bash benchmarks/h200_round.sh fidelity
}

pipeline() {
  cd "$MC"
  export PYTHONUNBUFFERED=1 MOECACHE_OUTPUT_ROOT=$MCO
  export WORK="$VS" CKPT_ROOT="$CK" BUILD="$VS/build" LLAMA_SRC="$MC/.vendor/llama.cpp"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$MC:$MC/kernels"
  mkdir -p "$MCO" "$CK" "$VS" "$RES/vs"
  # shellcheck disable=SC1091  # LAW, INT, DE: written by `devprep` on the dev machine
  [ ! -f .device-data/ids.txt ] || source .device-data/ids.txt
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)'
    grep -E 'MemTotal|MemAvailable' /proc/meminfo; df -h /tmp /dev/shm
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  } >"$RES/env.txt" 2>&1
  local part
  for part in ${PARTS:-llama_dsv2}; do
    "part_$part"
  done
  log "queue done"
  touch "$RES/DONE"
}

case "${1:-}" in
  start)
    rm -rf "$MC" "$RES"; mkdir -p "$RES"
    cp -a "$REPO" "$MC"
    setsid nohup bash "$MC/benchmarks/h200_queue.sh" pipeline >"$RES/queue.log" 2>&1 </dev/null &
    echo "queue started in $MC (results in $RES)" ;;
  devprep)  # here, with ../shared: import law and intent, analyze, sweep, decide; ids into .device-data/ids.txt
    rm -rf .device-data/outputs
    cd "$REPO"
    T=../shared/data/traces/deepseek-v2-lite-esft
    O="output_root=$REPO/.device-data/outputs"
    MOECACHE=${MOECACHE:-$REPO/.venv/bin/moecache}
    id() { basename "$(tail -1)"; }
    set -e
    LAW=$("$MOECACHE" import-trace trace_import.path=$T/esft_law_routing.npz trace_import.name=esft_law "$O" | id)
    INT=$("$MOECACHE" import-trace trace_import.path=$T/esft_intent_routing.npz trace_import.name=esft_intent "$O" | id)
    AN=$("$MOECACHE" analyze "traces=[$LAW,$INT]" "$O" | id)
    SW=$("$MOECACHE" sweep "traces=[$LAW,$INT]" "$O" | id)
    DE=$("$MOECACHE" decide "decide.sweep=$SW" "decide.analysis=$AN" decide.workloads.required=null "$O" | id)
    # fidelity_qwen reshapes the traces on the machine (the reshaped imports are too large to carry)
    cp $T/esft_law_routing.npz $T/esft_intent_routing.npz .vendor/traces/
    echo "LAW=$LAW INT=$INT AN=$AN SW=$SW DE=$DE" | tee .device-data/ids.txt ;;
  pipeline) pipeline ;;
  wait)
    limit=${2:-570}; t0=$SECONDS
    while [ ! -e "$RES/DONE" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 5; done
    cat "$RES/progress.txt"
    current=$(ls -t "$RES"/*.log 2>/dev/null | grep -v queue.log | head -1)
    [ -n "$current" ] && { echo "== tail of $current"; tail -15 "$current"; }
    df -h /tmp | tail -1; grep MemAvailable /proc/meminfo
    if [ -n "${OUT:-}" ]; then
      tar -C "$RES" -czf "$OUT/res.tgz" --exclude='*.parquet.part' . && ls -la "$OUT/res.tgz"
    fi ;;
  *) echo "usage: h200_queue.sh devprep | start | wait SECONDS" >&2; exit 2 ;;
esac
