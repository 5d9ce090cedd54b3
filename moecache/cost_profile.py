"""A measured cost profile (`cost_profile.json`, written by `moecache calibrate`) as costs the simulator can ask.

    profile = CostProfile.load("outputs/calibrate/<id>/cost_profile.json")
    profile.cpu_expert_us(tokens=3)            # one expert on the CPU, 3 tokens, the model's dtype
    profile.copy_us(profile.expert_bytes)      # one pinned host-to-device copy of an expert
    profile.cuda_expert_us(1)                  # None when the profile was measured without a GPU

Expert times are the measured medians made non-decreasing in tokens per call (isotonic regression: noise
must not make more tokens look cheaper; the raw rows stay in `cpu`/`cuda`), interpolated linearly between
the measured points and extrapolated from the last two past the largest; copy times come from the latency + bytes / bandwidth fit of the
pinned copies, so any size can be costed.

Schema 2 adds `runtime` (null when not measured): the costs of the runtime's own code paths on the model of
the calibrate run (docs/artifacts.md, "The cost profile", documents every key). `profile.runtime_costs()` gives them
as a `RuntimeCosts` (None for a schema-1 profile or a null section), which `moecache.sim.cost_model`
uses for the whole-step estimate:

    rc = profile.runtime_costs()
    rc.kernel_row_us(tokens=1)        # slot-pool operator, 1 token: [0, N=1, ..., N=top_k] resident entries
    rc.cpu_expert_us(m)               # runtime CPU path, one more expert of m tokens in a call
    rc.cpu_call_us                    # ... its fixed cost per call (a step with at least one miss)
    rc.cpu_step_excess_us             # what else a decode layer step with CPU work costs in the fast loop
    rc.cpu_step_excess_prefill_us     # ... a prefill layer step
    rc.visit_us(tokens)               # host cost of a layer step besides the two halves (layer_call)
    rc.copy_us                        # copy engine, one expert (None: measured without CUDA)
    rc.non_expert_decode_us_per_layer, rc.non_expert_prefill_us_per_token

Interpolation as for the expert times: non-decreasing (isotonic) in the varied count, linear between the
measured points, flat below the first, extrapolated from the last two (slope >= 0) past the largest.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moecache.errors import MoecacheError

PROFILE_FILE = "cost_profile.json"
SCHEMA_VERSION = 2  # the version `moecache.stages.calibrate` writes
SCHEMA_VERSIONS = (1, 2)  # the versions `CostProfile` reads (1: no `runtime` section)
OVERLAPS = ("serial", "parallel")  # how a layer step combines its GPU and CPU halves

_RUNTIME_KEYS = ("model", "execution", "slot_moe", "cpu_path", "visit", "copy_engine", "non_expert")
_RUNTIME_MODEL_KEYS = ("num_experts", "top_k", "expert_bytes")
_TIMING_KEYS = ("median_us", "p10_us", "p90_us", "repeats")

_TOP_KEYS = ("schema_version", "shape", "dtype", "machine", "cpu", "cuda", "h2d", "measured_at")
_SHAPE_KEYS = ("hidden_size", "moe_intermediate_size", "expert_bytes")
_EXPERT_ROW_KEYS = ("dtype", "tokens_per_call", "median_us", "p10_us", "p90_us", "pool_experts")
_COPY_ROW_KEYS = ("bytes", "median_us", "gbps")
_H2D_KEYS = ("pinned", "pageable", "fit")
_FIT_KEYS = ("latency_us", "gbps")


def _require(obj, keys: tuple[str, ...], where: str, source: str) -> None:
    if not isinstance(obj, dict):
        raise MoecacheError(f"{source}: '{where or 'top level'}' must be an object, got {type(obj).__name__}")
    for key in keys:
        if key not in obj:
            raise MoecacheError(f"{source}: missing key '{where + '.' if where else ''}{key}'")


def _require_rows(rows, keys: tuple[str, ...], where: str, source: str) -> None:
    if not isinstance(rows, list) or not rows:
        raise MoecacheError(f"{source}: '{where}' must be a non-empty list")
    for n, row in enumerate(rows):
        _require(row, keys, f"{where}[{n}]", source)
        _check_values(row, f"{where}[{n}]", source)


def _is_number(value, low: float = 0.0, low_open: bool = False) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
    )


def _is_count(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


# The type of every value the cost model reads, by key (wherever the key appears in a section checked
# here): a profile damaged or written by hand fails on load, naming the key, not later inside arithmetic.
_VALUE_RULES = {
    "median_us": (_is_number, "a finite number >= 0"),
    "p10_us": (_is_number, "a finite number >= 0"),
    "p90_us": (_is_number, "a finite number >= 0"),
    "latency_us": (_is_number, "a finite number >= 0"),
    "gbps": (lambda v: _is_number(v, low_open=True), "a finite number > 0"),
    "tokens_per_call": (lambda v: _is_count(v, 1), "an integer >= 1"),
    "bytes": (lambda v: _is_count(v, 1), "an integer >= 1"),
    "expert_bytes": (lambda v: _is_count(v, 1), "an integer >= 1"),
    "hidden_size": (lambda v: _is_count(v, 1), "an integer >= 1"),
    "moe_intermediate_size": (lambda v: _is_count(v, 1), "an integer >= 1"),
    "pool_experts": (lambda v: v is None or _is_count(v, 1), "an integer >= 1 or null"),
    "threads": (lambda v: v is None or _is_count(v, 1), "an integer >= 1 or null"),
    "repeats": (lambda v: _is_count(v, 1), "an integer >= 1"),
    "dtype": (lambda v: isinstance(v, str) and bool(v), "a dtype name"),
}


def _check_values(obj: dict, where: str, source: str) -> None:
    for key, (ok, want) in _VALUE_RULES.items():
        if key in obj and not ok(obj[key]):
            raise MoecacheError(
                f"{source}: '{where + '.' if where else ''}{key}' must be {want}, got {obj[key]!r}"
            )


def _non_decreasing(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Isotonic regression (pool adjacent violators) of y over sorted x: measurement noise must not make
    more tokens per call look cheaper. Violating neighbours are replaced by their mean."""
    blocks: list[list[float]] = []  # [sum of y, count]
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(int(count))]
    return [(x, y) for (x, _), y in zip(points, fitted, strict=True)]


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points; flat below the first, linear extrapolation above the last."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if len(points) == 1:
        return points[0][1] * x / xs[0]
    i = min(bisect_left(xs, x), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    slope = (y1 - y0) / (x1 - x0)
    if x > x1:  # past the largest measured point: never let noise make more tokens cheaper
        slope = max(slope, 0.0)
    return y0 + slope * (x - x0)


@dataclass(frozen=True)
class CostProfile:
    """Measured constants of one machine for one expert shape."""

    shape: dict
    dtype: str
    machine: dict
    cpu: list[dict]
    cuda: list[dict] | None
    h2d: dict | None
    measured_at: str
    measure_s: float | None = None
    source: str = "<dict>"
    runtime: dict | None = None  # schema 2's runtime section (None: schema 1, or not measured)

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        path = Path(path)
        if path.is_dir():
            path = path / PROFILE_FILE
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise MoecacheError(f"cannot read cost profile {path}: {exc.strerror or exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MoecacheError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> CostProfile:
        _require(data, _TOP_KEYS, "", source)
        if data["schema_version"] not in SCHEMA_VERSIONS:
            raise MoecacheError(
                f"{source}: schema_version {data['schema_version']}, expected one of {list(SCHEMA_VERSIONS)}"
            )
        runtime = data.get("runtime") if data["schema_version"] >= 2 else None
        if runtime is not None:
            _check_runtime(runtime, source)
        _require(data["shape"], _SHAPE_KEYS, "shape", source)
        _check_values(data["shape"], "shape", source)
        _check_values({"dtype": data["dtype"]}, "", source)
        if not isinstance(data["machine"], dict):
            raise MoecacheError(
                f"{source}: 'machine' must be an object, got {type(data['machine']).__name__}"
            )
        _require_rows(data["cpu"], _EXPERT_ROW_KEYS, "cpu", source)
        if data["cuda"] is not None:
            _require_rows(data["cuda"], _EXPERT_ROW_KEYS, "cuda", source)
        if data["h2d"] is not None:
            _require(data["h2d"], _H2D_KEYS, "h2d", source)
            _require_rows(data["h2d"]["pinned"], _COPY_ROW_KEYS, "h2d.pinned", source)
            _require_rows(data["h2d"]["pageable"], _COPY_ROW_KEYS, "h2d.pageable", source)
            _require(data["h2d"]["fit"], _FIT_KEYS, "h2d.fit", source)
            _check_values(data["h2d"]["fit"], "h2d.fit", source)
        return cls(
            shape=data["shape"],
            dtype=data["dtype"],
            machine=data["machine"],
            cpu=data["cpu"],
            cuda=data["cuda"],
            h2d=data["h2d"],
            measured_at=data["measured_at"],
            measure_s=data.get("measure_s"),
            source=source,
            runtime=runtime,
        )

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in the model's weight dtype (`dtype`)."""
        return int(self.shape["expert_bytes"])

    def dtypes(self, where: str = "cpu") -> list[str]:
        rows = self.cpu if where == "cpu" else (self.cuda or [])
        return list(dict.fromkeys(r["dtype"] for r in rows))

    def _expert_us(self, rows: list[dict], where: str, tokens: float, dtype: str | None) -> float:
        dtype = dtype or self.dtype
        points = sorted((r["tokens_per_call"], r["median_us"]) for r in rows if r["dtype"] == dtype)
        if not points:
            raise MoecacheError(
                f"{self.source}: no {where} expert timings for dtype {dtype} (has {self.dtypes(where)})"
            )
        if tokens <= 0:
            return 0.0
        return _interpolate(_non_decreasing(points), tokens)

    def cpu_expert_us(self, tokens: float, dtype: str | None = None) -> float:
        """Median microseconds of one expert call on the CPU for `tokens` tokens (weights cold)."""
        return self._expert_us(self.cpu, "cpu", tokens, dtype)

    def cuda_expert_us(self, tokens: float, dtype: str | None = None) -> float | None:
        """Median microseconds of one expert call on the GPU, or None when not measured (no GPU, or not that dtype)."""
        if self.cuda is None or (dtype or self.dtype) not in self.dtypes("cuda"):
            return None
        return self._expert_us(self.cuda, "cuda", tokens, dtype)

    def _need_h2d(self) -> dict:
        if self.h2d is None:
            raise MoecacheError(
                f"{self.source}: no host-to-device copy timings (calibrated without CUDA); use a profile"
                " calibrated with device=cuda"
            )
        return self.h2d

    def copy_us(self, nbytes: int) -> float:
        """Microseconds of one pinned host-to-device copy of `nbytes`, from the latency/bandwidth fit."""
        if nbytes <= 0:
            return 0.0
        fit = self._need_h2d()["fit"]
        return fit["latency_us"] + nbytes / (fit["gbps"] * 1e3)

    def expert_copy_us(self) -> float:
        """`copy_us` of one expert in the model's dtype."""
        return self.copy_us(self.expert_bytes)

    def pinned_at(self, nbytes: int) -> dict:
        """The measured pinned-copy row of exactly `nbytes` (the calibration always measures one expert's bytes)."""
        for row in self._need_h2d()["pinned"]:
            if row["bytes"] == nbytes:
                return row
        raise MoecacheError(f"{self.source}: no pinned copy of exactly {nbytes} bytes was measured")

    def runtime_costs(self) -> RuntimeCosts | None:
        """The runtime section as costs (module docstring), or None where the profile has none."""
        return None if self.runtime is None else RuntimeCosts.from_section(self.runtime, self.source)


def cpu_path_fit(rows: list[dict], source: str) -> tuple[Curve, float]:
    """The CPU path's rows as (cost of one more expert of m tokens: a Curve over m, the call's fixed
    cost): at each token count timed at two or more expert counts, the slope between the fewest and the
    most experts and its intercept; the call cost is the smallest m's intercept (a decode step's call)."""
    cpu: dict[int, dict[int, float]] = {}
    for r in rows:
        cpu.setdefault(int(r["tokens_per_expert"]), {})[int(r["experts"])] = float(r["median_us"])
    per_expert, per_call = [], []
    for m, by_u in sorted(cpu.items()):
        if len(by_u) < 2:
            continue
        lo, hi = min(by_u), max(by_u)
        slope = max((by_u[hi] - by_u[lo]) / (hi - lo), 0.0)
        per_expert.append((float(m), slope))
        per_call.append(by_u[lo] - lo * slope)
    if not per_expert:
        raise MoecacheError(f"{source}: runtime.cpu_path has no token count timed at two expert counts")
    return Curve(per_expert), max(float(per_call[0]), 0.0)


def _split_host(rt: dict, key: str) -> float:
    row = rt.get("split_host")
    return 0.0 if row is None or row.get(key) is None else float(row[key])


def decode_warmup_row(gaps_us: list[float], step_us: float, **where) -> dict:
    """runtime.decode_warmup from a fast-loop decoder's warm-up gaps and its decode step's time: each gap
    beyond the step (`pause_us`, at least 0; the simulator's pause, timed.py 8.), with the measurements
    and `where` (what ran them) kept beside. calibrate's own decoder and validate's anchoring both write
    it so."""
    return {
        "pause_us": [max(0.0, float(gap) - float(step_us)) for gap in gaps_us],
        "gaps_us": [float(gap) for gap in gaps_us],
        "step_us": float(step_us),
        **where,
    }


def _numbers(rt: dict, section: str, key: str) -> tuple[float, ...]:
    """runtime.<section>.<key>, a list of numbers, as floats; () where the profile has no such row."""
    return tuple(float(v) for v in (rt.get(section) or {}).get(key) or ())


def _at_least_0(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _check_runtime(rt, source: str) -> None:
    _require(rt, _RUNTIME_KEYS, "runtime", source)
    _require(rt["model"], _RUNTIME_MODEL_KEYS, "runtime.model", source)
    _require(rt["execution"], ("path", "overlap"), "runtime.execution", source)
    if rt["execution"]["overlap"] not in OVERLAPS:
        raise MoecacheError(
            f"{source}: runtime.execution.overlap={rt['execution']['overlap']!r}, expected one of {list(OVERLAPS)}"
        )
    _require_rows(rt["slot_moe"], ("tokens", "entries", *_TIMING_KEYS), "runtime.slot_moe", source)
    _require_rows(rt["cpu_path"], ("tokens_per_expert", "experts", *_TIMING_KEYS), "runtime.cpu_path", source)
    _require_rows(rt["visit"], ("tokens", *_TIMING_KEYS), "runtime.visit", source)
    if rt.get("layer_call") is not None:
        _require_rows(rt["layer_call"], ("tokens", *_TIMING_KEYS), "runtime.layer_call", source)
    if rt.get("visit_hits") is not None:
        _require_rows(rt["visit_hits"], ("tokens", *_TIMING_KEYS), "runtime.visit_hits", source)
    if rt.get("split_host") is not None:
        _require(
            rt["split_host"], ("decide_us", "wait_us", "decisions", "waits"), "runtime.split_host", source
        )
        for key in ("decide_us", "wait_us"):
            v = rt["split_host"][key]
            if v is not None and not _at_least_0(v):
                raise MoecacheError(
                    f"{source}: runtime.split_host.{key}={v!r}: expected a number >= 0 or null"
                )
    if rt.get("publish_lag") is not None:
        _require(rt["publish_lag"], ("quantiles_us",), "runtime.publish_lag", source)
        q = rt["publish_lag"]["quantiles_us"]
        if (
            not isinstance(q, list)
            or len(q) < 2
            or not all(_at_least_0(v) for v in q)
            or any(b < a for a, b in zip(q, q[1:], strict=False))
        ):
            raise MoecacheError(
                f"{source}: runtime.publish_lag.quantiles_us={q!r}: expected at least two non-decreasing numbers >= 0"
            )
    if rt.get("decode_warmup") is not None:
        _require(rt["decode_warmup"], ("pause_us",), "runtime.decode_warmup", source)
        pauses = rt["decode_warmup"]["pause_us"]
        if not isinstance(pauses, list) or not all(_at_least_0(v) for v in pauses):
            raise MoecacheError(
                f"{source}: runtime.decode_warmup.pause_us={pauses!r}: expected a list of numbers >= 0"
            )
    if rt.get("cpu_step_excess") is not None:
        _require(rt["cpu_step_excess"], ("decode_us", "raw_us"), "runtime.cpu_step_excess", source)
        for key in ("decode_us", "prefill_us"):
            v = rt["cpu_step_excess"].get(key)
            if key == "prefill_us" and v is None:  # a profile that prices the decode's alone
                continue
            if not _at_least_0(v):
                raise MoecacheError(f"{source}: runtime.cpu_step_excess.{key}={v!r}: expected a number >= 0")
    if rt["copy_engine"] is not None:
        _require(
            rt["copy_engine"],
            ("expert_bytes", "per_copy_us", "single", "batch"),
            "runtime.copy_engine",
            source,
        )
    if rt["non_expert"] is not None:
        _require(
            rt["non_expert"],
            ("moe_layers", "decode_us_per_layer", "prefill_us_per_token_per_layer"),
            "runtime.non_expert",
            source,
        )
    experts = {r["experts"] for r in rt["cpu_path"]}
    if len(experts) < 2:
        raise MoecacheError(
            f"{source}: runtime.cpu_path needs calls of two expert counts (per expert and per call), has {sorted(experts)}"
        )


def _host_rows(rt: dict) -> list[dict]:
    """The rows of a layer step's host cost besides its two halves: the fast loop's host point is the
    manager's visit and commit (the loop reads the routing back in its graphs and combines on the
    device): `visit_hits` (no admissions; each copy enqueued adds `copy_host_us`) where measured, else
    `visit`; the experts-module call of the transformers path adds its read-back, split and combine
    (`layer_call`, where measured)."""
    if rt["execution"]["path"] == "fast":
        return rt.get("visit_hits") or rt["visit"]
    return rt.get("layer_call") or rt["visit"]


def _copy_host_us(rt: dict) -> float:
    """Host microseconds one admission's copy adds to a visit (enqueue, events), for the fast loop: the
    median over the visit rows' token counts of (visit - visit_hits) / copies per visit, >= 0; 0.0 without
    `visit_hits` rows or on another path (there the measured visit rows hold their copies)."""
    hits = {int(r["tokens"]): float(r["median_us"]) for r in rt.get("visit_hits") or []}
    if rt["execution"]["path"] != "fast" or not hits:
        return 0.0
    shares = [
        (float(r["median_us"]) - hits[int(r["tokens"])]) / float(r["copies_per_visit"])
        for r in rt["visit"]
        if int(r["tokens"]) in hits and float(r.get("copies_per_visit") or 0) > 0
    ]
    return max(float(np.median(shares)), 0.0) if shares else 0.0


def _prefill_curve(ne: dict | None) -> Curve | None:
    """One prefill layer step's non-expert µs against its tokens, through the measured prompt lengths
    (None with fewer than two: one length cannot say how the cost grows). Not forced non-decreasing: an
    eager prefill step is bound by the host's launches at short prompts and by the device at long ones,
    and its non-expert share can shrink as the prompt grows (H100, Qwen3.6: 86 ms at 32 tokens, 33 at 512,
    the expert path taken off); pooling the two priced a 1-token first step at their mean."""
    points = (ne or {}).get("prefill_points") or []
    if len({int(p["prompt_tokens"]) for p in points}) < 2:
        return None
    layers = int(ne["moe_layers"])
    return Curve(
        [(float(p["prompt_tokens"]), float(p["median_us"]) / layers) for p in points], monotone=False
    )


def _excess_prefill_tokens(rt: dict) -> int:
    """RuntimeCosts.cpu_step_excess_prefill_tokens: calibrate's all-CPU prompt where the profile prices the
    prefill excess and says the prompt's length (more than one token), else 0."""
    excess, runs = rt.get("cpu_step_excess") or {}, rt.get("cpu_path_prefill") or {}
    tokens = runs.get("prompt_tokens")
    if excess.get("prefill_us") is None or not isinstance(tokens, int) or isinstance(tokens, bool):
        return 0
    return tokens if tokens > 1 else 0


class Curve:
    """y(x) through measured (x, y) points: non-decreasing (isotonic; `monotone=False`: as measured),
    piecewise linear, flat below the first point, extrapolated past the last with the last two points'
    slope (>= 0). Vectorised."""

    def __init__(self, points: list[tuple[float, float]], monotone: bool = True):
        fitted = _non_decreasing(sorted(points)) if monotone else sorted(points)
        self.x = np.array([p[0] for p in fitted], np.float64)
        self.y = np.array([p[1] for p in fitted], np.float64)

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x, np.float64)
        out = np.interp(x, self.x, self.y)
        if len(self.x) >= 2:
            slope = max((self.y[-1] - self.y[-2]) / (self.x[-1] - self.x[-2]), 0.0)
            out = np.where(x > self.x[-1], self.y[-1] + slope * (x - self.x[-1]), out)
        elif self.x[0] > 0:
            out = np.where(x > self.x[0], self.y[0] * x / self.x[0], out)
        return out


@dataclass(frozen=True, eq=False)
class RuntimeCosts:
    """The runtime section of a schema-2 profile as costs in microseconds (module docstring)."""

    num_experts: int
    top_k: int
    expert_bytes: int  # of the runtime's measured model, in its dtype
    overlap: str  # "serial": the step's CPU half runs after its GPU half; "parallel": at the same time
    path: str  # the decode loop the non-expert time was measured in ("transformers" or "fast")
    kernel_tokens: np.ndarray  # int64 [J]: tokens of the operator's measured rows
    kernel_curves: tuple[Curve, ...]  # per measured token count: time against resident entries
    cpu_expert: Curve  # one more expert of m tokens in a CPU-path call
    cpu_call_us: float  # fixed cost of a CPU-path call
    visit: Curve  # the layer step's host cost against its tokens (_host_rows)
    copy_us: float | None  # copy engine, one expert copy's share of back-to-back copies
    non_expert_decode_us_per_layer: float | None
    non_expert_prefill_us_per_token: float | None
    # µs of one prefill layer step against its tokens (from `prefill_points`: prefills of several lengths);
    # None in profiles measured at one length (then per token x tokens)
    non_expert_prefill_layer: Curve | None = None
    copy_host_us: float = 0.0  # host time one admission's copy adds to its visit (_copy_host_us)
    # the fast loop's host time from a deferred visit's last copy enqueue to the next layer's publication,
    # as quantiles at evenly spaced probabilities (runtime.publish_lag.quantiles_us, measured in the loop);
    # empty where the profile has no such row (no lag)
    publish_lag_quantiles_us: tuple[float, ...] = ()
    # the fast loop's decoder warm-up: its first decode steps (eager, the capture) beyond a decode step's
    # time (runtime.decode_warmup.pause_us, measured in the loop); empty where the profile has no such row
    decode_warmup_pause_us: tuple[float, ...] = ()
    # on_miss="split", measured in the fast loop (runtime.split_host): host time of the decision in a
    # visit with candidates, and of a waiting visit's wait (stream wait, wait row, wait call); 0.0 where
    # the profile has no such row (older profiles, a transformers-loop calibrate, no visit waited)
    split_decide_us: float = 0.0
    split_wait_us: float = 0.0
    # a fast-loop layer step with CPU work, beyond its halves, non-expert time and visit (decode; prefill)
    # (runtime.cpu_step_excess, calibrate's all-CPU run); 0.0 where the profile has no such row
    cpu_step_excess_us: float = 0.0
    cpu_step_excess_prefill_us: float = 0.0
    # the prompt tokens calibrate's all-CPU prefill had (runtime.cpu_path_prefill.prompt_tokens): the
    # prefill excess is then linear in a step's tokens through (1, decode's) and (these, prefill's);
    # 0 where the profile does not say (the prefill excess is then one per step)
    cpu_step_excess_prefill_tokens: int = 0
    source: str = ""

    @classmethod
    def from_section(cls, rt: dict, source: str) -> RuntimeCosts:
        by_tokens: dict[int, list] = {}
        for r in rt["slot_moe"]:
            by_tokens.setdefault(int(r["tokens"]), []).append((float(r["entries"]), float(r["median_us"])))
        tokens = sorted(by_tokens)
        cpu_expert, cpu_call_us = cpu_path_fit(rt["cpu_path"], source)
        ne = rt["non_expert"]
        engine = rt["copy_engine"]
        return cls(
            num_experts=int(rt["model"]["num_experts"]),
            top_k=int(rt["model"]["top_k"]),
            expert_bytes=int(rt["model"]["expert_bytes"]),
            overlap=str(rt["execution"]["overlap"]),
            path=str(rt["execution"]["path"]),
            kernel_tokens=np.array(tokens, np.int64),
            kernel_curves=tuple(Curve(by_tokens[t]) for t in tokens),
            cpu_expert=cpu_expert,
            cpu_call_us=cpu_call_us,
            visit=Curve([(float(r["tokens"]), float(r["median_us"])) for r in _host_rows(rt)]),
            copy_us=None if engine is None else float(engine["per_copy_us"]),
            non_expert_decode_us_per_layer=None if ne is None else float(ne["decode_us_per_layer"]),
            non_expert_prefill_us_per_token=None
            if ne is None
            else float(ne["prefill_us_per_token_per_layer"]),
            non_expert_prefill_layer=_prefill_curve(ne),
            copy_host_us=_copy_host_us(rt),
            publish_lag_quantiles_us=_numbers(rt, "publish_lag", "quantiles_us"),
            decode_warmup_pause_us=_numbers(rt, "decode_warmup", "pause_us"),
            split_decide_us=_split_host(rt, "decide_us"),
            split_wait_us=_split_host(rt, "wait_us"),
            cpu_step_excess_us=float((rt.get("cpu_step_excess") or {}).get("decode_us") or 0.0),
            cpu_step_excess_prefill_us=float((rt.get("cpu_step_excess") or {}).get("prefill_us") or 0.0),
            cpu_step_excess_prefill_tokens=_excess_prefill_tokens(rt),
            source=source,
        )

    def kernel_row_us(self, tokens: int) -> np.ndarray:
        """float64 [tokens x top_k + 1]: the operator's time for a step of `tokens` tokens against its
        resident entries N = 0..tokens x top_k (N = 0: the runtime does not call it, 0 us). Between
        measured token counts, linear in tokens at each N; outside them, flat below / extrapolated above."""
        n = np.arange(tokens * self.top_k + 1, dtype=np.float64)
        rows = np.stack([curve(n) for curve in self.kernel_curves])  # [J, N]
        ts = self.kernel_tokens.astype(np.float64)
        if len(ts) == 1 or tokens <= ts[0]:
            row = rows[0]
        else:
            j = min(int(np.searchsorted(ts, tokens)), len(ts) - 1)
            w = (tokens - ts[j - 1]) / (ts[j] - ts[j - 1])
            row = rows[j - 1] + w * (rows[j] - rows[j - 1])
            if tokens > ts[-1]:
                row = np.maximum(row, rows[-1])  # never cheaper than the largest measured token count
        row = np.maximum.accumulate(np.maximum(row, 0.0))
        row[0] = 0.0
        return row

    def cpu_expert_us(self, m) -> np.ndarray:
        return self.cpu_expert(m)

    def visit_us(self, tokens) -> np.ndarray:
        return self.visit(tokens)
