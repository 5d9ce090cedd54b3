"""Type and range checks of the config values each stage reads, run before the stage does any work.

Hydra parses `force=no` as the string "no", `capacity=3.7` as a float and `sim.bandwidth_scale=abc` as
a string; coercing such values is wrong (`bool("no")` is true, `int(3.7)` is 3), and passing them on
fails deep inside a stage with a traceback. Here every value is checked against what it must be, and a value that is not
exactly that is refused with one line naming the key and the value: never coerced.

The rules are a table per config group (`RULES`); `check_config(stage, c)` applies those of the keys
`stage` reads (its root config, conf/<stage>.yaml: moecache/config_tree.py). A group's own semantic
checks (a policy's parameters, a trace's contents) stay with the code that owns them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from moecache.capacity import capacity_specs
from moecache.config_tree import stage_keys
from moecache.errors import MoecacheError

Check = Callable[[str, object], None]
MODES = ("instant", "timed")  # moecache.sim.sweep.MODES; repeated so checking needs no numba import
SCALES = ("bandwidth_scale", "cpu_scale", "gpu_scale")  # moecache.sim.sweep.SCALES


def _show(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else str(value)


def _fail(key: str, value, want: str) -> None:
    raise MoecacheError(f"{key}={_show(value)}: expected {want}")


def boolean(key: str, value) -> None:
    if not isinstance(value, bool):
        _fail(key, value, "true or false")


def integer(low: int | None = None) -> Check:
    def check(key: str, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
            _fail(key, value, "an integer" + (f" >= {low}" if low is not None else ""))

    return check


def number(low: float | None = None, high: float | None = None, *, low_open=False, high_open=False) -> Check:
    """A finite int or float in [low, high]; `low_open` / `high_open` exclude the bound itself."""
    lo = "(" if low_open or low is None else "["
    hi = ")" if high_open or high is None else "]"
    where = f" in {lo}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi}"

    def check(key: str, value) -> None:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            _fail(key, value, "a number" + (where if (low, high) != (None, None) else ""))

    return check


def string(key: str, value) -> None:
    if not isinstance(value, str) or not value:
        _fail(key, value, "a non-empty string")


def one_of(*options: str) -> Check:
    def check(key: str, value) -> None:
        if value not in options:
            _fail(key, value, f"one of {', '.join(options)}")

    return check


def optional(inner: Check) -> Check:
    def check(key: str, value) -> None:
        if value is not None:
            inner(key, value)

    return check


def list_of(inner: Check, *, nonempty: bool = True) -> Check:
    def check(key: str, value) -> None:
        if not isinstance(value, list):
            _fail(key, value, "a list, e.g. [a,b]")
        if nonempty and not value:
            _fail(key, value, "a non-empty list")
        for i, item in enumerate(value):
            inner(f"{key}[{i}]", item)

    return check


def _scale_set(key: str, value) -> None:
    if not isinstance(value, dict) or not value:
        _fail(key, value, f"a mapping of {', '.join(SCALES)} to factors")
    for name, factor in value.items():
        if name not in SCALES:
            raise MoecacheError(f"{key}: unknown key {name!r}; use {', '.join(SCALES)}")
        number(0, low_open=True)(f"{key}.{name}", factor)


def _policy_sets(key: str, value) -> None:
    """sweep.policies: policy name -> list of parameter mappings (the names and parameters themselves
    are checked by the policy registry when the sweep builds its jobs)."""
    if not isinstance(value, dict):
        _fail(key, value, "a mapping of policy name to a list of parameter sets")
    for name, sets in value.items():
        if not isinstance(sets, list) or not sets or not all(isinstance(p, dict | None) for p in sets):
            _fail(f"{key}.{name}", sets, "a non-empty list of parameter mappings, e.g. [{}]")


def _capacity(required: bool) -> Check:
    def check(key: str, value) -> None:
        if value is None:
            if required:
                raise MoecacheError(
                    f"{key} is required: give a slot count, a percentage ('25%'), a memory budget"
                    " ('12GiB') or a list of them"
                )
            return
        capacity_specs(value, key=key)

    return check


def _one_capacity(key: str, value) -> None:
    """`moecache generate` runs one cache: one capacity, `auto` (the slots that fit the device's free
    memory, moecache/models/memory_fit.py) or none (then runtime.enabled=false)."""
    if isinstance(value, list | tuple):
        _fail(key, value, "one capacity (moecache generate runs one cache), e.g. capacity=25%")
    if value is not None and value != "auto":
        capacity_specs(value, key=key)


def _stream_min_tokens(key: str, value) -> None:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        _fail(key, value, "auto or an integer >= 0")


def _share(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        _fail(key, value, "a number >= 0 and < 1")


def _memory_size(key: str, value) -> None:
    """A memory size in the capacity syntax's units ("3GiB", "512MiB")."""
    from moecache.capacity import capacity_spec

    if not isinstance(value, str) or capacity_spec(value, key=key).kind != "bytes":
        _fail(key, value, "a memory size such as 3GiB")


def _logging_enabled(key: str, value) -> None:
    """`collect` exists to log routing: `logging.enabled=false` there contradicts the command. null (the
    default) means "the stage decides": on in collect, off in the runtime's inference path."""
    optional(boolean)(key, value)
    if value is False:
        raise MoecacheError(
            f"{key}=false: `moecache collect` always logs routing (that is its output); "
            "drop the override (logging.enabled is for the runtime's inference path)"
        )


def _coverage(key: str, value) -> None:
    """analyze.coverage: fractions in (0, 1], each naming its own concentration column (cover_<percent>,
    moecache/analysis/frequency.py), so no two may round to the same percent."""
    list_of(number(0, 1, low_open=True))(key, value)
    seen: dict[int, float] = {}
    for f in value:
        percent = int(round(f * 100))
        if percent in seen:
            raise MoecacheError(
                f"{key}={_show(value)}: {seen[percent]} and {f} both name the column cover_{percent}"
            )
        seen[percent] = f


def _candidate_sets(key: str, value) -> None:
    """analyze.history.candidates: policy name -> list of parameter mappings (an empty list leaves the
    policy out), at least one set in all (the names and parameters are checked by the policy registry)."""
    if not isinstance(value, dict):
        _fail(key, value, "a mapping of policy name to a list of parameter sets")
    for name, sets in value.items():
        if sets is not None and (
            not isinstance(sets, list) or not all(isinstance(p, dict | None) for p in sets)
        ):
            _fail(f"{key}.{name}", sets, "a list of parameter mappings, e.g. [{}]")
    if not any(value.values()):
        raise MoecacheError(f"{key}: no parameter set in any policy; nothing to compare")


COMMON = {"force": boolean, "output_root": string}
RULES: dict[str, dict[str, Check]] = {
    "seed": {"seed": integer(0)},
    "device": {"device": string},
    "traces": {"traces": list_of(string, nonempty=False)},
    "sim": {
        "sim.mode": one_of(*MODES),
        "sim.cost_profile": string,
        "sim.dtype": optional(string),
        "sim.non_expert_us_per_layer": number(0),
        "sim.on_miss": one_of("cpu", "wait", "split"),  # moecache.sim.miss_split.ON_MISS_CODES
        **{f"sim.{s}": number(0, low_open=True) for s in SCALES},
    },
    "sweep.capacities": {
        "sweep.capacities.dense_multiple": number(0, low_open=True),
        "sweep.capacities.dense_step": optional(integer(1)),
        "sweep.capacities.fractions": list_of(number(0, 1, low_open=True), nonempty=False),
    },
    "sweep": {
        "sweep.policies": _policy_sets,
        "sweep.modes": list_of(one_of(*MODES)),
        "sweep.sensitivity.policies": list_of(string, nonempty=False),
        "sweep.sensitivity.scales": list_of(_scale_set, nonempty=False),
        "sweep.block_forward_steps": integer(1),
        "sweep.targets": list_of(number(0, 1, low_open=True), nonempty=False),
        "sweep.workers": optional(integer(1)),
    },
    "analyze": {
        "analyze.coverage": _coverage,
        "analyze.window_tokens": integer(1),
        "analyze.convergence_per_token_multiples": list_of(number(0, low_open=True)),
        "analyze.max_lead_layers": integer(1),
        "analyze.capacities.dense_multiple": number(0, low_open=True),
        "analyze.capacities.dense_step": optional(integer(1)),
        "analyze.capacities.fractions": list_of(number(0, 1, low_open=True), nonempty=False),
        "analyze.history.prefix_fraction": number(0, 1, low_open=True, high_open=True),
        "analyze.history.per_token_multiples": list_of(number(0, low_open=True)),
        "analyze.history.candidates": _candidate_sets,
    },
    "logging": {
        "logging.enabled": _logging_enabled,
        "logging.formats": list_of(one_of("parquet", "jsonl")),
        "logging.queue_size": integer(1),
        "logging.on_overflow": one_of("raise", "block"),
        "logging.row_group_rows": integer(1),
        "logging.log_text": boolean,
        "logging.logit_lens.rate": number(0, 1),
    },
    "generation": {
        "generation.max_new_tokens": optional(integer(1)),
        "generation.do_sample": boolean,
        "generation.temperature": number(0, low_open=True),
        "generation.top_p": number(0, 1, low_open=True),
        "generation.ignore_eos": boolean,
    },
    "runtime": {
        "runtime.enabled": boolean,
        "runtime.decision": optional(string),
        "runtime.on_miss": one_of("cpu", "wait", "split"),
        "runtime.cost_profile": optional(string),
        "runtime.device": one_of("auto", "cuda", "standin"),
        "runtime.compile": boolean,
        "runtime.headroom": _memory_size,
        "runtime.stream_min_tokens": _stream_min_tokens,
        "runtime.stream_chunk": integer(1),
        "runtime.decode_stream_share": _share,
        "runtime.init": optional(string),
        "runtime.save_state": optional(string),
    },
    "prompt": {"prompt": optional(string)},
    "cost": {
        "cost.tokens_per_call": list_of(integer(1)),
        "cost.dtypes": list_of(string),
        "cost.repeats": integer(1),
        "cost.warmup": integer(0),
        "cost.threads": optional(integer(1)),
        "cost.num_pool_experts": optional(integer(2)),
        "cost.pool_bytes": optional(integer(1)),
        "cost.fallback_llc_bytes": integer(1),
        "cost.max_pool_bytes": integer(1),
        "cost.copy_sizes_bytes": list_of(integer(1)),
        "cost.runtime.enabled": boolean,
        "cost.runtime.repeats": integer(1),
        "cost.runtime.warmup": integer(0),
        "cost.runtime.kernel_tokens": list_of(integer(1)),
        "cost.runtime.cpu_tokens_per_expert": list_of(integer(1)),
        "cost.runtime.visit_tokens": list_of(integer(1)),
        "cost.runtime.copy_batch": integer(1),
        "cost.runtime.prompt_tokens": list_of(integer(1)),
        "cost.runtime.decode_steps": integer(1),
        "cost.runtime.cpu_path_decode_steps": integer(1),
        "cost.runtime.cpu_path_prompt_tokens": integer(1),
        "cost.runtime.step": string,
        "cost.runtime.cpu_threads": optional(integer(1)),
        "cost.runtime.cpu_backend": one_of("auto", "cpp", "torch"),
    },
}
# The sweep group includes its capacity grid.
RULES["sweep"].update(RULES["sweep.capacities"])
CAPACITY = {
    "simulate": _capacity(required=True),
    "sweep": _capacity(required=False),
    "generate": _one_capacity,
}


def _get(c: dict, dotted: str):
    node = c
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


_ABSENT = object()


def check_config(stage: str, c: dict) -> None:
    """Check every value `stage` reads in the resolved config `c` (a plain dict); one line on failure."""
    rules = dict(COMMON)
    for group in stage_keys(stage):
        rules.update(RULES.get(group, {}))
    if stage in CAPACITY:
        rules["capacity"] = CAPACITY[stage]
    for key, check in rules.items():
        value = _get(c, key)
        if value is not _ABSENT:
            check(key, value)
