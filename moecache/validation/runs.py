"""One measured run of `moecache validate`: a model (offloaded with one strategy at one capacity, or the
unmodified model) greedily continuing a workload's requests, with its routing trace logged.

Execution is plain transformers: `model.generate` (greedy, no EOS stop), one request after the other,
batch size one. The time of every generated token is taken in a logits processor, after a device
synchronize on CUDA, i.e. when the token's logits exist: the first one gives the time to first token
(prefill and the first sample), the later ones the inter-token latencies. A run is built from a fresh
copy of the unmodified CPU model (`moecache.offload` drops its dense experts into the host store; only
the rest goes to the device), so no run inherits another's cache.

Per run: TTFT (mean over requests), inter-token latency p50/p90/p99 over every decode interval, decode
tokens/s (decode intervals / their time), prefill tokens/s (prompt tokens / time to first token),
time per token (generate wall time / routed tokens: prompt + generated - 1 per request, the simulator's
unit), peak host RSS and CUDA memory during the run's generation, the cache counters since the model was
offloaded (a static policy's initial residents are loaded before), and the agreement with the unmodified
model's tokens and logits (agreement.py).

Legend: N generated positions, V vocabulary, G global expert keys.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import LogitsProcessorList

from moecache.errors import MoecacheError
from moecache.token_clock import TokenStamps
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.logger import LoggerConfig, RoutingLogger
from moecache.trace.schema import TraceMeta
from moecache.validation.agreement import Agreement
from moecache.validation.baselines import Strategy, install_hindsight
from moecache.validation.memory import PeakMemory
from moecache.validation.recording import CacheRecorder

EXECUTION = "transformers generate (eager)"
LOGGER = LoggerConfig(formats=("parquet",), on_overflow="block")
QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]


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
    """Greedy tokens and raw logits [N, V] (host float32) per request id."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RunOutcome:
    row: dict
    latencies: list[dict]
    outputs: Outputs


def _percentile(values: list[float], q: int) -> float | None:
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else None


def _build(plain_cpu_model, spec: RunSpec, device: str, hindsight_G: np.ndarray | None):
    """A fresh copy of the model: unmodified on `device`, or offloaded with the spec's strategy."""
    from moecache.offloading import offload_model

    model = copy.deepcopy(plain_cpu_model)
    if spec.strategy is None:
        return model.to(device)
    s = spec.strategy
    model = offload_model(
        model, capacity=spec.slots, policy=s.policy.name, params=s.policy.params, device=device
    )
    manager = model.moecache.manager
    manager.on_miss = s.on_miss
    if s.hindsight:
        if hindsight_G is None:
            raise MoecacheError(f"validate {spec.label}: no hindsight placement for this workload")
        install_hindsight(manager, hindsight_G)
    return model


def _free(model) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(
    plain_cpu_model,
    spec: RunSpec,
    requests: Iterable[Request],
    *,
    device: str,
    max_new_tokens: int,
    pad_id: int,
    trace_dir: Path,
    meta: TraceMeta,
    run_id: str,
    reference: Outputs | None,
    hindsight_G: np.ndarray | None = None,
    outputs: Outputs | None = None,
) -> RunOutcome:
    """Run `requests` on the spec's model (module docstring); its trace goes to trace_dir/trace.parquet.
    `requests` may be a stream that reads `outputs` (filled request by request; a new one by default)."""
    model = _build(plain_cpu_model, spec, device, hindsight_G)
    offloaded = spec.strategy is not None
    manager = model.moecache.manager if offloaded else None
    before = dataclasses.replace(manager.stats) if offloaded else None
    logger = RoutingLogger(trace_dir, meta, run_id, LOGGER)
    if offloaded:
        recorder = CacheRecorder(model, logger)
    else:
        from moecache.models.adapter import adapter_for

        recorder = RoutingRecorder(model, adapter_for(model), logger)
    cuda = device.startswith("cuda")
    memory = PeakMemory(device)
    outputs = Outputs() if outputs is None else outputs
    latencies: list[dict] = []
    n_requests = 0
    ttft_s, decode_s, itl_ms, wall_s = [], 0.0, [], 0.0
    prompt_tokens = generated = 0
    memory.start()
    try:
        with recorder:
            for req in requests:
                if offloaded:
                    model.moecache.begin_request()
                recorder.start_request(req.request_id)
                stamp = TokenStamps(cuda)
                input_ids = torch.tensor([list(req.prompt_ids)], device=device)
                start = time.perf_counter()
                with torch.inference_mode():
                    out = model.generate(
                        input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                        max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                        top_k=None, eos_token_id=None, pad_token_id=pad_id, output_logits=True,
                        return_dict_in_generate=True, logits_processor=LogitsProcessorList([stamp]),
                    )  # fmt: skip
                wall_s += time.perf_counter() - start
                tokens = out.sequences[0, input_ids.shape[1] :].tolist()
                outputs.tokens[req.request_id] = tokens
                outputs.logits[req.request_id] = torch.cat(out.logits).to("cpu", torch.float32)
                times = stamp.times
                if len(times) != len(tokens):
                    raise MoecacheError(f"validate: {len(times)} token times for {len(tokens)} tokens")
                ttft_s.append(times[0] - start)
                gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
                itl_ms += gaps
                decode_s += times[-1] - times[0]
                n_requests += 1
                prompt_tokens += len(req.prompt_ids)
                generated += len(tokens)
                for i, ms in enumerate([ttft_s[-1] * 1e3, *gaps]):
                    latencies.append({"request_id": req.request_id, "token_index": i, "latency_ms": ms})
        rss, cuda_peak = memory.stop()
    finally:
        log_stats = logger.close()
    L = meta.num_layers
    if not n_requests:
        raise MoecacheError(f"validate {spec.workload}: the workload gave no request")
    routed = prompt_tokens + generated - n_requests
    if log_stats.rows_written != routed * L:
        raise MoecacheError(
            f"validate {spec.label}: logged {log_stats.rows_written} rows, expected {routed * L}"
        )
    row = {
        "workload": spec.workload,
        "strategy": spec.label,
        "policy": spec.strategy.policy.label() if offloaded else None,
        "on_miss": spec.strategy.on_miss if offloaded else None,
        "capacity": spec.capacity,
        "slots": spec.slots,
        "capacity_fraction": (spec.slots / (L * meta.num_experts) if spec.slots is not None else None),
        "requests": n_requests,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "ttft_ms": float(np.mean(ttft_s)) * 1e3,
        **{f"itl_p{q}_ms": _percentile(itl_ms, q) for q in QUANTILES},
        "decode_tokens_per_s": (generated - n_requests) / decode_s if decode_s > 0 else None,
        "prefill_tokens_per_s": prompt_tokens / sum(ttft_s),
        "time_per_token_ms": wall_s * 1e3 / routed,
        "peak_cpu_rss_bytes": rss,
        "peak_cuda_bytes": cuda_peak,
        **_cache_counts(model, before),
        **_agreement(reference, outputs),
    }
    _free(model)
    for item in latencies:
        item.update(workload=spec.workload, strategy=spec.label, capacity=spec.capacity, slots=spec.slots)
    return RunOutcome(row, latencies, outputs)


CACHE_KEYS = (
    "hit_rate", "accesses", "hits", "misses", "copies", "copy_bytes", "late_copies", "waited_copies",
    "cpu_fallbacks", "gpu_entries",
)  # fmt: skip


def _cache_counts(model, before) -> dict:
    """The cache counters of the run (None for the unmodified model)."""
    if before is None:
        return dict.fromkeys(CACHE_KEYS)
    now = model.moecache.manager.stats
    d = {f.name: getattr(now, f.name) - getattr(before, f.name) for f in dataclasses.fields(now)}
    accesses = d["hits"] + d["misses"]
    runtime = model.moecache.runtime.stats
    return {
        "hit_rate": d["hits"] / accesses if accesses else None,
        "accesses": accesses,
        "hits": d["hits"],
        "misses": d["misses"],
        "copies": d["copies"],
        "copy_bytes": d["copies"] * model.moecache.manager.store.expert_bytes,
        "late_copies": d["late_copies"],
        "waited_copies": d["waited_copies"],
        "cpu_fallbacks": runtime.cpu_entries,
        "gpu_entries": runtime.gpu_entries,
    }


def _agreement(reference: Outputs | None, outputs: Outputs) -> dict:
    """Token match rate and max logit error against the reference (None for the reference itself)."""
    if reference is None:
        return {"token_match_rate": None, "max_logit_error": None}
    agree = Agreement()
    for rid, tokens in outputs.tokens.items():
        agree.add(reference.tokens[rid], reference.logits[rid], tokens, outputs.logits[rid])
    return {"token_match_rate": agree.match_rate, "max_logit_error": agree.max_logit_error}
