"""Has the machine changed since its cost profile was measured? validate's check, before and after its runs.

The simulator prices a run with the profile `moecache calibrate` measured; a fidelity error is the model's
only while the machine runs as fast as it did then. On a shared host it may not (the H200 host's speed
varied from call to call and within one: docs/benchmarks.md), so validate times one of the profile's own
rows again, the same way (`calibration.time_cpu_expert`: one expert call on one token over a pool of the
profile's size, its threads, its repeats), before its first run and after its last:

    check = compare(profile, probe(profile), probe(profile))

`compare` gives each time's change against the profile's median, in percent, and `changed`: either
change beyond CHANGE_PCT. validation.json keeps it (`machine_check`, null without a profile or without
such a row) and the report says where the fidelity errors mix the model's error with the machine's
change. It only reports: no prediction is rescaled by it.
"""

from __future__ import annotations

import torch

from moecache import calibration as cal
from moecache.cost_profile import CostProfile

PROBE_TOKENS = 1  # the profile's `cpu` row re-timed: one expert, one token (a decode step's CPU work)
CHANGE_PCT = 10.0  # a change beyond this, before or after the runs, is reported as the machine's
PROBE_WARMUP = 3  # untimed calls first (calibrate's own warm-up is not in the profile)
PROBE_REPEATS = 20  # where the row does not say how many calls it timed (calibrate's cost.repeats)


def probe_row(profile: CostProfile) -> dict | None:
    """The profile's `cpu` row the check re-times (PROBE_TOKENS tokens, the profile's dtype), or None."""
    for row in profile.cpu:
        if row["dtype"] == profile.dtype and int(row["tokens_per_call"]) == PROBE_TOKENS:
            return row
    return None


def probe(profile: CostProfile) -> dict | None:
    """That row timed now as calibrate timed it (its pool size, threads and repeats; PROBE_WARMUP calls
    first), or None where the profile has no such row."""
    row = probe_row(profile)
    if row is None:
        return None
    shape = cal.ExpertShape(int(profile.shape["hidden_size"]), int(profile.shape["moe_intermediate_size"]))
    pool = cal.make_pool(shape, int(row["pool_experts"]), cal.dtype_of(row["dtype"]), "cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(int(row.get("threads") or before))
    try:
        timing = cal.time_cpu_expert(
            pool, PROBE_TOKENS, int(row.get("repeats") or PROBE_REPEATS), PROBE_WARMUP
        )
    finally:
        torch.set_num_threads(before)
    return timing.as_dict()


def compare(profile: CostProfile, before: dict | None, after: dict | None) -> dict | None:
    """The check's record (module docstring), or None without the row or a probe."""
    row = probe_row(profile)
    if row is None or before is None or after is None:
        return None
    ref = float(row["median_us"])
    change = {
        k: 100.0 * (float(t["median_us"]) - ref) / ref for k, t in (("before", before), ("after", after))
    }
    return {
        "probe": f"cpu expert, {PROBE_TOKENS} token, {row['dtype']}, {row.get('threads') or 'default'} threads",
        "profile_median_us": ref,
        "before_median_us": float(before["median_us"]),
        "after_median_us": float(after["median_us"]),
        "change_pct_before": change["before"],
        "change_pct_after": change["after"],
        "change_target_pct": CHANGE_PCT,
        "changed": any(abs(c) > CHANGE_PCT for c in change.values()),
    }
