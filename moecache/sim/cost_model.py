"""The costs the timed replay needs, as plain numbers and arrays (numba indexes them directly).

    cost = CostModel.for_trace(CostProfile.load(path), trace)          # trace: a TraceArrays
    cost = CostModel.from_profile(profile, expert_bytes, max_tokens, non_expert_us_per_layer=250.0)
    slower_pcie = cost.replace(bandwidth_scale=0.5)                     # sensitivity sweep

Where the numbers come from (a `CostProfile` written by `moecache calibrate`):

- copy: one pinned host-to-device copy of an expert costs `copy_latency_us + expert_bytes /
  bandwidth_bytes_per_us`, the profile's latency/bandwidth fit of its pinned copies;
- expert compute: `cpu_us_M[M]` / `gpu_us_M[M]` are the profile's medians for one expert call of M
  tokens (`CostProfile.cpu_expert_us` / `cuda_expert_us`), tabulated for M = 0..max_tokens (M = 0
  costs 0). The CPU timings were measured with `cpu_threads` threads: the model assumes the CPU runs
  its misses one call after another, each call using all of them. A profile without GPU timings
  gives GPU expert time 0 (a warning and a note say so);
- `expert_bytes` is the TRACE's (its model decides the size; the profile only gives time per byte).
  When it differs from the profile's expert, the copy is costed by the fit at the trace's bytes and
  the expert compute times are multiplied by trace bytes / profile bytes. That is an approximation:
  it treats an expert call as memory-bound (time proportional to the weights read), which is what
  small-M calls are; at large M (compute-bound) the true ratio is the ratio of FLOPs, which for a
  SwiGLU expert is the same ratio of parameters, so the approximation holds there too unless the
  two shapes differ in efficiency (very different H/I). It also assumes the trace's bytes are in the
  profile's dtype;
- non-expert time (attention, norms, router, shared experts, dense layers) is NOT measured by any
  profile yet. `non_expert_us_per_layer` (decode: per MoE layer step) and
  `non_expert_us_per_prefill_token` (prefill: per token per MoE layer; None: the decode value) are
  configuration values whose default 0.0 means "not modelled": estimated times then count expert
  work only, and `notes` says so. No number is invented here.

Sensitivity scales multiply the measured values: `bandwidth_scale` the copy bandwidth (the latency
stays), `cpu_scale` the CPU expert times, `gpu_scale` the GPU expert times (not the non-expert time).
The replay uses the scaled values: `cpu_table()`, `gpu_table()`, `copy_us()`.

**The runtime's step** (a schema-2 profile with a `runtime` section, `CostProfile.runtime_costs()`;
`runtime` below, None for schema 1, whose results are unchanged). The runtime's experts module
(moecache/runtime/experts_module.py) runs one layer step as: the routing read back to the host (it
waits for the router), the manager's visit, x and the router weights read to the host when there are
misses, the resident entries' slot-pool operator enqueued, then the misses' CPU path while the device
computes, then the sum. On CUDA the two halves overlap (`overlap` "parallel", what calibrate records
there, for both decode loops); on the CPU stand-in, where the operator is host work too, they run one
after the other ("serial"):

    step = non-expert(T) + visit(T) + kernel(T, N)
           + [misses] (cpu_call + excess(phase) + sum over missed experts cpu(M))

with T the step's tokens, N the resident (token, k) entries (the sum of the hits' uses), kernel the
operator's measured time for one call (`kernel_tables`: one row per distinct T of the trace),
cpu_call the CPU path's fixed cost per call, excess what else a step with CPU work costs the fast loop
(`cpu_excess_V`, calibrate's all-CPU run; 0 without it; the split rule weighs cpu_call alone, in the
replay and the runtime alike) and cpu(M) its cost per missed expert of M tokens;
"parallel" takes max(kernel, cpu part) instead of their sum. The non-expert time is measured per MoE
layer (decode) and per token per MoE layer (prefill) on the model with its routed experts replaced by
zeros; a positive `non_expert_us_per_layer` / `non_expert_us_per_prefill_token` override replaces it
(0.0, the sim default, means "not set" here). Copies cost the copy engine's measured time per expert
(back to back: one copy's share), latency 0; a profile measured without CUDA has no copy engine (the
CPU stand-in runs each copy before the next visit) and its copies are free (a note says so).
`cpu_us_M` is the runtime CPU path per expert (with the call cost, one expert alone) and `gpu_us_M[M]`
the operator for one expert of M tokens: what the per-expert consumers (the impact policy) read.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

import numba as nb
import numpy as np

from moecache.cost_profile import RuntimeCosts
from moecache.errors import MoecacheError
from moecache.sim.trace_arrays import DECODE

NOT_MODELLED_NON_EXPERT = (
    "non-expert time not modelled (non_expert_us_per_layer=0): no cost profile measures attention,"
    " router, shared experts or dense layers yet; estimated times count expert work only"
)


SCALES = ("bandwidth_scale", "cpu_scale", "gpu_scale")  # the sensitivity scales (module docstring)


@dataclass(frozen=True, kw_only=True, eq=False)
class CostModel:
    """Costs of one (trace shape, machine) pair, in microseconds and bytes."""

    copy_latency_us: float  # per copy, from the profile's fit
    bandwidth_bytes_per_us: float  # from the profile's fit (GB/s * 1e3); math.inf: copies are free
    expert_bytes: int  # bytes of one expert of the TRACE's model
    cpu_us_M: np.ndarray  # float64 [max_tokens + 1]: one expert call of M tokens on the CPU
    gpu_us_M: np.ndarray  # float64 [max_tokens + 1]: ... on the GPU (zeros when not measured)
    non_expert_us_per_layer: float = 0.0  # decode layer step; 0.0 = not modelled
    non_expert_us_per_prefill_token: float | None = None  # prefill, per token per layer; None: as decode
    bandwidth_scale: float = 1.0
    cpu_scale: float = 1.0
    gpu_scale: float = 1.0
    cpu_threads: int | None = None  # threads of the CPU expert timings
    dtype: str = ""
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)  # about the profile; see all_notes()
    # The runtime's step (module docstring); None: the per-expert formula of a schema-1 profile.
    runtime: RuntimeCosts | None = None
    compute_ratio: float = 1.0  # trace expert bytes / profile expert bytes (scales compute times)

    def __post_init__(self) -> None:
        for name in SCALES:
            value = getattr(self, name)
            if not value > 0:
                raise MoecacheError(f"cost model: {name} must be > 0, got {value}")
        if not self.bandwidth_bytes_per_us > 0:
            raise MoecacheError(
                f"cost model: bandwidth must be > 0 bytes/us, got {self.bandwidth_bytes_per_us}"
            )
        for name in ("copy_latency_us", "non_expert_us_per_layer"):
            if not getattr(self, name) >= 0:
                raise MoecacheError(f"cost model: {name} must be >= 0, got {getattr(self, name)}")
        if self.non_expert_us_per_prefill_token is not None and not self.non_expert_us_per_prefill_token >= 0:
            raise MoecacheError("cost model: non_expert_us_per_prefill_token must be >= 0 or None")
        if self.expert_bytes < 0:
            raise MoecacheError(f"cost model: expert_bytes must be >= 0, got {self.expert_bytes}")
        cpu = np.ascontiguousarray(self.cpu_us_M, np.float64)
        gpu = np.ascontiguousarray(self.gpu_us_M, np.float64)
        if cpu.ndim != 1 or cpu.shape != gpu.shape or len(cpu) < 2:
            raise MoecacheError("cost model: cpu_us_M and gpu_us_M must be 1-d of equal length >= 2")
        object.__setattr__(self, "cpu_us_M", cpu)
        object.__setattr__(self, "gpu_us_M", gpu)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_profile(
        cls, profile, expert_bytes: int, max_tokens: int, dtype: str | None = None, **overrides
    ) -> CostModel:
        """Tabulate `profile` (a CostProfile) for experts of `expert_bytes` and calls of up to
        `max_tokens` tokens; `overrides` set any other field (non-expert time, scales, ...)."""
        dtype = dtype or profile.dtype
        max_tokens = int(max_tokens)
        if max_tokens < 1:
            raise MoecacheError(f"cost model: max_tokens must be >= 1, got {max_tokens}")
        runtime = profile.runtime_costs()
        if runtime is not None:
            return cls._from_runtime(profile, runtime, int(expert_bytes), max_tokens, dtype, overrides)
        expert_bytes = int(expert_bytes)
        notes: list[str] = []
        ratio = 1.0
        if expert_bytes != profile.expert_bytes:
            ratio = expert_bytes / profile.expert_bytes
            notes.append(
                f"trace expert_bytes {expert_bytes} != profile expert_bytes {profile.expert_bytes}: copy time"
                f" from the profile's latency/bandwidth fit at {expert_bytes} bytes; expert compute times"
                f" scaled by {ratio:.4g}"
            )
        fit = profile._need_h2d()["fit"]
        tokens = range(1, max_tokens + 1)
        cpu = np.zeros(max_tokens + 1, np.float64)
        cpu[1:] = [profile.cpu_expert_us(m, dtype) for m in tokens]
        gpu = np.zeros(max_tokens + 1, np.float64)
        if profile.cuda_expert_us(1, dtype) is None:
            msg = (
                f"cost profile {profile.source} has no GPU expert timings for {dtype}:"
                " GPU expert time taken as 0"
            )
            warnings.warn(msg, stacklevel=2)
            notes.append(msg)
        else:
            gpu[1:] = [profile.cuda_expert_us(m, dtype) for m in tokens]
        threads = profile.machine.get("threads")
        cpu_rows_threads = {r.get("threads") for r in profile.cpu if r["dtype"] == dtype} - {None}
        if len(cpu_rows_threads) == 1:
            threads = cpu_rows_threads.pop()
        fields = dict(
            copy_latency_us=float(fit["latency_us"]),
            bandwidth_bytes_per_us=float(fit["gbps"]) * 1e3,
            expert_bytes=expert_bytes,
            cpu_us_M=cpu * ratio,
            gpu_us_M=gpu * ratio,
            cpu_threads=int(threads) if threads is not None else None,
            dtype=dtype,
            source=profile.source,
        )
        fields.update(overrides)
        fields["notes"] = tuple(notes) + tuple(overrides.get("notes", ()))
        return cls(**fields)

    @classmethod
    def _from_runtime(
        cls, profile, runtime: RuntimeCosts, expert_bytes: int, max_tokens: int, dtype: str, overrides: dict
    ) -> CostModel:
        """`from_profile` of a profile with a runtime section (module docstring, "The runtime's step")."""
        notes: list[str] = [
            f"runtime step ({runtime.path}, {runtime.overlap}): slot-pool operator per call, runtime CPU"
            " path, manager visit and non-expert time as calibrated"
        ]
        ratio = 1.0
        if expert_bytes != runtime.expert_bytes:
            ratio = expert_bytes / runtime.expert_bytes
            notes.append(
                f"trace expert_bytes {expert_bytes} != calibrated model's {runtime.expert_bytes}: operator and"
                f" CPU-path expert times scaled by {ratio:.4g}, copy time by the byte ratio"
            )
        m = np.arange(max_tokens + 1, dtype=np.float64)
        cpu = np.zeros(max_tokens + 1, np.float64)
        cpu[1:] = runtime.cpu_call_us + runtime.cpu_expert_us(m[1:]) * ratio
        gpu = np.zeros(max_tokens + 1, np.float64)
        gpu[1:] = [runtime.kernel_row_us(int(t))[int(t)] * ratio for t in m[1:]]
        if runtime.copy_us is None:
            latency, bandwidth = 0.0, math.inf
            notes.append(
                "no copy engine timings (calibrated without CUDA: the stand-in copies before the next"
                " visit): copies free"
            )
        else:
            latency, bandwidth = 0.0, runtime.expert_bytes / runtime.copy_us
        fields = dict(
            copy_latency_us=latency,
            bandwidth_bytes_per_us=bandwidth,
            expert_bytes=expert_bytes,
            cpu_us_M=cpu,
            gpu_us_M=gpu,
            non_expert_us_per_layer=runtime.non_expert_decode_us_per_layer or 0.0,
            non_expert_us_per_prefill_token=runtime.non_expert_prefill_us_per_token,
            cpu_threads=profile.runtime.get("cpu_threads"),
            dtype=dtype,
            source=profile.source,
            runtime=runtime,
            compute_ratio=ratio,
        )
        if runtime.non_expert_decode_us_per_layer is None:
            notes.append("the profile did not measure the non-expert time (runtime.non_expert is null)")
        for key in ("non_expert_us_per_layer", "non_expert_us_per_prefill_token"):
            if not overrides.get(key):  # 0.0 / None: the sim default, "not set": keep the measurement
                overrides.pop(key, None)
        fields.update(overrides)
        fields["notes"] = tuple(notes) + tuple(overrides.get("notes", ()))
        return cls(**fields)

    @classmethod
    def for_trace(cls, profile, trace, dtype: str | None = None, **overrides) -> CostModel:
        """`from_profile` with the trace's expert bytes and its largest step (tokens per call)."""
        max_tokens = int(trace.tokens_V.max()) if trace.num_steps else 1
        return cls.from_profile(profile, trace.expert_bytes, max(max_tokens, 1), dtype=dtype, **overrides)

    def replace(self, **changes) -> CostModel:
        return dataclasses.replace(self, **changes)

    def infinite_bandwidth(self) -> CostModel:
        """The same costs with free copies (zero latency, infinite bandwidth): instant mode's timing."""
        return self.replace(copy_latency_us=0.0, bandwidth_bytes_per_us=math.inf)

    # ---- what the replay uses (scales applied) ---------------------------------------------------

    @property
    def max_tokens(self) -> int:
        return len(self.cpu_us_M) - 1

    def cpu_table(self) -> np.ndarray:
        """CPU microseconds of one expert call, indexed by tokens per call M (scaled)."""
        return self.cpu_us_M * self.cpu_scale

    def gpu_table(self) -> np.ndarray:
        return self.gpu_us_M * self.gpu_scale

    def bandwidth(self) -> float:
        """Effective copy bandwidth in bytes per microsecond (scaled)."""
        return self.bandwidth_bytes_per_us * self.bandwidth_scale

    def copy_us(self) -> float:
        """Microseconds of one expert copy: latency + expert_bytes / bandwidth (scaled)."""
        return self.copy_latency_us + (self.expert_bytes / self.bandwidth() if self.expert_bytes else 0.0)

    @property
    def non_expert_modelled(self) -> bool:
        return self.non_expert_us_per_layer > 0 or bool(self.non_expert_us_per_prefill_token)

    def all_notes(self) -> tuple[str, ...]:
        """`notes`, plus the warning that non-expert time is not modelled when it is 0."""
        return self.notes + (() if self.non_expert_modelled else (NOT_MODELLED_NON_EXPERT,))

    @property
    def non_expert_prefill_overridden(self) -> bool:
        """A sim.non_expert_us_per_prefill_token override replaced the measured prefill cost."""
        return (
            self.runtime is not None
            and self.non_expert_us_per_prefill_token != self.runtime.non_expert_prefill_us_per_token
        )

    def non_expert_V(self, trace) -> np.ndarray:
        """Non-expert microseconds of every layer step: decode steps the per-layer value, prefill steps
        the measured prefill curve at the step's tokens (a profile timed at several prompt lengths), else
        the per-token value times the step's tokens."""
        per_token = (
            self.non_expert_us_per_layer
            if self.non_expert_us_per_prefill_token is None
            else self.non_expert_us_per_prefill_token
        )
        curve = None if self.runtime is None else self.runtime.non_expert_prefill_layer
        prefill_V = (
            per_token * trace.tokens_V.astype(np.float64)
            if curve is None or self.non_expert_prefill_overridden
            else curve(trace.tokens_V)  # measured at several prompt lengths: interpolated
        )
        non_expert_V = np.where(trace.phase_V == DECODE, self.non_expert_us_per_layer, prefill_V).astype(
            np.float64
        )
        if self.runtime is not None:  # the manager's visit and commit, per layer step
            non_expert_V = non_expert_V + self.runtime.visit_us(trace.tokens_V)
        return non_expert_V

    @property
    def serial(self) -> bool:
        """The step's GPU and CPU halves run one after the other (the runtime's step, module docstring)."""
        return self.runtime is not None and self.runtime.overlap == "serial"

    def defer_V(self, trace, on_miss: str) -> np.ndarray:
        """bool [V]: the layer steps whose visit is deferred. The fast decode loop runs an on_miss="cpu"
        decode step's visit at the next host point, after the layer's CPU half (moecache/runtime/
        segments.py; timed.py, 7.): for a profile measured in that loop, its decode steps. Its prefill is
        transformers' own forward, whose experts modules visit each layer at its routing, before its CPU
        half (moecache/runtime/experts_module.py, `run`)."""
        if self.runtime is None or self.runtime.path != "fast" or on_miss != "cpu":
            return np.zeros(trace.num_steps, np.bool_)
        return trace.phase_V == DECODE

    def copy_host_us(self) -> float:
        """Host time one admission's copy adds to its layer step (the fast loop's enqueue); 0.0 without
        a runtime section or where the visit rows already hold their copies (RuntimeCosts.copy_host_us)."""
        return 0.0 if self.runtime is None else self.runtime.copy_host_us

    def publish_lag_Q(self) -> np.ndarray:
        """float64 [Q]: the fast loop's host time from a deferred visit's last copy enqueue to the next
        layer's publication, as quantiles at evenly spaced probabilities (RuntimeCosts.
        publish_lag_quantiles_us; timed.py, 7.); empty (no lag) without a runtime section or that row."""
        return np.array(() if self.runtime is None else self.runtime.publish_lag_quantiles_us, np.float64)

    def pause_V(self, trace) -> np.ndarray:
        """float64 [V]: host time before each layer step that is no step's own (timed.py, 8.): the fast
        loop's decoder warm-up (RuntimeCosts.decode_warmup_pause_us), a decoder's first decode steps
        being slower than the rest. A run builds one decoder, so the trace's first request pays it: its
        j-th decode step the j-th pause, spread evenly over that step's layer steps. Zeros without a
        fast-loop runtime section or that row."""
        pause_V = np.zeros(trace.num_steps, np.float64)
        pauses = (
            () if self.runtime is None or self.runtime.path != "fast" else self.runtime.decode_warmup_pause_us
        )
        if not pauses or trace.num_steps == 0:
            return pause_V
        _, first_F = forward_index(trace)
        end_F = np.append(first_F[1:], trace.num_steps)  # a forward step is a run of layer steps
        ours_F = (trace.request_V[first_F] == trace.request_V[0]) & (trace.phase_V[first_F] == DECODE)
        for f, pause_us in zip(np.nonzero(ours_F)[0], pauses, strict=False):
            pause_V[first_F[f] : end_F[f]] = pause_us / (end_F[f] - first_F[f])
        return pause_V

    def split_host_us(self) -> tuple[float, float]:
        """on_miss="split"'s host time (timed.py, 6.): (a decision, in a step with candidates; one waiting
        step's wait), the fast loop's own as calibrate measured it (RuntimeCosts.split_decide_us /
        split_wait_us); (0.0, 0.0) without a runtime section or in a profile from before that row."""
        if self.runtime is None:
            return 0.0, 0.0
        return self.runtime.split_decide_us, self.runtime.split_wait_us

    def cpu_excess_V(self, trace) -> np.ndarray:
        """float64 [V]: what a layer step with CPU work costs beyond its halves, non-expert time and
        visit: the profile's excess (RuntimeCosts.cpu_step_excess_us on decode steps,
        cpu_step_excess_prefill_us on prefill steps: the fast loop's all-CPU run); 0 without a runtime
        section. Where the profile says the all-CPU prompt's length P, a prefill step of T tokens pays
        the line through (1, the decode excess) and (P, the prefill excess) at T (at least 0): a 1-token
        first step costs what a decode step does, not what calibrate's P-token prefill did."""
        if self.runtime is None:
            return np.zeros(trace.num_steps, np.float64)
        rt = self.runtime
        prefill_V = np.full(trace.num_steps, rt.cpu_step_excess_prefill_us, np.float64)
        P = rt.cpu_step_excess_prefill_tokens
        if P > 1:
            T_V = trace.tokens_V.astype(np.float64)
            slope = (rt.cpu_step_excess_prefill_us - rt.cpu_step_excess_us) / (P - 1)
            prefill_V = np.maximum(rt.cpu_step_excess_us + slope * (T_V - 1), 0.0)
        return np.where(trace.phase_V == DECODE, rt.cpu_step_excess_us, prefill_V).astype(np.float64)

    def cpu_call_us(self) -> float:
        """Fixed CPU-path cost of a step with misses (scaled); 0.0 without a runtime section."""
        return 0.0 if self.runtime is None else self.runtime.cpu_call_us * self.cpu_scale

    def cpu_step_table(self) -> np.ndarray:
        """Per missed expert of M tokens, the CPU cost the step formula sums (scaled): `cpu_table()` less
        the call cost it includes, which the formula adds once per step."""
        return self.cpu_table() - np.where(np.arange(len(self.cpu_us_M)) > 0, self.cpu_call_us(), 0.0)

    def kernel_tables(self, trace) -> tuple[np.ndarray, np.ndarray]:
        """(kernel_off_V int64 [V], kernel_us_X float64): step s's operator time with N resident entries
        is kernel_us_X[kernel_off_V[s] + N] (scaled); one row per distinct token count of the trace. Both
        empty without a runtime section (the per-expert formula)."""
        if self.runtime is None:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        distinct, inverse = np.unique(trace.tokens_V, return_inverse=True)
        rows = [self.kernel_row_us(int(t)) for t in distinct]
        offsets = np.zeros(len(rows), np.int64)
        if rows:
            offsets[1:] = np.cumsum([len(r) for r in rows])[:-1]
        us_X = np.concatenate(rows) if rows else np.zeros(0, np.float64)
        return offsets[inverse].astype(np.int64), us_X

    def kernel_row_us(self, tokens: int) -> np.ndarray:
        """The operator's time (scaled) for a call of `tokens` tokens against N = 0..tokens x top_k
        resident entries (a runtime section's `kernel_row_us`, in this model's expert bytes)."""
        return self.runtime.kernel_row_us(int(tokens)) * (self.compute_ratio * self.gpu_scale)

    def check_trace(self, trace) -> None:
        if trace.num_accesses and int(trace.uses_A.max()) > self.max_tokens:
            raise MoecacheError(
                f"cost model tabulated up to {self.max_tokens} tokens per expert call, but trace"
                f" {trace.name} has a call of {int(trace.uses_A.max())}; build it with"
                " CostModel.for_trace(profile, trace) or a larger max_tokens"
            )
        if trace.expert_bytes != self.expert_bytes:
            raise MoecacheError(
                f"cost model built for experts of {self.expert_bytes} bytes, trace {trace.name} has"
                f" {trace.expert_bytes}; build it with CostModel.for_trace(profile, trace)"
            )

    def describe(self) -> dict:
        """Scalars for a result's metadata (no arrays)."""
        return {
            "copy_latency_us": self.copy_latency_us,
            "bandwidth_gbps": self.bandwidth_bytes_per_us / 1e3,
            "expert_bytes": self.expert_bytes,
            "copy_us": self.copy_us(),
            "cpu_us_M1": float(self.cpu_table()[1]),
            "gpu_us_M1": float(self.gpu_table()[1]),
            "non_expert_us_per_layer": self.non_expert_us_per_layer,
            "non_expert_us_per_prefill_token": self.non_expert_us_per_prefill_token,
            "bandwidth_scale": self.bandwidth_scale,
            "cpu_scale": self.cpu_scale,
            "gpu_scale": self.gpu_scale,
            "cpu_threads": self.cpu_threads,
            "dtype": self.dtype,
            "source": self.source,
            "runtime_step": None
            if self.runtime is None
            else {
                "path": self.runtime.path,
                "overlap": self.runtime.overlap,
                "cpu_call_us": self.cpu_call_us(),
                "cpu_step_excess_us": self.runtime.cpu_step_excess_us,
                "cpu_step_excess_prefill_us": self.runtime.cpu_step_excess_prefill_us,
                "kernel_us_T1": [float(v) for v in self.runtime.kernel_row_us(1)],
                "visit_us_T1": float(self.runtime.visit_us(1)),
                "copy_host_us": self.runtime.copy_host_us,
                "publish_lag_quantiles_us": list(self.runtime.publish_lag_quantiles_us),
                "decode_warmup_pause_us": list(self.runtime.decode_warmup_pause_us),
                "split_decide_us": self.runtime.split_decide_us,
                "split_wait_us": self.runtime.split_wait_us,
            },
            "notes": list(self.all_notes()),
        }


def forward_index(trace) -> tuple[np.ndarray, np.ndarray]:
    """(fwd_V, first_F): the forward step of every layer step, and the first layer step of every
    forward step (a forward step is one (request, step_index): all its layers). int64, one pass."""
    fwd_V = np.empty(trace.num_steps, np.int64)
    first_F = np.empty(trace.num_steps, np.int64)
    n = _forward_index(trace.request_V, trace.step_V, fwd_V, first_F)
    return fwd_V, first_F[:n].copy()


def forward_tokens(trace, first_F: np.ndarray) -> np.ndarray:
    """Tokens of each forward step (first_F from forward_index): the most that any of its visits
    routed. Every visit of a complete trace routes the same tokens; where an exported trace lacks some
    layers of a token, the token still counts once (exact whenever one layer has all the step's tokens)."""
    if len(first_F) == 0:
        return np.zeros(0, np.int64)
    return np.maximum.reduceat(trace.tokens_V, first_F).astype(np.int64)


@nb.njit(cache=True, nogil=True)
def _forward_index(request_V, step_V, fwd_V, first_F):
    """Fills fwd_V and first_F[:n]; returns n, the number of forward steps."""
    n = 0
    for s in range(request_V.shape[0]):
        if s == 0 or request_V[s] != request_V[s - 1] or step_V[s] != step_V[s - 1]:
            first_F[n] = s
            n += 1
        fwd_V[s] = n - 1
    return n


def instant_step_us(trace, hit_A: np.ndarray, cost: CostModel) -> np.ndarray:
    """Layer-step times of a replay whose copies are free (instant mode): the timed formula with
    infinite bandwidth, non-expert + max(sum over hits of gpu(uses), sum over misses of cpu(uses)), or
    with a runtime section the runtime's step (module docstring). float64 [V]: one compiled pass over
    the steps and their accesses."""
    cost.check_trace(trace)
    step_us_V = np.empty(trace.num_steps, np.float64)
    kernel_off_V, kernel_us_X = cost.kernel_tables(trace)
    cpu = cost.cpu_step_table() if cost.runtime is not None else cost.cpu_table()
    _instant_step_us(
        trace.start_V, trace.uses_A, hit_A, cost.non_expert_V(trace), cost.gpu_table(), cpu,
        kernel_off_V, kernel_us_X, cost.cpu_call_us(), cost.cpu_excess_V(trace), cost.serial, step_us_V,
    )  # fmt: skip
    return step_us_V


@nb.njit(cache=True, nogil=True)
def _instant_step_us(
    start_V, uses_A, hit_A, non_expert_V, gpu_us_M, cpu_us_M, kernel_off_V, kernel_us_X, cpu_call_us,
    cpu_excess_V, serial, step_us_V,
):  # fmt: skip
    """step_us_V[s] = non_expert_V[s] + max(GPU time of step s's hits, CPU time of its misses), each
    summed in access order from 0.0: the sums np.bincount gives, so the result is bit-identical to the
    vectorised formula. With kernel rows (kernel_off_V not empty) the GPU time is the operator's row at
    the step's resident entries, the CPU time gains cpu_call_us + cpu_excess_V[s] when the step has a
    miss, and `serial` adds the two instead of taking their max."""
    fused = kernel_off_V.shape[0] > 0
    for s in range(step_us_V.shape[0]):
        gpu = 0.0
        cpu = 0.0
        entries = 0
        misses = 0
        for a in range(start_V[s], start_V[s + 1]):  # adding 0.0 leaves a sum unchanged: no branch
            m = uses_A[a]
            h = hit_A[a]
            gpu += gpu_us_M[m] if h else 0.0
            cpu += 0.0 if h else cpu_us_M[m]
            entries += m if h else 0
            misses += 0 if h else 1
        if fused:
            gpu = kernel_us_X[kernel_off_V[s] + entries]
            if misses > 0:
                cpu += cpu_call_us + cpu_excess_V[s]
        step_us_V[s] = non_expert_V[s] + (gpu + cpu if serial else max(gpu, cpu))
