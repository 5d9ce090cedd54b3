"""A validate artifact's fidelity judged again by the current simulator, from its measured runs.

`moecache validate` predicts each run when it measures it. After the simulator changes, the same measured
runs (runs of validation.json, each run's recorded trace, the cost profile it was given) can be predicted
again without a GPU: this script rebuilds validate's predictions (moecache/validation/predict.py), its
anchored profiles (anchors.py) and its fidelity table and verdicts (holdout.py) with the code of this tree.
Nothing is measured; the anchored profiles go to --out (a scratch folder). `--latency`: the artifact's
latency.parquet, for an artifact from before runs carried `warmup_gaps_ms` (validate schema 8): each
run's warm-up gaps are read from it (the latencies flagged warm-up, in order), so that the anchoring
takes the decoder's warm-up as validate now does.

    python benchmarks/rejudge_fidelity.py --validation <dir>/validation.json --profile <cost_profile.json> \\
        --traces <folder holding the artifact's traces/> --out /tmp/rejudge [--latency <dir>/latency.parquet]

Prints one row per held-out prediction and per direction, then one JSON line (holdout.summary's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def warmup_gaps(latency: Path) -> dict:
    """{(workload, strategy, capacity): [ms]}: each run's latencies flagged warm-up, in token order."""
    import pyarrow.parquet as pq

    out: dict = {}
    for r in pq.read_table(latency).to_pylist():
        if r["warmup"]:
            out.setdefault((r["workload"], r["strategy"], r["capacity"]), []).append(float(r["latency_ms"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validation", required=True, type=Path, help="a validate artifact's validation.json")
    ap.add_argument("--profile", required=True, type=Path, help="the cost profile the validate run was given")
    ap.add_argument("--traces", required=True, type=Path, help="the folder its runs' `trace` paths are under")
    ap.add_argument("--out", required=True, type=Path, help="scratch folder for the anchored profiles")
    ap.add_argument(
        "--latency", type=Path, help="the artifact's latency.parquet (runs without warmup_gaps_ms)"
    )
    args = ap.parse_args()
    from validate_artifact import replayable_runs

    from moecache.validation import anchors, holdout

    for path in (args.validation, args.profile, args.traces, *([args.latency] if args.latency else [])):
        if not path.exists():
            sys.exit(f"rejudge_fidelity: {path}: no such file or folder")
    args.out.mkdir(parents=True, exist_ok=True)
    profile = str(args.profile)
    warm_ms = warmup_gaps(args.latency) if args.latency else {}
    runs_of: dict[str, list[anchors.Predicted]] = {}
    for row, strategy, trace in replayable_runs(args.validation, args.traces, "rejudge_fidelity"):
        row = dict(row)
        if row.get("warmup_gaps_ms") is None:
            row["warmup_gaps_ms"] = warm_ms.get((row["workload"], row["strategy"], row["capacity"]))
        run = anchors.Predicted(row, trace, strategy.sim_policy, int(row["slots"]), strategy.on_miss)
        run.row.update(run.predict(profile))
        runs_of.setdefault(row["workload"], []).append(run)
    table = holdout.anchored_rows(runs_of, profile, args.out)
    print(
        "direction | strategy | capacity | measured ms/token | predicted | error % | hit measured | hit predicted | pp"
    )
    for r in table:
        if r["role"] != holdout.PREDICTED or r["fit_on"] is None:
            continue
        print(
            f"{r['direction']} | {r['strategy']} | {r['capacity']} | {r['measured_time_per_token_ms']:.2f} | "
            f"{r['predicted_time_per_token_ms']:.2f} | {r['time_per_token_error_pct']:+.1f} | "
            f"{r['measured_hit_rate']:.4f} | {r['predicted_hit_rate']:.4f} | {r['hit_rate_error_pp']:+.2f}"
        )
    summary = holdout.summary(table)
    for d in summary["directions"]:
        print(
            f"{d['direction']}: time within 15% {d['time_within']} of {d['time_judged']}, "
            f"hit rate within 1 pp {d['hit_rate_within']} of {d['hit_rate_judged']}"
        )
    print(
        json.dumps({"bench": "rejudge_fidelity", "validation": str(args.validation), **summary}, default=str)
    )


if __name__ == "__main__":
    main()
