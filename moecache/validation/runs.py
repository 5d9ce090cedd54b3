"""One measured run of `moecache validate`: a model (offloaded, its session configured with one strategy at
one capacity, or the unmodified model) greedily continuing a workload's requests, with its routing trace
logged.

The model is the caller's, as it is: nothing is copied (a 35B model cannot be); moecache/validation/
pipeline.py configures it between runs (`model.moecache.reconfigure`). Each request goes through the
run's loop (moecache/validation/generation.py: transformers' generate or the fast decode loop), batch
size one, greedy, no EOS stop. The first token's stamp gives the time to first token (prefill and the
first sample), the later ones the inter-token latencies (the fast loop's warm-up gaps flagged apart).

Per run: TTFT (mean over requests), inter-token latency p50/p90/p99 over every decode gap but the
warm-up ones, decode tokens/s (those gaps / their time), prefill tokens/s (prompt tokens / time to first
token), time per token ((time to first token + those gaps) / (prompt tokens + those gaps): generate's
time over the routed tokens, the simulator's unit), peak host RSS and CUDA memory during the run, the
cache counters of the run's session. Output agreement is measured apart, teacher-forced
(agreement_runs.py).

The trace: recorded by hooks (the router's for the unmodified model, the experts module's with the
cache fields for an offloaded one; moecache/validation/recording.py) with the transformers loop; with
the fast loop (trace-forced only) written from the forcing trace's rows, checked against every manager
visit, the visits' cache fields in the rows they visited (moecache/validation/forcing.py).

Legend: G global expert keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moecache.errors import MoecacheError
from moecache.runtime.layer_counters import HOST_RATES, LayerCounters
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.logger import LoggerConfig, RoutingLogger
from moecache.trace.schema import TraceMeta
from moecache.validation.baselines import Strategy
from moecache.validation.memory import PeakMemory
from moecache.validation.recording import CacheRecorder

LOGGER = LoggerConfig(formats=("parquet",), on_overflow="block")
QUANTILES = (50, 90, 99)
RECORDED, FORCING = "recorded", "forcing trace"  # where a run's trace comes from


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int | None = None  # None: the run's default (validate.max_new_tokens)


@dataclass(frozen=True)
class RunSpec:
    workload: str
    strategy: Strategy | None  # None: the unmodified model (the reference)
    capacity: str | None  # as written (validate.capacities, or "all" / "0" for the fixed baselines)
    slots: int | None

    @property
    def label(self) -> str:
        return "unmodified" if self.strategy is None else self.strategy.name


@dataclass
class Outputs:
    """Greedy tokens per request id (a later turn of a conversation is built from them)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class RunOutcome:
    row: dict
    latencies: list[dict]
    outputs: Outputs


def _percentile(values: list[float], q: int) -> float | None:
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else None


def _recorder(model, logger: RoutingLogger, offloaded: bool):
    if offloaded:
        return CacheRecorder(model, logger)
    from moecache.models.adapter import adapter_for

    return RoutingRecorder(model, adapter_for(model), logger)


def cache_length(requests: Iterable[Request], max_new_tokens: int) -> int:
    """The fast loop's decoder length for `requests`: the longest prompt and its tokens."""
    return max(len(r.prompt_ids) + int(r.max_new_tokens or max_new_tokens) for r in requests)


def measure(
    model,
    spec: RunSpec,
    requests: Iterable[Request],
    *,
    loop: str,
    device: str,
    max_new_tokens: int,
    pad_id: int,
    trace_dir: Path,
    meta: TraceMeta,
    run_id: str,
    outputs: Outputs | None = None,
    forced=None,
    cache_len: int | None = None,
) -> RunOutcome:
    """Run `requests` on `model` as it is (module docstring); its trace goes to trace_dir/trace.parquet.
    `requests` may be a stream that reads `outputs` (filled request by request; a new one by default).
    `forced`: the stage's ForcedWorkload (moecache/validation/forcing.py) or None. `max_new_tokens`: for
    a request without its own. `cache_len`: the fast loop's decoder length, at least the longest request's
    prompt and tokens (None: that); a warm-up passes its timed runs' length, so their first step meets no
    new shape."""
    import contextlib

    from moecache.validation.generation import make_loop

    session = getattr(model, "moecache", None)
    offloaded = session is not None
    if offloaded != (spec.strategy is not None):
        raise MoecacheError(f"validate {spec.label}: the model is {'' if offloaded else 'not '}offloaded")
    if loop == "fast" and forced is None:
        raise MoecacheError("validate.loop=fast: needs validate.forced_trace (module docstring of runs.py)")
    before = dataclasses.replace(session.manager.stats) if offloaded else None
    logger = RoutingLogger(trace_dir, meta, run_id, LOGGER)
    hooks = loop != "fast"  # the fast loop's traces are the forcing trace's rows (module docstring)
    longest = 2
    if not hooks:  # the fast loop's decoder is sized for the run's longest request
        requests = list(requests)
        longest = max(cache_len or 0, cache_length(requests, max_new_tokens))
    runner = make_loop(
        loop, model, device=device, pad_id=pad_id, max_cache_len=longest,
        forced=forced.forced if forced is not None else None,
    )  # fmt: skip
    memory = PeakMemory(device)
    outputs = Outputs() if outputs is None else outputs
    latencies: list[dict] = []
    done: list[Request] = []
    ttft_s, gaps_s, loops = [], [], set()
    warm_gaps_s: list[float] = []  # the decoder's warm-up gaps (eager steps, the capture), in order
    host: LayerCounters | None = None  # the fast loop's host points, summed over the requests
    prompt_tokens = generated = 0
    recorder = check = None
    stack = contextlib.ExitStack()
    memory.start()
    try:
        with stack:
            if hooks:
                recorder = stack.enter_context(_recorder(model, logger, offloaded))
            if forced is not None and (hooks or not offloaded):  # the fast loop forces offloaded itself
                forced.forced.attach(model)
                stack.callback(forced.forced.detach)
            if forced is not None and not hooks and offloaded:
                from moecache.validation.forcing import VisitCheck

                check = stack.enter_context(VisitCheck(session.manager, forced.forced))
            for req in requests:
                if offloaded:
                    model.moecache.begin_request()
                if forced is not None:
                    forced.forced.start_request(req.request_id)
                if check is not None:
                    check.start_request(req.request_id)
                if recorder is not None:
                    recorder.start_request(req.request_id)
                gen = runner.generate(req.prompt_ids, int(req.max_new_tokens or max_new_tokens))
                outputs.tokens[req.request_id] = gen.tokens
                loops.add(gen.loop)
                ttft_s.append(gen.ttft_s)
                warm = gen.warmup_gaps
                gaps_s += gen.gaps_s[warm:]
                warm_gaps_s += gen.gaps_s[:warm]
                if gen.host is not None:
                    host = gen.host if host is None else host + gen.host
                done.append(req)
                prompt_tokens += len(req.prompt_ids)
                generated += len(gen.tokens)
                for i, s in enumerate([gen.ttft_s, *gen.gaps_s]):
                    latencies.append({
                        "request_id": req.request_id, "token_index": i, "latency_ms": s * 1e3,
                        "warmup": 1 <= i <= warm,
                    })  # fmt: skip
        rss, cuda_peak = memory.stop()
        if not hooks:
            from moecache.validation.forcing import write_forced_trace

            write_forced_trace(forced, done, logger, check.visits if check is not None else None)
    finally:
        log_stats = logger.close()
        runner.close()
    return _outcome(spec, meta, done, log_stats, ttft_s, gaps_s, warm_gaps_s, prompt_tokens, generated, rss,
                    cuda_peak, session, before, outputs, latencies, loops, hooks, check, host)  # fmt: skip


HOST_KEYS = tuple(f"decode_{key}" for key in HOST_RATES)


def _host_points(host: LayerCounters | None) -> dict:
    """The fast loop's host points over the timed decode steps (None elsewhere, or without calls): the
    manager's microseconds per visit, the CPU path's per call (a visit with misses: gather, run, result
    to the device) and its (token, k) entries per call, to hold against the cost profile's rows; the
    host's wait for a layer's routing to be read back, per visit (the GPU's segment time it exposes)."""
    if host is None:
        return dict.fromkeys(HOST_KEYS)
    return {f"decode_{key}": value for key, value in host.rates().items()}


def _outcome(spec, meta, done, log_stats, ttft_s, gaps_s, warm_gaps_s, prompt_tokens, generated, rss, cuda_peak,
             session, before, outputs, latencies, loops, hooks, check, host) -> RunOutcome:  # fmt: skip
    L = meta.num_layers
    n_requests = len(done)
    if not n_requests:
        raise MoecacheError(f"validate {spec.workload}: the workload gave no request")
    routed = prompt_tokens + generated - n_requests
    if log_stats.rows_written != routed * L:
        raise MoecacheError(
            f"validate {spec.label}: logged {log_stats.rows_written} rows, expected {routed * L}"
        )
    offloaded = session is not None
    decode_s = sum(gaps_s)
    row = {
        "workload": spec.workload,
        "strategy": spec.label,
        "policy": spec.strategy.policy.label() if offloaded else None,
        "on_miss": spec.strategy.on_miss if offloaded else None,
        "capacity": spec.capacity,
        "slots": spec.slots,
        "capacity_fraction": (spec.slots / (L * meta.num_experts) if spec.slots is not None else None),
        "loop": ",".join(sorted(loops)),
        "requests": n_requests,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "warmup_gaps": len(warm_gaps_s),
        "warmup_gaps_ms": [g * 1e3 for g in warm_gaps_s],
        "ttft_ms": float(np.mean(ttft_s)) * 1e3,
        **{f"itl_p{q}_ms": _percentile([g * 1e3 for g in gaps_s], q) for q in QUANTILES},
        "decode_tokens_per_s": len(gaps_s) / decode_s if decode_s > 0 else None,
        "prefill_tokens_per_s": prompt_tokens / sum(ttft_s),
        "time_per_token_ms": (sum(ttft_s) + decode_s) * 1e3 / (prompt_tokens + len(gaps_s)),
        **_host_points(host),
        "peak_cpu_rss_bytes": rss,
        "peak_cuda_bytes": cuda_peak,
        **_cache_counts(session, before),
        "trace_source": RECORDED if hooks else FORCING,
        "forced_rows_checked": check.rows_checked if check is not None else None,
    }
    for item in latencies:
        item.update(workload=spec.workload, strategy=spec.label, capacity=spec.capacity, slots=spec.slots)
    return RunOutcome(row, latencies, outputs)


CACHE_KEYS = (
    "hit_rate", "accesses", "hits", "misses", "copies", "copy_bytes", "late_copies", "waited_copies",
    "cpu_fallbacks", "gpu_entries",
)  # fmt: skip


def _cache_counts(session, before) -> dict:
    """The cache counters of the run's session (None for the unmodified model)."""
    if before is None:
        return dict.fromkeys(CACHE_KEYS)
    now = session.manager.stats
    d = {f.name: getattr(now, f.name) - getattr(before, f.name) for f in dataclasses.fields(now)}
    accesses = d["hits"] + d["misses"]
    runtime = session.runtime.counters
    return {
        "hit_rate": d["hits"] / accesses if accesses else None,
        "accesses": accesses,
        "hits": d["hits"],
        "misses": d["misses"],
        "copies": d["copies"],
        "copy_bytes": d["copies"] * session.manager.store.expert_bytes,
        "late_copies": d["late_copies"],
        "waited_copies": d["waited_copies"],
        "cpu_fallbacks": runtime.cpu_entries,
        "gpu_entries": runtime.gpu_entries,
    }
