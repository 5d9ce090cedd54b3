"""The simulator's prediction of a measured run: its predicted columns in runs.parquet.

`moecache/validation/fidelity.py` (its own concern) replays a run's recorded trace through the simulator
(`predict_run`: hit rate, and time per token with a cost profile) and compares it with what was measured
(`compare`: errors in percent / percentage points); this module turns both into the run's columns.
"""

from __future__ import annotations

import json
from pathlib import Path

from moecache.sim.policy_spec import PolicySpec
from moecache.validation import fidelity

# The predicted columns of a run the simulator does not replay (the unmodified reference).
EMPTY = {"predicted_hit_rate": None, "predicted_time_per_token_ms": None, "fidelity_errors": None}


def predict(
    trace_path: Path,
    policy: PolicySpec,
    slots: int,
    profile_path: str | None,
    row: dict,
    on_miss: str = "cpu",
) -> dict:
    """The predicted columns of one run; `row` holds the measured `hit_rate` and `time_per_token_ms`;
    `on_miss` the run's manager setting (the lru_sync baseline waits for its copies); its
    `prefill_tokens_per_s` / `decode_tokens_per_s`, where given, are compared per phase."""
    predicted = fidelity.predict_run(
        str(trace_path), policy=policy, capacity=slots, profile_path=profile_path, on_miss=on_miss
    )
    measured = {
        "hit_rate": row["hit_rate"],
        "time_per_token_ms": row["time_per_token_ms"],
        "prefill_ms_per_token": _per_token_ms(row.get("prefill_tokens_per_s")),
        "decode_ms_per_token": _per_token_ms(row.get("decode_tokens_per_s")),
    }
    errors = fidelity.compare(predicted, measured)
    return {
        "predicted_hit_rate": predicted.get("hit_rate"),
        "predicted_time_per_token_ms": predicted.get("time_per_token_ms"),
        "fidelity_errors": json.dumps(errors, sort_keys=True),
    }


def _per_token_ms(tokens_per_s) -> float | None:
    return None if tokens_per_s is None or not tokens_per_s > 0 else 1e3 / float(tokens_per_s)
