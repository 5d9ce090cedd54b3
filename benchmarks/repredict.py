"""A validate artifact's runs predicted again with other cost profiles: each run's recorded trace replayed
through the simulator (`validation.predict`, as validate predicts it) per profile; a table of the errors
(time per token, decode, prefill) and one JSON line.

    python benchmarks/repredict.py VALIDATION_JSON TRACES_ROOT PROFILE [PROFILE ...] [--add-excess] [--anchor-runs]

TRACES_ROOT holds the runs' `traces/...` paths (the artifact's folder, or where h200_round's
traces_dsv2.tgz was unpacked). `--add-excess`: each profile also with `runtime.cpu_step_excess` computed
from its own in-loop runs (`calibration_fit.cpu_step_excess`, for a profile measured before it existed).
`--anchor-runs`: each profile also with its two decode anchors (the non-expert time per layer and the
CPU-step excess, which calibrate takes from its own all-resident and all-CPU runs) moved so that the
validation's OWN all_resident and all_cpu runs are priced exactly (the excess kept >= 0), as validate's
second prediction now does (`fidelity_errors_anchored`), for artifacts made before it."""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

from moecache.sim.policy_spec import PolicySpec
from moecache.validation import predict
from moecache.validation.baselines import STRATEGIES, build


def with_excess(path: str, out_dir: Path) -> str:
    from moecache.calibration_fit import cpu_step_excess

    data = json.loads(Path(path).read_text())
    base = {k: v for k, v in data.items() if k != "runtime"}
    more = copy.deepcopy(data)
    more["runtime"]["cpu_step_excess"] = cpu_step_excess(data["runtime"], base, data["settings"]["runtime"])
    out = out_dir / f"{Path(path).stem}+excess.json"
    out.write_text(json.dumps(more))
    return str(out)


def anchored_on_runs(path: str, runs: dict, strategies: dict, traces_root: str, out_dir: Path) -> str:
    """The profile at `path` with its decode anchors moved onto the validation's all_resident and all_cpu
    runs, as validate's second prediction does (moecache/validation/anchors.py)."""
    from moecache.validation.anchors import ANCHORS, Predicted, anchored_profile

    predicted = {
        name: Predicted(runs[name], Path(traces_root) / runs[name]["trace"], strategies[name].sim_policy,
                        runs[name]["slots"], runs[name]["on_miss"])
        for name in ANCHORS
    }  # fmt: skip
    out = anchored_profile(path, predicted, out_dir / f"{Path(path).stem}+anchored.json")
    if out is None:
        raise SystemExit(
            f"repredict: {path} has no decode anchors (not calibrated with cost.runtime.step=fast)"
        )
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("validation_json")
    ap.add_argument("traces_root")
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--add-excess", action="store_true")
    ap.add_argument("--anchor-runs", action="store_true")
    args = ap.parse_args()
    result = json.loads(Path(args.validation_json).read_text())
    selected = PolicySpec.of(result["selected"]["policy"], result["selected"]["params"])
    on_miss = next((r["on_miss"] for r in result["runs"] if r["strategy"] == "selected"), "cpu")
    strategies = {s.name: s for s in build(list(STRATEGIES), selected, on_miss or "cpu")}
    tmp = Path(tempfile.mkdtemp(prefix="repredict-"))
    profiles = list(args.profiles)
    if args.add_excess:
        profiles += [with_excess(p, tmp) for p in args.profiles]
    if args.anchor_runs:
        runs = {r["strategy"]: r for r in result["runs"]}
        profiles += [anchored_on_runs(p, runs, strategies, args.traces_root, tmp) for p in list(profiles)]
    rows = []
    for run in result["runs"]:
        if run["strategy"] not in strategies:
            continue
        spec = strategies[run["strategy"]]
        trace = Path(args.traces_root) / run["trace"]
        for profile in profiles:
            got = predict.predict(trace, spec.sim_policy, run["slots"], profile, run, on_miss=run["on_miss"])
            errors = json.loads(got["fidelity_errors"])
            phases = errors.get("phases", {})
            rows.append({
                "strategy": run["strategy"], "profile": Path(profile).name,
                "time_per_token_error_pct": errors["time_per_token_error_pct"],
                "decode_error_pct": phases.get("decode", {}).get("error_pct"),
                "prefill_error_pct": phases.get("prefill", {}).get("error_pct"),
            })  # fmt: skip
    print(f"{'strategy':17s} | {'profile':36s} | time/token | decode | prefill")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:+.1f}%"  # noqa: E731
        print(f"{r['strategy']:17s} | {r['profile']:36s} | {fmt(r['time_per_token_error_pct']):>10s} | "
              f"{fmt(r['decode_error_pct']):>6s} | {fmt(r['prefill_error_pct']):>7s}")  # fmt: skip
    print(json.dumps({"bench": "repredict", "validation": args.validation_json, "rows": rows}))


if __name__ == "__main__":
    main()
