"""Output agreement of one model with its workloads' positions pooled: validate's agreement.parquet files
(one per validate, or one holding several workloads) read together, each run's figures over all its
positions, judged against the tolerance pooled the same way.

validate judges agreement per workload. Pooled, a run (all_resident, or a strategy at a capacity) is the
union of its workloads' positions: max error the larger, mean error the position-weighted mean, top-1
the agreeing positions over all positions (`LogitErrors.from_figures` and `+`, moecache/validation/
agreement.py); the tolerance (transformers' eager loop against grouped_mm) is pooled alike and the one
`LogitErrors.within` rule judges. Every file must come from one model and baseline, each workload once,
and every run must be in every workload; else one line naming the file and exit 2.

    python benchmarks/pool_agreement.py law/agreement.parquet intent/agreement.parquet

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moecache.validation.agreement import FIGURES, LogitErrors  # noqa: E402

COLUMNS = ("workload", "run", "kind", "capacity", "baseline", "positions", *FIGURES)
TOLERANCE = "tolerance"  # agreement.parquet's kind of the eager-vs-baseline row


class BadInput(Exception):
    """One line for the user: the file and what is wrong with it."""


def read_rows(paths: list[Path]) -> list[dict]:
    """Every row of every file, checked: the columns, one baseline, each workload in one file only."""
    rows, baseline, seen = [], None, {}
    for path in paths:
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as exc:
            raise BadInput(f"{path}: not a readable parquet file ({exc})") from exc
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise BadInput(f"{path}: not validate's agreement.parquet (no column {', '.join(missing)})")
        for row in table.select(list(COLUMNS)).to_pylist():
            if baseline is None:
                baseline = row["baseline"]
            if row["baseline"] != baseline:
                raise BadInput(f"{path}: baseline {row['baseline']!r}, another file's is {baseline!r}")
            if seen.setdefault(row["workload"], path) != path:
                raise BadInput(f"{path}: workload {row['workload']!r} is in {seen[row['workload']]} too")
            rows.append(row | {"file": str(path)})
    if not rows:
        raise BadInput(f"{', '.join(map(str, paths))}: no rows")
    return rows


def run_key(row: dict) -> tuple[str, str, str | None]:
    return row["kind"], row["run"], row["capacity"]


def pool(rows: list[dict]) -> dict:
    """{run key: pooled LogitErrors}, every run present in every workload (else BadInput)."""
    workloads = sorted({r["workload"] for r in rows})
    by_key: dict = {}
    for r in rows:
        by_key.setdefault(run_key(r), {})[r["workload"]] = r
    pooled = {}
    for key, per_workload in by_key.items():
        absent = [w for w in workloads if w not in per_workload]
        if absent:
            some = next(iter(per_workload.values()))
            raise BadInput(
                f"{some['file']}: run {key[1]} {key[2] or ''} has no rows for workload {', '.join(absent)}"
            )
        pooled[key] = sum(
            (LogitErrors.from_figures(int(r["positions"]), float(r["max_abs_logit_error"]),
                                      float(r["mean_abs_logit_error"]), float(r["top1_agreement"]))
             for r in per_workload.values()),
            LogitErrors(),
        )  # fmt: skip
    tolerances = [key for key in pooled if key[0] == TOLERANCE]
    if len(tolerances) != 1:
        raise BadInput(f"{rows[0]['file']}: expected one tolerance run, found {len(tolerances)}")
    return {"workloads": workloads, "tolerance": pooled.pop(tolerances[0]), "runs": pooled}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parquets", nargs="+", type=Path, help="validate's agreement.parquet files of one model")
    args = ap.parse_args(argv)
    try:
        pooled = pool(read_rows(args.parquets))
    except BadInput as exc:
        print(f"pool_agreement: {exc}", file=sys.stderr)
        return 2
    tolerance = pooled["tolerance"]
    runs = []
    for (_, run, capacity), errors in sorted(
        pooled["runs"].items(), key=lambda kv: (kv[0][1], kv[0][2] or "")
    ):
        within = errors.within(tolerance)
        runs.append({"run": run, "capacity": capacity, **errors.figures(), "top1_equal": errors.top1_equal,
                     "within": within, "within_tolerance": all(within.values())})  # fmt: skip
    print(f"workloads pooled: {', '.join(pooled['workloads'])}")
    print(f"{'run':<14} {'capacity':<9} {'positions':>9} {'max':>8} {'mean':>9} {'top-1':>7}  within")
    t = tolerance.figures()
    print(f"{'tolerance':<14} {'':<9} {t['positions']:>9} {t['max_abs_logit_error']:>8.4f} "
          f"{t['mean_abs_logit_error']:>9.5f} {t['top1_agreement']:>7.4f}  -")  # fmt: skip
    for r in runs:
        missed = [f for f, ok in r["within"].items() if not ok]
        print(f"{r['run']:<14} {r['capacity'] or '':<9} {r['positions']:>9} {r['max_abs_logit_error']:>8.4f} "
              f"{r['mean_abs_logit_error']:>9.5f} {r['top1_agreement']:>7.4f}  "
              f"{'yes' if r['within_tolerance'] else 'no (' + ', '.join(missed) + ')'}")  # fmt: skip
    result = {"bench": "pool_agreement", "files": [str(p) for p in args.parquets], "workloads": pooled["workloads"],
              "tolerance": t | {"top1_equal": tolerance.top1_equal}, "runs": runs,
              "runs_within": sum(r["within_tolerance"] for r in runs), "runs_judged": len(runs)}  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
