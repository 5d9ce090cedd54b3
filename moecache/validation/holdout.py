"""Simulator fidelity on runs the cost profile was not fitted on: validate's fidelity table.

A profile's numbers come from two places. calibrate fits its own (moecache/calibration_fit.py) on its own
runs: the model under random forced routing at its own prompt lengths, none of them a validate run. The
anchoring (anchors.py) moves two decode numbers, the non-expert time per layer and the CPU-step excess,
onto one workload's all_resident and all_cpu runs: those two runs are then priced exactly by
construction, fitted, not predicted. So each row of the table names what its profile was fitted on:

- `fit_on` null: validate.cost_profile as given (calibrate's own runs). It predicts every offloaded run of
  every workload, role `predicted`. Without a profile only the hit rate is predicted (the replay of the
  run's own trace; nothing fitted).
- `fit_on` = A, for every ordered pair of workloads (A, B) where A was anchored: the profile anchored on
  A's all_resident and all_cpu runs. Those two runs are rows of role `fitted` (workload A); every
  offloaded run of B, at every capacity, for every strategy, is a row of role `predicted` (workload B):
  the held-out prediction, nothing of B's runs in the profile.

A direction is (fit_on, predicted workload). Its targets (fidelity.py): time per token within
TIME_TARGET_PCT for at least TIME_TARGET_SHARE of its predicted runs, and hit rate within
HIT_RATE_TARGET_PP for every one. `summary` judges each direction and the held-out runs of every
cross-workload direction together, and counts apart the runs on a steady machine (the CPU probe timed
just before the run within MACHINE_STEADY_PCT of the profile's: machine_check.RunProbe), whose time
errors are the model's alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from moecache.validation.anchors import ANCHORS, Predicted, add_anchored
from moecache.validation.fidelity import (
    HIT_RATE_TARGET_PP,
    MACHINE_STEADY_PCT,
    TIME_TARGET_PCT,
    TIME_TARGET_SHARE,
)

FITTED, PREDICTED = "fitted", "predicted"  # a row's role
CALIBRATE, NO_PROFILE = "calibrate", "no cost profile"  # what fit_on null stands for in a direction's name


def direction(fit_on: str | None, profile: str | None, workload: str) -> str:
    """A row's direction, named: what its profile was fitted on -> the workload it predicts."""
    return f"{fit_on or (CALIBRATE if profile else NO_PROFILE)} -> {workload}"


def _row(run: Predicted, predicted: dict, fit_on: str | None, profile: str | None, role: str) -> dict:
    """A fidelity row from a run's measured row and its predicted columns (predict.predict's)."""
    errors = json.loads(predicted["fidelity_errors"])
    r = run.row
    return {
        "direction": direction(fit_on, profile, r["workload"]), "fit_on": fit_on, "profile": profile,
        "workload": r["workload"], "strategy": r["strategy"],
        "capacity": r["capacity"], "slots": r["slots"], "role": role,
        "measured_time_per_token_ms": r["time_per_token_ms"],
        "predicted_time_per_token_ms": predicted["predicted_time_per_token_ms"],
        "time_per_token_error_pct": errors["time_per_token_error_pct"],
        "time_within_target": errors["time_within_target"],
        "measured_hit_rate": r["hit_rate"], "predicted_hit_rate": predicted["predicted_hit_rate"],
        "hit_rate_error_pp": errors["hit_rate_error_pp"],
        "hit_rate_within_target": errors["hit_rate_within_target"],
        "cpu_probe_change_pct": r.get("cpu_probe_change_pct"),
    }  # fmt: skip


def rows(
    runs_of: dict[str, list[Predicted]], anchored: dict[str, Path | None], profile: str | None, folder: Path
) -> list[dict]:
    """The fidelity table (module docstring): `runs_of` every offloaded run per workload, as predicted
    with `profile` (their rows hold those columns); `anchored` the profile anchored on each workload
    (anchors.add_anchored; None: not anchored), named relative to `folder` in the rows."""
    out = [_row(run, run.row, None, profile, PREDICTED) for runs in runs_of.values() for run in runs]
    for fit_on, path in anchored.items():
        if path is None:
            continue
        name = str(path.relative_to(folder))
        others = ", ".join(w for w in runs_of if w != fit_on)  # what a fitted row's profile predicts
        for run in runs_of[fit_on]:
            if run.row["strategy"] in ANCHORS and others:
                row = _row(run, run.predict(str(path)), fit_on, name, FITTED)
                out.append({**row, "direction": direction(fit_on, name, others)})
        for workload, runs in runs_of.items():
            if workload != fit_on:
                out += [_row(run, run.predict(str(path)), fit_on, name, PREDICTED) for run in runs]
    return out


def anchored_rows(runs_of: dict[str, list[Predicted]], profile: str | None, folder: Path) -> list[dict]:
    """Each workload's runs anchored (anchors.add_anchored: their rows gain the anchored columns, the
    anchored profile is written to `folder`; nothing without a profile), then the fidelity table (`rows`):
    validate's step and benchmarks/rejudge_fidelity.py's."""
    anchored = {} if profile is None else {
        w: add_anchored(runs, profile, folder, w) for w, runs in runs_of.items()
    }  # fmt: skip
    return rows(runs_of, anchored, profile, folder)


def _judged(rows: list[dict]) -> dict:
    """Counts and verdicts over `rows` (predicted ones): time judged where both sides exist."""
    times = [r["time_within_target"] for r in rows if r["time_within_target"] is not None]
    hits = [r["hit_rate_within_target"] for r in rows if r["hit_rate_within_target"] is not None]
    share = sum(times) / len(times) if times else None
    steady = [
        r["time_within_target"] for r in rows
        if r["time_within_target"] is not None and r.get("cpu_probe_change_pct") is not None
        and abs(r["cpu_probe_change_pct"]) <= MACHINE_STEADY_PCT
    ]  # fmt: skip
    return {
        "predicted_runs": len(rows),
        "time_judged": len(times),
        "time_within": sum(times),
        "time_within_share": share,
        "time_target_met": None if share is None else share >= TIME_TARGET_SHARE,
        # the judged runs whose machine was steady (module docstring), and how many of them are within
        "time_judged_steady": len(steady),
        "time_within_steady": sum(steady),
        "hit_rate_judged": len(hits),
        "hit_rate_within": sum(hits),
        "hit_rate_target_met": all(hits) if hits else None,
    }


def summary(table: list[dict]) -> dict:
    """validation.json's `fidelity`: the targets, one entry per direction (fit_on, predicted workload)
    with its fitted runs counted, and `held_out`: every cross-workload direction's predicted runs
    together (None where no workload was anchored against another)."""
    directions = []
    for name in dict.fromkeys(r["direction"] for r in table if r["role"] == PREDICTED):
        predicted = [r for r in table if r["direction"] == name and r["role"] == PREDICTED]
        fit_on = predicted[0]["fit_on"]
        directions.append({
            "direction": name, "fit_on": fit_on, "workload": predicted[0]["workload"],
            "fitted_runs": sum(r["fit_on"] == fit_on and r["role"] == FITTED for r in table) if fit_on else 0,
            **_judged(predicted),
        })  # fmt: skip
    across = [r for r in table if r["fit_on"] is not None and r["role"] == PREDICTED]
    return {
        "targets": {
            "time_per_token_pct": TIME_TARGET_PCT,
            "time_within_share": TIME_TARGET_SHARE,
            "hit_rate_pp": HIT_RATE_TARGET_PP,
            "machine_steady_pct": MACHINE_STEADY_PCT,
        },
        "directions": directions,
        "held_out": _judged(across) if across else None,
    }
