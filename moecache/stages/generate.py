"""`moecache generate`: continue one prompt with the offloaded model and show what the cache did.

The generated text streams to stdout as it is decoded; the cache statistics (`model.moecache.stats()`)
and the generation speed go to stderr. `runtime.enabled=false` runs the unmodified model (every expert
on the compute device) on the same prompt, for comparison. `runtime.loop` picks the decode loop: `fast`
(moecache's own greedy loop, moecache/runtime/decode_loop.py: StaticCache, CUDA graphs between the expert
path's host points; `runtime.compile=true` runs its step through torch.compile) or `transformers`
(`model.generate`, which also samples). No artifact is written.

The model is streamed from its checkpoint (moecache/models/streaming.py): every tensor read once, the
routed experts straight into the pinned host store, the rest straight onto `device`, after checking that
the store fits host memory and the slots (`capacity`, or `auto`) fit the device beside the rest of the
model and `runtime.headroom`. stderr then reports the load (time, GB/s of each phase), the time to the
first token, and prefill and decode tokens/s separately (llama-bench's pp and tg).
"""

from __future__ import annotations

import os
import sys
import time

from omegaconf import DictConfig

from moecache.errors import MoecacheError
from moecache.stages.base import prepare, store_for, torch_device

STAGE = "generate"
LOOPS = ("fast", "transformers")


def _check_cost_profile(c: dict) -> None:
    """runtime.cost_profile is needed by what reads one (`offloading.cost_readers`: on_miss=split, a policy
    that weighs costs) and read by nothing else (a profile nothing reads is refused: it would change
    nothing)."""
    from moecache.offloading import cost_readers
    from moecache.sim.policy_spec import PolicySpec

    runtime = c["runtime"]
    if runtime["decision"] is not None:
        spec = PolicySpec.selected_in(runtime["decision"])
    else:
        policy = c.get("policy") or {"name": "lfu"}
        spec = PolicySpec.of(policy["name"], policy.get("params") or {})
    readers = cost_readers(runtime["on_miss"], spec, on_miss_key="runtime.on_miss")
    if runtime["cost_profile"] is None and readers:
        raise MoecacheError(
            f"{' and '.join(readers)} weighs measured costs: give runtime.cost_profile (a moecache"
            " calibrate artifact id or cost_profile.json of this machine)"
        )
    if runtime["cost_profile"] is not None and not readers:
        raise MoecacheError(
            f"runtime.cost_profile={runtime['cost_profile']} is read only with runtime.on_miss=split or a"
            f" policy that weighs costs (impact), not on_miss={runtime['on_miss']} with {spec.name}"
        )


def _check(c: dict, device: str) -> None:
    """What the value checks cannot see alone: required keys and keys that must agree."""
    if c["prompt"] is None:
        raise MoecacheError('prompt is required: pass prompt="..." (the text to continue)')
    if c["generation"]["max_new_tokens"] is None:
        raise MoecacheError("generation.max_new_tokens is required here: e.g. generation.max_new_tokens=64")
    runtime = c["runtime"]
    loop = runtime.get("loop", "fast")
    if loop not in LOOPS:
        raise MoecacheError(f"runtime.loop={loop!r}: expected one of {', '.join(LOOPS)}")
    if loop == "fast" and c["generation"]["do_sample"]:
        raise MoecacheError(
            "runtime.loop=fast decodes greedily: set generation.do_sample=false, or runtime.loop=transformers"
        )
    if runtime.get("compile") and loop != "fast":
        raise MoecacheError("runtime.compile=true compiles the fast loop's step: it needs runtime.loop=fast")
    share = runtime["decode_stream_share"]
    if share and loop != "fast":
        raise MoecacheError(
            f"runtime.decode_stream_share={share} streams the fast loop's decode misses: it needs runtime.loop=fast"
        )
    if share and not runtime["enabled"]:
        raise MoecacheError(
            f"runtime.decode_stream_share={share} streams an offloaded model's misses: the unmodified model "
            "(runtime.enabled=false) has none"
        )
    if share:
        from moecache.runtime.decode_stream import check_share

        check_share(share, runtime["on_miss"])  # the on_miss it needs, before the model loads
    if not runtime["enabled"]:
        for key in ("init", "save_state"):
            if runtime[key] is not None:
                raise MoecacheError(
                    f"runtime.{key}={runtime[key]} is the cache's state: the unmodified model "
                    "(runtime.enabled=false) has no cache"
                )
        return
    if runtime["init"] is not None:
        from pathlib import Path

        from moecache.runtime.manager_state import is_state_file, read_state

        init = Path(runtime["init"])
        if not init.exists():
            raise MoecacheError(f"runtime.init={init}: no such file or folder (a saved state or a trace)")
        if is_state_file(init):  # the file, and that it is this policy's, checked before the model loads
            saved = read_state(init)["policy"]
            if runtime["decision"] is None:
                from moecache.sim.policy import make_policy

                policy = c.get("policy") or {"name": "lfu"}
                label = make_policy(policy["name"], **(policy.get("params") or {})).label()
                if saved != label:
                    raise MoecacheError(
                        f"runtime.init={init}: a state of policy {saved}; this run's policy is {label}"
                    )
    if c["capacity"] is None:
        raise MoecacheError(
            "capacity is required: a slot count, a percentage ('25%') or a memory budget ('12GiB') "
            "(runtime.enabled=false runs the unmodified model)"
        )
    if runtime["decision"] is not None and c.get("policy"):
        raise MoecacheError("runtime.decision and policy=... both name a policy: give one of them")
    if runtime["decision"] is not None:
        from moecache.sim.policy import make_policy
        from moecache.sim.policy_spec import PolicySpec

        spec = PolicySpec.selected_in(runtime["decision"])
        if make_policy(spec.name, **spec.params).offline:
            raise MoecacheError(
                f"runtime.decision={runtime['decision']}: selects {spec.label()}, an offline policy (it reads "
                "the whole future trace) that exists only in the simulator; the runtime takes an online one"
            )
    if c.get("policy"):
        from moecache.sim.policy import make_policy
        from moecache.stages.simulate import check_policy

        check_policy(c["policy"])
        if make_policy(c["policy"]["name"], **(c["policy"].get("params") or {})).offline:
            raise MoecacheError(
                f"policy={c['policy']['name']} is offline (it reads the whole future trace) and exists only "
                "in the simulator; the runtime takes an online policy (e.g. lfu, lru, static_cold)"
            )
    _check_cost_profile(c)
    want = runtime["device"]
    on_cuda = device.startswith("cuda")
    if (want == "cuda" and not on_cuda) or (want == "standin" and on_cuda):
        raise MoecacheError(
            f"runtime.device={want} but the model computes on device={device}: the slot pool lives where "
            "the model computes (runtime.device=auto picks it)"
        )


def _encode(tokenizer, prompt: str, device: str):
    import torch

    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise MoecacheError(f"prompt={prompt!r} encodes to no tokens")
    return torch.tensor([ids], device=device)


def _streamer(tokenizer, out):
    from transformers import TextStreamer

    class _Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            print(text, end="\n" if stream_end else "", file=out, flush=True)

    return _Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def _generate_fast(model, tokenizer, input_ids, gen: dict, out, compile: bool = False):
    """Greedy, through moecache's fast decode loop (its step through torch.compile with `compile`), the
    text streamed to `out`; returns the loop's DecodeResult (its prefill and decode times)."""
    from moecache.generation import fast_generate

    eos = None if gen["ignore_eos"] else model.generation_config.eos_token_id
    return fast_generate(
        model, input_ids, int(gen["max_new_tokens"]), streamer=_streamer(tokenizer, out), eos_token_id=eos,
        compile=compile,
    )  # fmt: skip


def _generate(model, tokenizer, input_ids, gen: dict, seed: int, out) -> int:
    """transformers' loop as the `generation` group says, the text streamed to `out`; returns the number of
    new tokens."""
    import torch

    from moecache.generation import transformers_generate

    if gen["do_sample"]:
        torch.manual_seed(seed)
    output = transformers_generate(
        model, input_ids, int(gen["max_new_tokens"]), gen=gen, streamer=_streamer(tokenizer, out),
        pad_token_id=model.generation_config.pad_token_id,
    )  # fmt: skip
    return int(output.shape[1] - input_ids.shape[1])


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), else None."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


def peak_rss_gib() -> float | None:
    """The process's peak resident memory (VmHWM) in GiB, else None."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def speed_lines(result, prompt_tokens: int, first_token_s: float) -> list[str]:
    """The fast loop's speeds as llama-bench reports them: prefill (pp) and decode (tg) separately."""
    lines = [
        f"time to first token: {first_token_s:.3f} s after the process started (the load included)",
        f"prefill: {prompt_tokens} tokens in {result.prefill_s:.3f} s "
        f"({prompt_tokens / max(result.prefill_s, 1e-9):.2f} tokens/s, the first token included)",
    ]
    if result.timed_steps:
        lines.append(
            f"decode: {result.timed_steps} tokens in {result.decode_s:.3f} s "
            f"({result.timed_steps / max(result.decode_s, 1e-9):.2f} tokens/s; {result.warmup_s:.3f} s of "
            "warm-up and graph capture before them)"
        )
    return lines


def _print_stats(stats: dict | None, tokens: int, seconds: float, err) -> None:
    print(
        f"generated {tokens} tokens in {seconds:.3f} s ({tokens / max(seconds, 1e-9):.2f} tokens/s end to end)",
        file=err,
    )
    if stats is None:
        print("runtime: disabled (the unmodified model)", file=err)
        return
    for key, value in stats.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key}: {shown}", file=err)


def run(cfg: DictConfig, out=None, err=None) -> dict | None:
    """Generate (module docstring); returns the cache statistics (None with runtime.enabled=false)."""
    from moecache.models import load_model
    from moecache.models.loading import OffloadRequest
    from moecache.models.memory_fit import headroom_bytes

    age = process_age_s()
    command_start = time.perf_counter() - (age or 0.0)
    out, err = out or sys.stdout, err or sys.stderr
    c = prepare(cfg, STAGE)
    device = torch_device(cfg)
    _check(c, device)
    runtime = c["runtime"]
    enabled = runtime["enabled"]
    profile = None
    if enabled and runtime["cost_profile"] is not None:
        from moecache.sim.inputs import load_profile

        profile = load_profile(store_for(cfg), runtime["cost_profile"], key="runtime.cost_profile")[1]
    request = None
    if enabled:
        pin = "auto" if device.startswith("cuda") else "off"
        request = OffloadRequest(c["capacity"], headroom_bytes(runtime["headroom"]), pin)
    loaded = load_model(cfg.model, cfg.output_root, device, offload=request)
    print(loaded.times.line(), file=err)
    model = loaded.model
    if enabled:
        from moecache.offloading import offload_model

        print(f"memory: {loaded.fit.describe()}", file=err)
        policy = c.get("policy") or {}
        model = offload_model(
            model, capacity=loaded.fit.slots, policy=policy.get("name"), params=policy.get("params"),
            decision=runtime["decision"], device=device, store=loaded.store, on_miss=runtime["on_miss"],
            cost_profile=profile, init=runtime["init"], stream_min_tokens=runtime["stream_min_tokens"],
            stream_chunk=runtime["stream_chunk"], decode_stream_share=runtime["decode_stream_share"],
        )  # fmt: skip
        if model.moecache.router_topk is not None:
            print(model.moecache.router_topk.describe(), file=err)
        if runtime["init"] is not None:
            print(f"cache: started from {runtime['init']}", file=err)
    input_ids = _encode(loaded.tokenizer, c["prompt"], device)
    start = time.perf_counter()
    if runtime.get("loop", "fast") == "fast":
        result = _generate_fast(
            model, loaded.tokenizer, input_ids, c["generation"], out, bool(runtime.get("compile"))
        )
        tokens = result.new_tokens
        first_token_s = start + result.prefill_s - command_start
        speeds = speed_lines(result, int(input_ids.shape[1]), first_token_s)
    else:
        tokens = _generate(model, loaded.tokenizer, input_ids, c["generation"], int(c["seed"]), out)
        speeds = []
    seconds = time.perf_counter() - start
    stats = model.moecache.stats() if enabled else None
    if enabled and runtime["save_state"] is not None:
        print(f"cache state: saved to {model.moecache.save_state(runtime['save_state'])}", file=err)
    for line in speeds:
        print(line, file=err)
    _print_stats(stats, tokens, seconds, err)
    peak = peak_rss_gib()
    if peak is not None:
        print(f"peak host RSS: {peak:.2f} GiB", file=err)
    return stats
