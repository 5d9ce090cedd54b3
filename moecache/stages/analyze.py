"""`moecache analyze`: offline sequence analysis of routing traces (docs/analysis.md).

Reads the traces of `traces` (empty: every trace artifact) and writes one artifact with a Parquet table
per statistic (every table has a `trace` column) and `summary.json` (headline figures per trace):
frequency and concentration, drift between and within requests, convergence of the cumulative ranking,
reuse distances and run lengths, achievable LRU / LFU / Belady hit rates, same-layer and adjacent-layer
transitions with mutual information and next-token predictors, router weight against reuse, the
history-length selection on a prefix judged on held-out data, and the prediction signals: inter-layer
prefetch accuracy against lead time (layers and microseconds under `sim.cost_profile`) and, on traces
collected with `logging.logit_lens.rate > 0`, what the logit-lens token adds over expert correlation.

Every trace that `read_trace` accepts is analysed. The token-level statistics need every MoE layer of a
token, so they use the complete tokens only (moecache/analysis/tokens.py); `tokens` counts those, and
`tokens_left_out` / `requests_left_out` in summary.json (and the stderr summary) count the rest. The
simulator's statistics (hit rates, history length) replay every row.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import DictConfig
from rich.console import Console

from moecache.analysis import (
    drift,
    frequency,
    history,
    hit_rates,
    locality,
    router_weight,
    signals,
    transitions,
)
from moecache.analysis.tokens import TokenTrace, load_token_trace
from moecache.artifacts import artifact_id
from moecache.errors import MoecacheError
from moecache.sim.inputs import load_profile, resolve_traces
from moecache.sim.sweep import capacity_grid, cost_model
from moecache.sim.trace_arrays import TraceArrays, load_trace
from moecache.stages.base import StageResult, prepare, profile_digest, reusable, store_for
from moecache.stages.simulate import cost_settings

STAGE = "analyze"
SCHEMA_VERSION = 1


def _per_token(tt: TokenTrace, multiples: list[float]) -> list[int]:
    per = tt.num_layers * tt.top_k
    keys = tt.num_layers * tt.num_experts
    return sorted({min(keys, max(1, int(round(m * per)))) for m in multiples})


def layer_us(trace: TraceArrays, cost) -> float:
    """The shortest time one MoE layer can take under the cost model: non-expert time plus its top_k
    experts each on the GPU for one token. A prefetch issued when layer n routes has at least d times
    this long before layer n + d routes."""
    return float(cost.non_expert_us_per_layer + trace.top_k * cost.gpu_table()[1])


def _token_statistics(tt: TokenTrace, a: dict, seed: int, lead_us: float) -> tuple[dict[str, pa.Table], dict]:
    """The token-level statistics of one trace: {file stem: table}, merged summary figures."""
    tables: dict[str, pa.Table] = {}
    figures: dict = {
        "tokens": tt.num_tokens,
        "requests": tt.num_requests,
        "tokens_left_out": tt.tokens_left_out,
        "requests_left_out": tt.requests_left_out,
        "workload": tt.workload,
    }
    steps: list[tuple[str, Callable[[], object]]] = [
        ("frequency", lambda: frequency.frequency_table(tt)),
        ("concentration", lambda: frequency.concentration_table(tt, [float(f) for f in a["coverage"]])),
        ("request_drift", lambda: drift.request_drift_table(tt)),
        ("window_drift", lambda: drift.window_drift_table(tt, int(a["window_tokens"]), seed)),
        (
            "convergence",
            lambda: drift.convergence_table(tt, _per_token(tt, a["convergence_per_token_multiples"])),
        ),
        ("reuse", lambda: locality.reuse_table(tt)),
        ("runs", lambda: locality.run_table(tt)),
        ("token_transitions", lambda: transitions.token_transition_table(tt)),
        ("layer_transitions", lambda: transitions.layer_transition_table(tt)),
        ("layer_mi", lambda: transitions.layer_mi_table(tt, seed)),
        ("predictors", lambda: transitions.predictor_table(tt)),
        ("recurrence", lambda: transitions.recurrence_table(tt)),
        ("router_weight", lambda: router_weight.router_weight_table(tt)),
        ("prefetch_lead", lambda: signals.lead_table(tt, int(a["max_lead_layers"]), lead_us)),
        ("token_signal", lambda: signals.token_signal_table(tt, seed)),
    ]
    for stem, compute in steps:
        out = compute()
        table, summary = out if isinstance(out, tuple) else (out, {})
        tables[stem] = table
        clash = sorted(set(summary) & set(figures))
        if clash:  # every statistic names its own figures: one must not overwrite another's
            raise MoecacheError(f"analyze {stem}: summary key(s) {clash} already set by another statistic")
        figures.update(summary)
    return tables, figures


def run(cfg: DictConfig) -> StageResult:
    c = prepare(cfg, STAGE)
    a = c["analyze"]
    seed = int(c["seed"])
    store = store_for(cfg)
    refs = resolve_traces(store, c["traces"])
    profile_ref, profile = load_profile(store, c["sim"]["cost_profile"])
    inputs = [r.ref for r in refs] + ([profile_ref] if profile_ref.startswith("calibrate-") else [])
    config = {
        "analyze": a,
        "traces": inputs,
        "seed": seed,
        "sim": c["sim"],
        "cost_profile_sha256": profile_digest(profile_ref),
    }
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs)
    if existing is not None:
        return StageResult(
            existing, reused=True, summary=_headline(json.loads((existing / "summary.json").read_text()))
        )

    candidates = history.candidates_from(a["history"]["candidates"])
    console = Console(stderr=True)
    parts: dict[str, list[pa.Table]] = {}
    summary: dict[str, dict] = {}
    arrays: list[TraceArrays] = []
    for r in refs:
        with console.status(f"analyze {r.name}"):
            tt = load_token_trace(r.path, name=r.name, workload=r.workload)
            trace = load_trace(r.path, name=r.name, workload=r.workload)
            cost = cost_model(trace, profile, cost_settings(c["sim"]))
            tables, figures = _token_statistics(tt, a, seed, layer_us(trace, cost))
            figures["copy_us"] = cost.copy_us()
            arrays.append(trace)
            tables["hit_rates"] = hit_rates.hit_rate_table(trace, capacity_grid(trace, **a["capacities"]))
        for stem, table in tables.items():
            parts.setdefault(stem, []).append(table)
        summary[r.name] = figures
    with console.status("analyze: history length"):
        table, figures = history.history_table(
            arrays, candidates, a["history"]["per_token_multiples"], float(a["history"]["prefix_fraction"])
        )
    parts["history"] = [table]
    for name, values in figures.items():
        summary[name].update(values)

    with store.create(STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=inputs, seed=seed) as tmp:
        for stem, tables in parts.items():
            pq.write_table(pa.concat_tables(tables, promote_options="default"), tmp / f"{stem}.parquet")
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return StageResult(
        store.get(artifact_id(STAGE, SCHEMA_VERSION, config, inputs)).path, summary=_headline(summary)
    )


HEADLINE = (
    ("tokens_left_out", "incomplete tokens left out"),
    ("global_cover_80", "keys for 80% of selections"),
    ("reuse_share_1", "reuses at distance 1"),
    ("recall_lag1", "next-token recall, lag-1 transitions"),
    ("recall_lead_1", "next-layer recall, layer transitions"),
    ("history_selected", "history length chosen on the prefix"),
)


def _headline(summary: dict) -> dict:
    out = {}
    for trace, figures in summary.items():
        out[trace] = ", ".join(f"{label}: {_fmt(figures.get(key))}" for key, label in HEADLINE)
    return out


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "n/a" if value is None else str(value)
