"""Every run of `moecache validate` on ONE model, never copied (a 35B model cannot be):

1. the reference of every workload (`validate.reference: unmodified`): the model as loaded, every expert
   on the compute device, no runtime, BEFORE anything is offloaded. It fixes the requests (a multi-turn
   conversation's later turns are built from its answers), gives the reference outputs and the trace
   whose counts make the hindsight placement. (`validate.reference: all_resident`, for a model that
   cannot be held on the device twice over its experts' host copy: the all_resident run is the
   reference instead, and runs first.)
2. output agreement's baseline and tolerance of every workload (`validate.agreement_requests` > 0), on
   the unmodified model, still before anything is offloaded (moecache/validation/agreement_runs.py);
3. the model is offloaded once (`moecache.offload`: its experts go to the host store); then every
   strategy at every capacity, per workload, on a new cache of the same host store
   (`model.moecache.reconfigure(capacity=, policy=, params=, on_miss=)`): a fresh manager and slot pool,
   cold, as a fresh offload would give. After each run, its output agreement, teacher-forced on the
   cache the run left. With `validate.repeats` > 1 the workload's runs go that many rounds (repeats.py:
   every other round in reverse order, the repeat of median time kept; agreement after the first);
4. the fidelity table: every offloaded run predicted on calibrate's profile as given; with a profile
   that can be anchored, again on its own workload's anchored profile (anchors.py) and on every other
   workload's (holdout.py: the held-out prediction, the anchor runs marked fitted).

Each run's trace goes to `<folder>/traces/<workload>/<strategy>-c<slots>/trace.parquet` (`unmodified`
for the reference); its row names it relative to `folder` (the artifact).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moecache.errors import MoecacheError
from moecache.trace.schema import TraceMeta
from moecache.validation import agreement_runs, anchors, holdout, predict, repeats
from moecache.validation.baselines import Strategy, hindsight_keys, install_hindsight
from moecache.validation.runs import Outputs, Request, RunSpec, cache_length, measure
from moecache.validation.workloads import request_stream

REFERENCES = ("unmodified", "all_resident")


@dataclass
class Workload:
    name: str
    wcfg: object | None = None  # conf/workload/<name>.yaml (None: a forced workload)
    forced: object | None = None  # moecache/validation/forcing.py ForcedWorkload


@dataclass
class Settings:
    device: str
    seed: int
    loop: str
    limit: int | None
    max_new_tokens: int | None
    folder: Path
    run_id: str
    profile: str | None
    reference: str = "unmodified"
    warmup: bool = False  # _warm_up before each workload's timed runs
    init: str | None = None  # validate.init: the selected strategy's cache starts from it
    agreement_requests: int = 0  # validate.agreement_requests (0: no output agreement)
    agreement_tokens: int | None = None  # validate.agreement_tokens (None: as many as the runs route)
    agreement_impls: tuple[str, ...] = ("eager",)  # validate.agreement_impls
    agreement_float32: bool = False  # validate.agreement_float32
    repeats: int = 1  # validate.repeats: each offloaded run's repeats (repeats.py)
    # the CPU probe timed before each run (machine_check.RunProbe.probe: % against the profile's); None:
    # no profile
    run_probe: Callable[[], float] | None = None


@dataclass
class Validated:
    """What `validate_all` measured: runs.parquet's and latency.parquet's rows, the agreement table's
    rows and its summary per workload, the fidelity table's rows (tables.py)."""

    rows: list[dict]
    latencies: list[dict]
    agreement: list[dict]
    agreement_of: dict[str, dict]
    fidelity: list[dict]


def _meta(model_label: str, arch: dict, workload: str, spec: RunSpec, s: Settings) -> TraceMeta:
    return TraceMeta(
        num_layers=arch["num_layers"], num_experts=arch["num_experts"], top_k=arch["top_k"],
        expert_bytes=arch["expert_bytes"], model=model_label, source=f"validate:{workload}",
        run={
            "workload": workload, "strategy": spec.label, "capacity": spec.capacity, "slots": spec.slots,
            "policy": spec.strategy.policy.label() if spec.strategy else None,
            "on_miss": spec.strategy.on_miss if spec.strategy else None, "device": s.device,
            "loop": s.loop,
        },
    )  # fmt: skip


def _configure(
    model, strategy: Strategy, slots: int, hindsight_G, profile: str | None = None, init: str | None = None
) -> None:
    """A new cold cache for the run on the model's host store (module docstring, 2.); `profile`: the
    cost profile an on_miss="split" strategy, or a policy that weighs costs, reads; `init`: a saved
    manager state or a routing trace the selected strategy's cache starts from instead
    (moecache/runtime/manager_state.py)."""
    from moecache.offloading import cost_readers

    reads = bool(cost_readers(strategy.on_miss, strategy.policy))
    session = model.moecache.reconfigure(
        capacity=slots, policy=strategy.policy.name, params=dict(strategy.policy.params),
        on_miss=strategy.on_miss, cost_profile=profile if reads else None,
    )  # fmt: skip
    if init is not None and strategy.name == "selected":
        from moecache.runtime.manager_state import init_manager

        init_manager(session.manager, init)
    if strategy.hindsight:
        if hindsight_G is None:
            raise MoecacheError(f"validate {strategy.name}: no hindsight placement for this workload")
        install_hindsight(session.manager, hindsight_G)


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


WARMUP_TOKENS = 2  # tokens of each untimed warm-up generation (_warm_up)


def _warm_up(model, w, strategies, grid, requests, count_G, s: Settings, run) -> None:
    """Before a workload's timed runs (validate.warmup; auto: on CUDA): one untimed generation of its first request
    (WARMUP_TOKENS tokens, in a decoder as long as the timed runs' `requests` need: a decoder's length is
    a shape its first step compiles for) per strategy at its first capacity, traces thrown away. The process's
    first-call costs (what the first call at a new shape compiles or fills: Triton's operator, cuBLAS,
    the allocator; which of them was not measured) belong to no run; the first run would carry them (on the H200, the
    DeepSeek-V2-Lite shape: the first run's time to first token 344 ms without the warm-up, 64 with). Each
    timed run then starts from a cold cache of its own (_configure)."""
    import tempfile

    label, arch, pad_id, num_keys = run
    first = requests[0]
    warm = Request(first.request_id, first.prompt_ids, WARMUP_TOKENS)
    cache_len = cache_length(requests, _new_tokens(w, s))
    with tempfile.TemporaryDirectory(prefix="moecache-warmup-") as tmp:
        for n, strategy in enumerate(strategies):
            fixed = strategy.fixed_capacity
            capacity, slots = (fixed, num_keys if fixed == "all" else 0) if fixed else grid[0]
            _configure(
                model,
                strategy,
                slots,
                hindsight_keys(count_G, slots) if strategy.hindsight else None,
                s.profile,
            )
            spec = RunSpec(w.name, strategy, capacity, slots)
            measure(
                model, spec, [warm], loop=s.loop, device=s.device, max_new_tokens=WARMUP_TOKENS,
                pad_id=pad_id, trace_dir=Path(tmp) / str(n), meta=_meta(label, arch, w.name, spec, s),
                run_id=s.run_id, forced=w.forced, cache_len=cache_len,
            )  # fmt: skip


def _new_tokens(w: Workload, s: Settings) -> int:
    """Tokens generated per request of a conf/workload/ workload (a forced request has its own)."""
    return int(s.max_new_tokens or (w.wcfg.max_new_tokens if w.wcfg is not None else 1))


def _agreement_set(model, w: Workload, s: Settings, tokenizer, num_experts: int):
    """The workload's agreement inputs on the unmodified model (agreement_runs.prepare): its first
    validate.agreement_requests requests, each continued by validate.agreement_tokens tokens (None: what
    its runs route after the prompt)."""
    answers = Outputs()
    n = s.agreement_requests
    if w.forced is not None:
        requests = w.forced.requests[:n]
        runs_route = {r.request_id: int(r.max_new_tokens) - 1 for r in requests}
        forced, name = w.forced.forced, w.forced.name
    else:
        requests = request_stream(w.wcfg, s.seed, tokenizer, n, answers, [])
        runs_route = None
        forced = name = None
    made = _new_tokens(w, s) - 1

    def tokens_of(req: Request) -> int:
        if s.agreement_tokens is not None:
            return s.agreement_tokens
        return runs_route[req.request_id] if runs_route is not None else made

    return agreement_runs.prepare(
        model, w.name, requests, answers, tokens_of, forced=forced, forced_name=name,
        num_experts=num_experts, impls=tuple(s.agreement_impls), float32=s.agreement_float32,
    )  # fmt: skip


def _progress(row: dict, seconds: float, repeat: str = "") -> None:
    """One line on stderr per finished run: a validate of many runs takes minutes."""
    hit = row.get("hit_rate")
    print(
        f"validate: {row['workload']} {row['strategy']} {row['capacity'] or ''}{repeat}: "
        f"{row['time_per_token_ms']:.2f} ms/token, hit rate {'-' if hit is None else f'{hit:.3f}'} "
        f"({seconds:.1f} s)",
        file=sys.stderr, flush=True,
    )  # fmt: skip


def validate_all(
    loaded, arch: dict, workloads: list[Workload], strategies: list[Strategy], grid: list[tuple[str, int]],
    s: Settings,
) -> Validated:  # fmt: skip
    """Every run (module docstring); the rows workload by workload, the reference first, then the
    strategies in order, each at its capacities."""
    from moecache.offloading import offload_model
    from moecache.sim.policies.lfu import key_counts
    from moecache.sim.trace_arrays import load_trace

    if s.reference not in REFERENCES:
        raise MoecacheError(f"validate.reference={s.reference!r}: expected one of {', '.join(REFERENCES)}")
    model, label = loaded.model, loaded.path.name
    tokenizer = loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    num_keys = arch["num_layers"] * arch["num_experts"]
    rows_of: dict[str, list[dict]] = {w.name: [] for w in workloads}
    predicted_of: dict[str, list[anchors.Predicted]] = {w.name: [] for w in workloads}
    latencies: list[dict] = []
    agreement: list[dict] = []
    sets: dict[str, agreement_runs.AgreementSet] = {}

    def timed(w: Workload, spec: RunSpec, requests, outputs=None, repeat: int = 0):
        """One timed run (its trace under traces/, a repeat's beside the first's); (outcome, trace,
        row). After a strategy's first repeat, its output agreement on the cache the run left."""
        start = time.perf_counter()
        probed = s.run_probe() if s.run_probe is not None and spec.strategy is not None else None
        name = "unmodified" if spec.strategy is None else f"{spec.label}-c{spec.slots}"
        trace_dir = s.folder / "traces" / w.name / (name if repeat == 0 else f"{name}-r{repeat}")
        outcome = measure(
            model, spec, requests, loop=s.loop, device=s.device, max_new_tokens=_new_tokens(w, s),
            pad_id=pad_id, trace_dir=trace_dir, meta=_meta(label, arch, w.name, spec, s), run_id=s.run_id,
            outputs=outputs, forced=w.forced,
        )  # fmt: skip
        trace = trace_dir / "trace.parquet"
        row = {**outcome.row, "trace": str(trace.relative_to(s.folder)), "cpu_probe_change_pct": probed}
        if spec.strategy is not None and repeat == 0 and w.name in sets:
            agreement.append(agreement_runs.run_row(model, sets[w.name], spec))
        shown = (
            f" (repeat {repeat + 1} of {s.repeats})" if spec.strategy is not None and s.repeats > 1 else ""
        )
        _progress(row, time.perf_counter() - start, shown)
        return outcome, trace, row

    def record(w: Workload, spec: RunSpec, got, is_reference: bool, repeated: list[dict]) -> None:
        """A run's row (the kept repeat's `got`, with every repeat's time and hit rate from the rows
        `repeated`, in run order), predicted on the profile."""
        outcome, trace, row = got
        row["time_per_token_ms_repeats"] = [r["time_per_token_ms"] for r in repeated]
        row["hit_rate_repeats"] = [r["hit_rate"] for r in repeated]
        if spec.strategy is None:
            row.update(predict.EMPTY)
        else:
            run = anchors.Predicted(row, trace, spec.strategy.sim_policy, spec.slots, spec.strategy.on_miss)
            row.update(run.predict(s.profile))
            predicted_of[w.name].append(run)
        row["reference"] = is_reference
        rows_of[w.name].append(row)
        latencies.extend(outcome.latencies)

    def one(w: Workload, spec: RunSpec, requests, is_reference: bool, outputs=None):
        """A run measured once (the references)."""
        got = timed(w, spec, requests, outputs)
        record(w, spec, got, is_reference, [got[2]])
        return got[0], got[1]

    def requests_of(w: Workload, answers: Outputs, made: list[Request]):
        if w.forced is not None:
            made.extend(w.forced.requests)
            return list(w.forced.requests)
        return request_stream(w.wcfg, s.seed, tokenizer, s.limit, answers, made)

    # 1. the references, before anything is offloaded
    # per workload: its requests, the reference's key counts
    refs: dict[str, tuple[list[Request], object]] = {}
    if s.reference == "unmodified":
        for w in workloads:
            made: list[Request] = []
            answers = Outputs()
            outcome, trace = one(w, RunSpec(w.name, None, None, None), requests_of(w, answers, made), True,
                                 outputs=answers)  # fmt: skip
            refs[w.name] = (made, key_counts(load_trace(trace)))
    # 2. output agreement's baseline and tolerance, on the unmodified model
    if s.agreement_requests:
        for w in workloads:
            sets[w.name] = _agreement_set(model, w, s, tokenizer, arch["num_experts"])
            agreement += agreement_runs.tolerance_rows(sets[w.name])
    # 3. offloaded once (no expert left in the model: drop every other reference to them first)
    loaded.adapter = None
    _release()
    # every miss on the CPU: the simulator prices a prompt's misses there (it does not model streamed ones)
    offload_model(model, capacity=0, policy="static_cold", device=s.device, stream_min_tokens=0)
    run = (label, arch, pad_id, num_keys)
    for w in workloads:
        warm = list(strategies)
        if s.reference == "all_resident":
            first = next(x for x in strategies if x.name == "all_resident")
            if s.warmup:  # the reference is a timed run too: its warm-up comes before it, not after
                peek: list[Request] = []
                next(iter(requests_of(w, Outputs(), peek)), None)  # the first request needs no answer
                if peek:
                    _warm_up(model, w, [first], grid, peek, None, s, run)
                    warm.remove(first)
            made, answers = [], Outputs()
            _configure(model, first, num_keys, None)
            outcome, trace = one(w, RunSpec(w.name, first, "all", num_keys), requests_of(w, answers, made),
                                 True, outputs=answers)  # fmt: skip
            refs[w.name] = (made, key_counts(load_trace(trace)))
        made, count_G = refs[w.name]
        if s.warmup and made and warm:
            _warm_up(model, w, warm, grid, made, count_G, s, run)
        plan = []  # the workload's offloaded runs: (strategy, capacity, slots), in the rows' order
        for strategy in strategies:
            if s.reference == "all_resident" and strategy.name == "all_resident":
                continue  # it ran first, as the reference
            fixed = strategy.fixed_capacity
            points = [(fixed, num_keys if fixed == "all" else 0)] if fixed else grid
            plan += [(strategy, capacity, slots) for capacity, slots in points]
        got_of: list[list] = [[] for _ in plan]
        for r, i, (strategy, capacity, slots) in repeats.rounds(plan, s.repeats):
            hindsight = hindsight_keys(count_G, slots) if strategy.hindsight else None
            _configure(model, strategy, slots, hindsight, s.profile, s.init)
            got_of[i].append(timed(w, RunSpec(w.name, strategy, capacity, slots), made, repeat=r))
        for (strategy, capacity, slots), got in zip(plan, got_of, strict=True):
            rows = [row for _, _, row in got]
            kept = repeats.kept([row["time_per_token_ms"] for row in rows])
            record(w, RunSpec(w.name, strategy, capacity, slots), got[kept], False, rows)
        _release()
    # 4. the second prediction on each workload's own anchors, and the held-out one on the others'
    fidelity = holdout.anchored_rows(predicted_of, s.profile, s.folder)
    return Validated(
        rows=[r for w in workloads for r in rows_of[w.name]], latencies=latencies, agreement=agreement,
        agreement_of={name: agreement_runs.summary(aset, agreement) for name, aset in sets.items()},
        fidelity=fidelity,
    )  # fmt: skip
