"""The simulator's prediction of a measured run, through the fidelity module when it exists.

`moecache/validation/fidelity.py` (its own concern) replays a run's recorded trace through the simulator:
`predict_run(trace_path, *, policy, capacity, profile_path) -> {"hit_rate", "time_per_token_ms"}`
(time None without a cost profile) and `compare(predicted, measured) -> errors` (percent / percentage
points). Where the module is absent the predicted columns stay null and `available()` says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

from moecache.sim.policy_spec import PolicySpec

MODULE = "moecache.validation.fidelity"
EMPTY = {"predicted_hit_rate": None, "predicted_time_per_token_ms": None, "fidelity_errors": None}


def available() -> bool:
    return importlib.util.find_spec(MODULE) is not None


def predict(trace_path: Path, policy: PolicySpec, slots: int, profile_path: str | None, row: dict) -> dict:
    """The predicted columns of one run (EMPTY without the fidelity module); `row` holds the measured
    `hit_rate` and `time_per_token_ms`. A module that exists but fails raises: never a silent null."""
    if not available():
        return dict(EMPTY)
    fidelity = importlib.import_module(MODULE)
    predicted = fidelity.predict_run(
        str(trace_path), policy=policy, capacity=slots, profile_path=profile_path
    )
    measured = {"hit_rate": row["hit_rate"], "time_per_token_ms": row["time_per_token_ms"]}
    errors = fidelity.compare(predicted, measured)
    return {
        "predicted_hit_rate": predicted.get("hit_rate"),
        "predicted_time_per_token_ms": predicted.get("time_per_token_ms"),
        "fidelity_errors": json.dumps(errors, sort_keys=True),
    }
