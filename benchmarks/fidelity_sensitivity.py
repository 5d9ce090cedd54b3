"""How a validate artifact's predictions move with the costs: each run of the chosen strategies replayed
again through the simulator (`fidelity.predict_run`, as validate predicts it) with the profile's copy
bandwidth and CPU expert times scaled (the cost model's `bandwidth_scale`, `cpu_scale`); a table of
measured, instant and predicted hit rate and predicted time per token per scale, and one JSON line.

    python benchmarks/fidelity_sensitivity.py --validation VALIDATION_JSON --profile PROFILE \
        --traces TRACES_ROOT [--strategies selected] [--bandwidth-scales 0.8,1.2] [--cpu-scales 0.8,1.2]

TRACES_ROOT holds the runs' `traces/...` paths (the artifact's folder, or where h200_round's
traces_<tag>.tgz was unpacked). A hit rate that no scale moves is set by the replay's order of events
alone (which copies can land before their use at all), not by how long anything takes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _scales(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sys.exit(f"fidelity_sensitivity: {flag}={text!r}: expected numbers separated by commas")
    if not values or any(not v > 0 for v in values):
        sys.exit(f"fidelity_sensitivity: {flag}={text!r}: expected numbers > 0")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validation", required=True, type=Path, help="a validate artifact's validation.json")
    ap.add_argument("--profile", required=True, type=Path, help="the cost profile the validate run was given")
    ap.add_argument("--traces", required=True, type=Path, help="the folder its runs' `trace` paths are under")
    ap.add_argument("--strategies", default="selected", help="comma-separated validate strategies to replay")
    ap.add_argument("--bandwidth-scales", default="0.8,1.2", help="copy bandwidth multipliers")
    ap.add_argument("--cpu-scales", default="0.8,1.2", help="CPU expert time multipliers")
    args = ap.parse_args()
    for path in (args.validation, args.profile, args.traces):
        if not path.exists():
            sys.exit(f"fidelity_sensitivity: {path}: no such file or folder")
    variants = [("as measured", {})]
    variants += [
        (f"bandwidth x{v:g}", {"bandwidth_scale": v})
        for v in _scales(args.bandwidth_scales, "--bandwidth-scales")
    ]
    variants += [(f"cpu x{v:g}", {"cpu_scale": v}) for v in _scales(args.cpu_scales, "--cpu-scales")]

    from validate_artifact import replayable_runs

    from moecache.validation.fidelity import predict_run

    wanted = [s.strip() for s in args.strategies.split(",") if s.strip()]
    chosen = replayable_runs(args.validation, args.traces, "fidelity_sensitivity", wanted)
    rows = []
    print("workload | strategy | capacity | hit measured | hit instant | " + " | ".join(
        f"{name}: hit, ms/token" for name, _ in variants))  # fmt: skip
    for run, strategy, trace in chosen:
        row = {"workload": run["workload"], "strategy": run["strategy"], "capacity": run["capacity"],
               "measured_hit_rate": run["hit_rate"], "measured_time_per_token_ms": run["time_per_token_ms"],
               "predicted": []}  # fmt: skip
        for name, scales in variants:
            got = predict_run(
                trace, policy=strategy.sim_policy, capacity=int(run["slots"]), profile_path=str(args.profile),
                on_miss=strategy.on_miss, scales=scales,
            )  # fmt: skip
            row["instant_hit_rate"] = got["instant_hit_rate"]
            row["predicted"].append(
                {
                    "variant": name,
                    **scales,
                    "hit_rate": got["hit_rate"],
                    "time_per_token_ms": got["time_per_token_ms"],
                }
            )
        rows.append(row)
        print(
            f"{row['workload']} | {row['strategy']} | {row['capacity']} | {row['measured_hit_rate']:.4f} | "
            f"{row['instant_hit_rate']:.4f} | "
            + " | ".join(f"{p['hit_rate']:.4f}, {p['time_per_token_ms']:.2f}" for p in row["predicted"])
        )
    print(json.dumps({"bench": "fidelity_sensitivity", "validation": str(args.validation), "runs": rows}))


if __name__ == "__main__":
    main()
