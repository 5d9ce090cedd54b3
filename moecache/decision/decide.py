"""Apply the pre-registered rule (rule.py) to a sweep: a verdict per (trace, capacity, label) and the
selected policy.

Legend: N per_block rows, P labels of one cell (the baseline first), U bootstrap units of one cell.

Steps (docs/decision.md, "First part"):
1. Keep the sweep rows and blocks of `rule.mode` at the base cost scales (every scale == 1.0).
2. Find the labels of the baseline and of the candidates: the label of the sweep rows whose policy
   (name, params) equals theirs (moecache/sim/policy_spec.py: parameters compared with the defaults
   filled in, so `lfu {}` is `lfu {reset_per_request: false}`).
3. For each cell (trace, capacity) where the baseline was swept: the units are the trace's requests (the
   blocks of a request summed) when it has at least `bootstrap.min_requests` of them, else its blocks; one
   paired bootstrap (bootstrap.py) over every label of the cell gives r = metric / baseline metric - 1 and
   its interval; the metric is sum est_us / 1000 / sum tokens (ms per token). The seed of a cell is derived
   from rule.seed, the trace name and the capacity only, so a cell's result does not depend on which
   other traces or capacities were swept.
4. Limits of every label: hit_rate >= baseline hit_rate - max_deficit; bytes_per_token = h2d_bytes / tokens
   <= max_bytes_per_token (when set); link_busy = transfers x copy_us[trace] / sum est_us <= max_link_busy
   (when set). A cell is in the useful range when the baseline's hit rate (sweep.parquet) lies in
   useful_range.baseline_hit_rate, both ends included.
5. A candidate is competitive iff every useful cell of every trace has it swept, a competitive verdict
   (better | equivalent | non_inferior) and passing limits, at least one cell is useful, and every
   required workload has a trace with a useful cell. The first competitive candidate is selected,
   otherwise the baseline.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moecache.analysis.schema import BOOL, F64, I64, STR, schema
from moecache.decision.bootstrap import paired_ratio_bootstrap
from moecache.decision.rule import COMPETITIVE, METRICS, MIN_UNITS, Rule, classify
from moecache.errors import MoecacheError
from moecache.sim.policy_spec import PolicySpec
from moecache.sim.sweep import SCALES, base_rows

SWEEP_COLUMNS = ("trace", "workload", "policy", "params", "label", "mode", "capacity", *SCALES, "hit_rate")
BLOCK_COLUMNS = (
    "trace",
    "label",
    "mode",
    "capacity",
    *SCALES,
    "request",
    "block",
    "tokens",
    "transfers",
    "h2d_bytes",
    "est_us",
)


def comparison_columns(reference: str) -> dict[str, pa.DataType]:
    """The columns of one paired comparison of a label with a reference, whose metric is the column
    `<reference>_metric`: the bootstrap unit and the number of units, the label's metric and the
    reference's, the relative difference and its confidence interval, the verdict."""
    return {
        "unit": STR,
        "units": I64,
        "metric": F64,
        f"{reference}_metric": F64,
        "rel_diff": F64,
        "ci_lo": F64,
        "ci_hi": F64,
        "verdict": STR,
    }


VERDICT_SCHEMA = schema(
    trace=STR, workload=STR, capacity=I64, label=STR, role=STR,
    **comparison_columns("baseline"),
    competitive=BOOL, hit_rate=F64, baseline_hit_rate=F64, bytes_per_token=F64, link_busy=F64,
    passes_limits=BOOL, reasons=STR, in_useful_range=BOOL,
)  # fmt: skip


def _require_columns(table: pa.Table, columns, name: str) -> None:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise MoecacheError(f"{name}: missing column(s) {missing}")


def policy_labels(rows: list[dict]) -> dict[str, PolicySpec]:
    """The policy (name, params) of every label of the sweep rows. A label is only a join key (into
    per_block.parquet); one label with two policies, or one policy under two labels, is an error."""
    spec_of: dict[str, PolicySpec] = {}
    label_of: dict[PolicySpec, str] = {}
    for r in rows:
        spec = PolicySpec.from_row(r, f"sweep.parquet (label {r['label']!r})")
        if spec_of.setdefault(r["label"], spec) != spec:
            raise MoecacheError(
                f"sweep.parquet: label {r['label']!r} names two policies:"
                f" {spec_of[r['label']].describe()} and {spec.describe()}"
            )
        if label_of.setdefault(spec, r["label"]) != r["label"]:
            raise MoecacheError(
                f"sweep.parquet: policy {spec.describe()} has two labels {label_of[spec]!r} and {r['label']!r}"
            )
    return spec_of


def _label_of(spec_of: dict[str, PolicySpec], ref: PolicySpec, key: str, mode: str) -> str:
    labels = [label for label, spec in spec_of.items() if spec == ref]
    if not labels:
        swept = sorted(spec.describe() for spec in spec_of.values())
        raise MoecacheError(
            f"decide.{key}: {ref.describe()} is not in the sweep (mode {mode}, base scales); swept: {swept}"
        )
    return labels[0]


def cell_seed(seed: int, trace: str, capacity: int) -> np.random.SeedSequence:
    """The bootstrap seed of a cell: from the rule's seed, the trace name and the capacity only."""
    name = int.from_bytes(hashlib.sha256(trace.encode()).digest()[:8], "little")
    return np.random.SeedSequence([int(seed), name, int(capacity)])


class BlockIndex:
    """The per_block rows of the mode at base scales, sorted by (trace, capacity, label, request, block),
    with the row range of every (trace, capacity, label)."""

    def __init__(self, blocks: pa.Table, labels: set[str], mode: str):
        blocks = base_rows(blocks, mode)
        blocks = blocks.filter(pc.is_in(blocks["label"], value_set=pa.array(sorted(labels), pa.string())))
        nulls = blocks.filter(pc.is_null(blocks["est_us"]))
        if nulls.num_rows:
            r = nulls.slice(0, 1).to_pylist()[0]
            raise MoecacheError(
                f"per_block.parquet: est_us is null for trace {r['trace']!r} label {r['label']!r} (mode {mode}):"
                " the decision's metric est_ms_per_token needs estimated times (a cost model)"
            )
        blocks = blocks.sort_by(
            [(c, "ascending") for c in ("trace", "capacity", "label", "request", "block")]
        )
        col = {c: blocks[c].to_numpy(zero_copy_only=False) for c in BLOCK_COLUMNS if c != "mode"}
        self.request_N = col["request"].astype(np.int64)
        self.block_N = col["block"].astype(np.int64)
        self.tokens_N = col["tokens"].astype(np.float64)
        self.est_us_N = col["est_us"].astype(np.float64)
        self.transfers_N = col["transfers"].astype(np.float64)
        self.h2d_N = col["h2d_bytes"].astype(np.float64)
        trace_N, cap_N, label_N = col["trace"], col["capacity"].astype(np.int64), col["label"]
        n = len(trace_N)
        change = (trace_N[1:] != trace_N[:-1]) | (cap_N[1:] != cap_N[:-1]) | (label_N[1:] != label_N[:-1])
        starts = np.flatnonzero(np.r_[True, change]) if n else np.zeros(0, np.int64)
        stops = np.r_[starts[1:], n] if n else np.zeros(0, np.int64)
        self.groups = {
            (str(trace_N[a]), int(cap_N[a]), str(label_N[a])): slice(int(a), int(b))
            for a, b in zip(starts, stops, strict=True)
        }

    def get(self, trace: str, capacity: int, label: str) -> slice:
        sl = self.groups.get((trace, capacity, label))
        if sl is None:
            raise MoecacheError(
                f"per_block.parquet: no blocks for trace {trace!r} label {label!r} capacity {capacity}"
                " although sweep.parquet has the row"
            )
        return sl


def _fmt(x: float | None, spec: str) -> str:
    return "undefined" if x is None else format(x, spec)


def finite_or_none(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _limits(rule: Rule, hit, base_hit, bytes_per_token, link_busy) -> list[str]:
    """Every failed limit of one label in one cell, in words."""
    out = []
    deficit = rule.max_hit_rate_deficit
    if base_hit is not None:
        if hit is None:
            out.append("hit_rate undefined")
        elif hit < base_hit - deficit:
            out.append(f"hit_rate {hit:.3f} < baseline {base_hit:.3f} - {deficit:g}")
    bound = rule.transfers.max_bytes_per_token
    if bound is not None and bytes_per_token is not None and bytes_per_token > bound:
        out.append(f"bytes_per_token {bytes_per_token:.4g} > {bound:.4g}")
    bound = rule.transfers.max_link_busy
    if bound is not None and link_busy is not None and link_busy > bound:
        out.append(f"link_busy {link_busy:.3f} > {bound:g}")
    return out


def _cell(
    rule: Rule,
    trace: str,
    workload: str,
    capacity: int,
    row_of: dict[str, dict],
    labels: list[str],
    roles: dict[str, str],
    blocks: BlockIndex,
    copy_us: float | None,
) -> list[dict]:
    """The verdict rows of one cell: every swept label but the baseline (labels[0])."""
    labels = [x for x in labels if x in row_of]
    slices = [blocks.get(trace, capacity, x) for x in labels]
    req_U, blk_U = blocks.request_N[slices[0]], blocks.block_N[slices[0]]
    for label, sl in zip(labels[1:], slices[1:], strict=True):
        if not (np.array_equal(blocks.request_N[sl], req_U) and np.array_equal(blocks.block_N[sl], blk_U)):
            raise MoecacheError(
                f"per_block.parquet: trace {trace!r} capacity {capacity}: the blocks of label {label!r}"
                f" are not those of the baseline {labels[0]!r}"
            )
    starts = np.flatnonzero(np.r_[True, req_U[1:] != req_U[:-1]])
    by_request = len(starts) >= rule.bootstrap.min_requests
    agg = (lambda x: np.add.reduceat(x, starts)) if by_request else (lambda x: x)
    num_PU = np.stack([agg(blocks.est_us_N[sl]) for sl in slices])
    den_PU = np.stack([agg(blocks.tokens_N[sl]) for sl in slices])
    units = num_PU.shape[1]
    rel_P, lo_P, hi_P = paired_ratio_bootstrap(
        num_PU,
        den_PU,
        baseline=0,
        resamples=rule.bootstrap.resamples,
        seed=cell_seed(rule.seed, trace, capacity),
        confidence=rule.confidence,
    )
    est_P, tokens_P = num_PU.sum(axis=1), den_PU.sum(axis=1)
    metric_P = [est / 1e3 / tok if tok > 0 else None for est, tok in zip(est_P, tokens_P, strict=True)]
    base_hit = finite_or_none(row_of[labels[0]]["hit_rate"])
    useful = rule.in_useful_range(base_hit)

    out = []
    for p in range(1, len(labels)):
        sl = slices[p]
        tokens, est = tokens_P[p], est_P[p]
        transfers, h2d = blocks.transfers_N[sl].sum(), blocks.h2d_N[sl].sum()
        bytes_per_token = h2d / tokens if tokens > 0 else None
        link_busy = transfers * copy_us / est if copy_us is not None and est > 0 else None
        hit = finite_or_none(row_of[labels[p]]["hit_rate"])
        rel, lo, hi = finite_or_none(rel_P[p]), finite_or_none(lo_P[p]), finite_or_none(hi_P[p])
        failed = _limits(rule, hit, base_hit, bytes_per_token, link_busy)
        if units < MIN_UNITS:
            verdict, notes = "inconclusive", [f"fewer than {MIN_UNITS} units"]
        else:
            verdict, notes = classify(lo, hi, rule.margin), []
        out.append(
            {
                "trace": trace,
                "workload": workload,
                "capacity": capacity,
                "label": labels[p],
                "role": roles.get(labels[p], "other"),
                "unit": "request" if by_request else "block",
                "units": units,
                "metric": metric_P[p],
                "baseline_metric": metric_P[0],
                "rel_diff": rel,
                "ci_lo": lo,
                "ci_hi": hi,
                "verdict": verdict,
                "competitive": verdict in COMPETITIVE,
                "hit_rate": hit,
                "baseline_hit_rate": base_hit,
                "bytes_per_token": finite_or_none(bytes_per_token),
                "link_busy": finite_or_none(link_busy),
                "passes_limits": not failed,
                "reasons": "; ".join(notes + failed),
                "in_useful_range": useful,
            }
        )
    return out


def _copy_us(rule: Rule, copy_us: dict[str, float], trace: str) -> float | None:
    if trace not in copy_us:
        if rule.transfers.max_link_busy is not None:
            raise MoecacheError(
                f"copy_us: no copy time for trace {trace!r} (needed by decide.transfers.max_link_busy)"
            )
        return None
    x = copy_us[trace]
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
        raise MoecacheError(f"copy_us[{trace!r}]={x!r}: must be a non-negative number of microseconds")
    return float(x)


def _cell_failure(label: str, v: dict) -> str | None:
    """Why one useful cell keeps the candidate from being competitive (None: it does not)."""
    where = f"{v['trace']} C={v['capacity']}"
    if not v["competitive"]:
        if v["units"] < MIN_UNITS:
            return f"{label}: inconclusive at {where} (fewer than {MIN_UNITS} units)"
        if v["rel_diff"] is None or v["ci_lo"] is None or v["ci_hi"] is None:
            return f"{label}: {v['verdict']} at {where} (relative difference undefined)"
        return (
            f"{label}: {v['verdict']} at {where} (r={v['rel_diff']:+.3f},"
            f" CI [{v['ci_lo']:+.3f}, {v['ci_hi']:+.3f}])"
        )
    if not v["passes_limits"]:
        return f"{label}: fails limits at {where} ({v['reasons']})"
    return None


def decide(sweep: pa.Table, blocks: pa.Table, rule: Rule, copy_us: dict[str, float]) -> tuple[pa.Table, dict]:
    """(verdicts table, decision dict) of the rule on a sweep (sweep.parquet, per_block.parquet);
    copy_us: the time of one expert copy per trace name (for link_busy)."""
    if rule.metric not in METRICS:
        raise MoecacheError(f"decide.metric={rule.metric!r}: expected one of {list(METRICS)}")
    _require_columns(sweep, SWEEP_COLUMNS, "sweep.parquet")
    _require_columns(blocks, BLOCK_COLUMNS, "per_block.parquet")
    rows = base_rows(sweep, rule.mode).to_pylist()
    if not rows:
        raise MoecacheError(f"sweep.parquet: no row in mode {rule.mode!r} at base cost scales (all 1.0)")
    spec_of = policy_labels(rows)
    base = _label_of(spec_of, rule.baseline, "baseline", rule.mode)
    cands = [_label_of(spec_of, c, f"candidates[{i}]", rule.mode) for i, c in enumerate(rule.candidates)]
    roles = {c: "candidate" for c in cands}

    workload_of: dict[str, str] = {}
    cells: dict[str, dict[int, dict[str, dict]]] = {}
    for r in rows:
        workload_of.setdefault(r["trace"], r["workload"])
        row_of = cells.setdefault(r["trace"], {}).setdefault(int(r["capacity"]), {})
        if r["label"] in row_of:
            raise MoecacheError(
                f"sweep.parquet: two rows for trace {r['trace']!r} label {r['label']!r}"
                f" capacity {r['capacity']} (mode {rule.mode}, base scales)"
            )
        row_of[r["label"]] = r
    swept_labels = {r["label"] for r in rows}
    block_index = BlockIndex(blocks, swept_labels, rule.mode)
    others = sorted(swept_labels - {base, *cands})

    notes: list[str] = []
    verdicts: list[dict] = []
    for trace, by_capacity in cells.items():
        if not any(base in row_of for row_of in by_capacity.values()):
            notes.append(f"trace {trace}: the baseline {base} was not swept; trace left out")
            continue
        copy = _copy_us(rule, copy_us, trace)
        for capacity in sorted(by_capacity):
            row_of = by_capacity[capacity]
            if base not in row_of:
                continue
            verdicts += _cell(
                rule,
                trace,
                workload_of[trace],
                capacity,
                row_of,
                [base, *cands, *others],
                roles,
                block_index,
                copy,
            )
    table = pa.Table.from_pylist(verdicts, schema=VERDICT_SCHEMA)
    return table, _decision(rule, base, cands, cells, workload_of, verdicts, notes)


def _decision(rule, base, cands, cells, workload_of, verdicts, notes) -> dict:
    lo, hi = rule.useful_range
    useful_cells = sorted(
        {
            (t, c)
            for t, by_capacity in cells.items()
            for c, row_of in by_capacity.items()
            if base in row_of and rule.in_useful_range(finite_or_none(row_of[base]["hit_rate"]))
        }
    )
    useful_traces = {t for t, _ in useful_cells}
    swept = list(dict.fromkeys(workload_of.values()))
    present = [w for w in swept if any(workload_of[t] == w for t in useful_traces)]
    required = list(rule.required_workloads) if rule.required_workloads is not None else present

    reasons = list(notes)
    blocked = False
    if not useful_cells:
        reasons.append(
            f"no (trace, capacity) cell has the baseline hit rate in [{lo:g}, {hi:g}]: nothing is competitive"
        )
        blocked = True
    for w in required:
        if w not in present:
            blocked = True
            if w not in swept:
                reasons.append(f"workload {w}: no trace")
            else:
                reasons.append(f"workload {w}: no capacity with the baseline hit rate in [{lo:g}, {hi:g}]")

    competitive: dict[str, bool] = {}
    by_key = {(v["trace"], v["capacity"], v["label"]): v for v in verdicts}
    for label in cands:
        failures = []
        counts: dict[str, int] = {}
        for t, c in useful_cells:
            v = by_key.get((t, c, label))
            if v is None:
                failures.append(f"{label}: not swept at {t} C={c}")
                continue
            counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
            why = _cell_failure(label, v)
            if why is not None:
                failures.append(why)
        competitive[label] = not failures and not blocked
        reasons += failures
        if competitive[label]:
            tally = ", ".join(
                f"{k} {counts[k]}" for k in ("better", "equivalent", "non_inferior") if k in counts
            )
            reasons.append(
                f"{label}: competitive in all {len(useful_cells)} useful cells ({tally}) over workloads {present}"
            )

    chosen = next((i for i, c in enumerate(cands) if competitive[c]), None)
    if chosen is None:
        selected = {**rule.baseline.to_dict(), "label": base}
        reasons.append(f"no candidate is competitive: keeping the baseline {base}")
    else:
        selected = {**rule.candidates[chosen].to_dict(), "label": cands[chosen]}
        reasons.append(f"selected {cands[chosen]}: the first competitive candidate")
    return {
        "selected": selected,
        "baseline": {**rule.baseline.to_dict(), "label": base},
        "competitive": competitive,
        "reasons": reasons,
        "rule": rule.to_dict(),
        "workloads": {"present": present, "required": required, "swept": swept},
        "cells": len(useful_cells),
        "seed": rule.seed,
    }
