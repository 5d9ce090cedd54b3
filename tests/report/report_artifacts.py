"""Test helper for tests/report: a small synthetic artifact set (analysis, sweep, decision folders)
written with the spec's columns.

Two traces (names with "/"), four labels (static_hindsight, lfu, lru, belady(bypass=True,warm=True)),
capacities 0, 2, 4, 8 slots, 2 layers x 4 experts; both replay modes plus one sensitivity row at
bandwidth_scale 2.0; per-layer rows; an analysis with every file the report draws and a summary.json; a
decision with verdicts for the candidate (lfu) and one other label (lru).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from moecache.config import compose, to_container
from moecache.decision.extensions import SCHEMA as EXTENSIONS_SCHEMA
from moecache.stages.decide import rule_config

TRACES = {"tiny/multi_request/seed0": "multi_request", "tiny/long_single/seed0": "long_single"}
LABELS = {  # label -> (policy, params JSON, hit rate per slot of capacity)
    "static_hindsight": ("static_hindsight", "{}", 0.11),
    "lfu": ("lfu", "{}", 0.10),
    "lru": ("lru", "{}", 0.08),
    "belady(bypass=True,warm=True)": ("belady", '{"bypass": true, "warm": true}', 0.125),
}
CAPACITIES = (0, 2, 4, 8)
TP = "transition_prefetch(budget=2,min_probability=0.1,top=8)"
LAYERS, EXPERTS = 2, 4


def hit_rate(label: str, capacity: int) -> float:
    return min(1.0, LABELS[label][2] * capacity)


def sweep_rows() -> list[dict]:
    rows = []
    for trace, workload in TRACES.items():
        for label, (policy, params, _) in LABELS.items():
            for mode in ("instant", "timed"):
                for capacity in CAPACITIES:
                    for bw in (1.0, 2.0) if mode == "timed" and label == "lfu" else (1.0,):
                        h = hit_rate(label, capacity)
                        ms = None if mode == "instant" else round(2.0 - h, 6) / bw
                        rows.append(
                            {
                                "trace": trace,
                                "workload": workload,
                                "policy": policy,
                                "params": params,
                                "label": label,
                                "mode": mode,
                                "capacity": capacity,
                                "capacity_fraction": capacity / (LAYERS * EXPERTS),
                                "bandwidth_scale": bw,
                                "cpu_scale": 1.0,
                                "gpu_scale": 1.0,
                                "accesses": 100,
                                "selections": 120,
                                "tokens": 60,
                                "hit_rate": h,
                                "token_hit_rate": h,
                                "h2d_bytes": int(100 * (1 - h)) * 1024,
                                "transfers": int(100 * (1 - h)),
                                "admissions": int(100 * (1 - h)),
                                "evictions": 0,
                                "cpu_fallbacks": 0,
                                "cpu_fallback_selections": 0,
                                "slot_hit_rate": h,
                                "ready_fraction": 1.0,
                                "wasted_copies": 0,
                                "est_total_ms": None if ms is None else ms * 60,
                                "est_ms_per_token": ms,
                                "est_tokens_per_s": None if ms is None else 1000 / ms,
                                "cost_notes": "",
                            }
                        )
    return rows


def write_sweep(folder: Path, sweep: list[dict] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    sweep = sweep_rows() if sweep is None else sweep
    pq.write_table(pa.Table.from_pylist(sweep), folder / "sweep.parquet")
    per_layer, targets = [], []
    for r in sweep:
        if r["bandwidth_scale"] != 1.0:
            continue
        for layer in range(LAYERS):
            hits = int(r["hit_rate"] * 50) - layer
            hits = max(hits, 0)
            per_layer.append(
                {
                    "trace": r["trace"],
                    "label": r["label"],
                    "mode": r["mode"],
                    "capacity": r["capacity"],
                    "layer": layer,
                    "accesses": 50,
                    "hits": hits,
                    "hit_rate": hits / 50,
                }
            )
    pq.write_table(pa.Table.from_pylist(per_layer), folder / "per_layer.parquet")
    for trace in TRACES:
        for label in LABELS:
            for mode in ("instant", "timed"):
                for target in (0.5, 0.9):
                    reached = [c for c in CAPACITIES if hit_rate(label, c) >= target]
                    targets.append(
                        {
                            "trace": trace,
                            "label": label,
                            "mode": mode,
                            "bandwidth_scale": 1.0,
                            "cpu_scale": 1.0,
                            "gpu_scale": 1.0,
                            "target_hit_rate": target,
                            "capacity": min(reached) if reached else None,
                        }
                    )
    pq.write_table(pa.Table.from_pylist(targets), folder / "targets.parquet")
    return folder


def write_analysis(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tables: dict[str, list[dict]] = {k: [] for k in ("frequency", "reuse", "runs", "layer_transitions")}
    tables.update({k: [] for k in ("layer_mi", "window_drift", "convergence", "prefetch_lead")})
    summary = {}
    for i, trace in enumerate(TRACES):
        counts = [[8, 4, 2, 1 + i], [5, 5, 3, 2]]
        total = sum(map(sum, counts))
        keys = sorted(
            ((-c, layer * EXPERTS + e) for layer, cs in enumerate(counts) for e, c in enumerate(cs))
        )
        rank = {key: r + 1 for r, (_, key) in enumerate(keys)}
        for layer, cs in enumerate(counts):
            for e, c in enumerate(cs):
                tables["frequency"].append(
                    {
                        "trace": trace,
                        "layer": layer,
                        "expert": e,
                        "count": c,
                        "share": c / sum(cs),
                        "global_rank": rank[layer * EXPERTS + e],
                    }
                )
        for d, c in ((1, 30), (2, 10), (3, 5), (7, 2), (40, 1)):
            tables["reuse"].append({"trace": trace, "distance": d, "count": c})
        for n, c in ((1, 12), (2, 6), (5, 2), (20, 1)):
            tables["runs"].append({"trace": trace, "run_length": n, "count": c})
        for f, t, c in ((0, 0, 6), (0, 1, 2), (1, 1, 4), (2, 3, 3), (3, 2, 1 + i)):
            tables["layer_transitions"].append(
                {"trace": trace, "layer": 1, "from_expert": f, "to_expert": t, "count": c}
            )
        tables["layer_mi"].append(
            {"trace": trace, "layer": 1, "pairs": 16 + i, "mi_bits": 0.9, "mi_shuffled_bits": 0.05}
        )
        for w, start in enumerate((0, 16, 32)):
            tables["window_drift"].append(
                {
                    "trace": trace,
                    "window": w,
                    "token_start": start,
                    "requests": 2,
                    "js_vs_first": None if w == 0 else 0.1 * w,
                    "js_vs_first_shuffled": None if w == 0 else 0.01 * w,
                }
            )
        for seen in (1, 4, 16, 60):
            for cap in (2, 4):
                tables["convergence"].append(
                    {
                        "trace": trace,
                        "tokens_seen": seen,
                        "spearman": seen / 60,
                        "capacity": cap,
                        "overlap": 0.5,
                    }
                )
        for d, recall in ((1, 0.55), (2, 0.5), (3, None)):
            tables["prefetch_lead"].append(
                {"trace": trace, "lead_layers": d, "recall": recall, "tokens": 0 if recall is None else 50,
                 "lead_us": 140.0 * d}
            )  # fmt: skip
        summary[trace] = {
            "copy_us": 126.4,
            "global_gini": 0.123456,
            "reuse_share_distance_1": 30 / 48,
            "mean_mi_bits": 0.9,
            "mean_mi_shuffled_bits": 0.05,
            "recall_previous_token": 0.75,
            "mean_js_vs_previous": None,
            "selections": total,
        }
    for name, rows in tables.items():
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{name}.parquet")
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    return folder


# the pre-registered rule as shipped (conf/decide/default.yaml)
RULE = rule_config(to_container(compose([])))

# (rel_diff, ci_lo, ci_hi, verdict) of lfu per capacity; the same for both traces.
LFU_VERDICTS = {
    0: (0.0, -0.001, 0.001, "equivalent"),
    2: (-0.0123, -0.031, 0.0045, "non_inferior"),
    4: (0.004, -0.012, 0.015, "equivalent"),
    8: (-0.05, -0.08, -0.02, "better"),
}


def write_decision(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for trace, workload in TRACES.items():
        for capacity in CAPACITIES:
            base_h = hit_rate("static_hindsight", capacity)
            useful = 0.2 <= base_h <= 0.95
            for label, role in (("lfu", "candidate"), ("lru", "other")):
                rel, lo, hi, verdict = (
                    LFU_VERDICTS[capacity] if label == "lfu" else (0.1, 0.05, 0.15, "worse")
                )
                rows.append(
                    {
                        "trace": trace,
                        "workload": workload,
                        "capacity": capacity,
                        "label": label,
                        "role": role,
                        "unit": "block",
                        "units": 6,
                        "metric": (1 + rel) * (2.0 - base_h),
                        "baseline_metric": 2.0 - base_h,
                        "rel_diff": rel,
                        "ci_lo": lo,
                        "ci_hi": hi,
                        "verdict": verdict,
                        "competitive": verdict in ("better", "equivalent", "non_inferior"),
                        "hit_rate": hit_rate(label, capacity),
                        "baseline_hit_rate": base_h,
                        "bytes_per_token": 1024.0,
                        "link_busy": 0.5,
                        "passes_limits": True,
                        "reasons": "" if capacity != 4 else "hit rate deficit 0.04",
                        "in_useful_range": useful,
                    }
                )
    pq.write_table(pa.Table.from_pylist(rows), folder / "verdicts.parquet")
    decision = {
        "selected": {"policy": "lfu", "params": {}, "label": "lfu"},
        "baseline": {"policy": "static_hindsight", "params": {}, "label": "static_hindsight"},
        "competitive": {"lfu": True},
        "reasons": ["lfu is competitive in every cell of the useful range"],
        "rule": RULE,
        "workloads": {
            "present": ["long_single", "multi_request"],
            "required": ["multi_request", "long_single"],
        },
        "cells": 8,
        "seed": 0,
        "first_part": {"policy": "lfu", "params": {}, "label": "lfu"},
        "best_generic": {
            "policy": "lfu",
            "params": {},
            "label": "lfu",
            "mean_rel_diff": 0.0,
            "is_reference": True,
        },
        "wins": [
            {
                "policy": "transition_prefetch",
                "params": {"budget": 2},
                "label": TP,
                "trace": t,
                "workload": TRACES[t],
                "split": "held_out",
                "chosen_on": t,
                "reference": "lfu",
                "capacities": [2, 4],
                "of_capacities": 2,
                "consistent": False,
                "cells": [
                    {
                        "capacity": c,
                        "capacity_fraction": c / (LAYERS * EXPERTS),
                        "rel_diff": -0.1,
                        "ci_lo": -0.12,
                        "ci_hi": -0.08,
                    }
                    for c in (2, 4)
                ],
            }
            for t in list(TRACES)[:1]
        ],
        "extensions": {
            "reference": "lfu",
            "judged": ["lru", "transition_prefetch"],
            "workloads": {
                "present": ["long_single", "multi_request"],
                "required": ["multi_request", "long_single"],
            },
            "policies": {
                "transition_prefetch": {
                    "consistent": False,
                    "competitive_everywhere": False,
                    "chosen": {t: TP for t in TRACES},
                    "label": TP,
                    "params": {"budget": 2},
                    "better_on_workloads": ["multi_request"],
                    "verdicts": {"better": 2, "inconclusive": 2},
                    "mean_held_out_rel_diff": -0.04,
                    "mean_rel_diff": -0.04,
                    "prefix_ms_per_token": {},
                    "reasons": [
                        "transition_prefetch: workload-specific win: better everywhere on ['multi_request'] only"
                    ],
                    "notes": [],
                },
            },
            "selected": None,
        },
    }
    (folder / "decision.json").write_text(json.dumps(decision, indent=2))
    cells = [
        {"policy": "transition_prefetch", "label": TP, "chosen_on": t, "trace": t, "workload": TRACES[t],
         "split": "held_out", "capacity": c, "capacity_fraction": c / (LAYERS * EXPERTS), "reference": "lfu",
         "unit": "block", "units": 12, "metric": 0.9, "reference_metric": 1.0,
         "rel_diff": -0.1 if i == 0 else 0.02, "ci_lo": -0.12 if i == 0 else -0.01,
         "ci_hi": -0.08 if i == 0 else 0.05, "verdict": "better" if i == 0 else "inconclusive",
         "passes_limits": True, "limits": ""}
        for i, t in enumerate(TRACES)
        for c in CAPACITIES[1:3]
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(cells, schema=EXTENSIONS_SCHEMA), folder / "extensions.parquet")
    return folder


def write_all(root: Path) -> dict[str, Path]:
    """The three artifact folders under root."""
    return {
        "analysis": write_analysis(root / "analyze-abc"),
        "sweep": write_sweep(root / "sweep-abc"),
        "decision": write_decision(root / "decide-abc"),
    }
