"""Has the machine changed since its cost profile was measured? validate's check, before and after its runs.

The simulator prices a run with the profile `moecache calibrate` measured; a fidelity error is the model's
only while the machine runs as fast as it did then. On a shared host it may not (the H200 host's speed
varied from call to call and within one: CHANGELOG.md), so validate times two of the profile's own
measurements again, the same way, before its first run and after its last:
- "cpu expert": the profile's one-token CPU expert row (`calibration.time_cpu_expert`: one expert call on
  one token over a pool of the row's size, its threads, its repeats): the CPU path's speed;
- "host loop": `machine.host_loop` (`calibration.time_host_loop`, a fixed Python loop on this thread): the
  host thread's own speed, which the runtime's host points run at (profiles from before it lack it).

    check = compare(profile, probe(profile), probe(profile))

`compare` gives each probe's change against the profile's median, in percent, and `changed`: any change
beyond CHANGE_PCT. validation.json keeps it (`machine_check`, null without a profile or without either
measurement) and the report says where the fidelity errors mix the model's error with the machine's
change. A host's speed also moves between runs (an H100 host's CPU path ran at half speed under one
workload and not the other: CHANGELOG.md), so `RunProbe` times the "cpu expert" probe again just before
each run (runs.parquet's and fidelity.parquet's `cpu_probe_change_pct`), and the fidelity summary counts
the runs on a steady machine apart (holdout.py). It only reports: no prediction is rescaled by it.
"""

from __future__ import annotations

import torch

from moecache import calibration as cal
from moecache.cost_profile import CostProfile
from moecache.validation.fidelity import MACHINE_STEADY_PCT

PROBE_TOKENS = 1  # the profile's `cpu` row re-timed: one expert, one token (a decode step's CPU work)
# a change beyond this, before or after the runs, is reported as the machine's
CHANGE_PCT = MACHINE_STEADY_PCT
PROBE_WARMUP = 3  # untimed calls first (calibrate's own warm-up is not in the profile)
PROBE_REPEATS = 20  # where the row does not say how many calls it timed (calibrate's cost.repeats)


def probe_row(profile: CostProfile) -> dict | None:
    """The profile's `cpu` row the check re-times (PROBE_TOKENS tokens, the profile's dtype), or None."""
    for row in profile.cpu:
        if row["dtype"] == profile.dtype and int(row["tokens_per_call"]) == PROBE_TOKENS:
            return row
    return None


def references(profile: CostProfile) -> dict[str, tuple[str, dict]]:
    """{probe name: (what it times, the profile's timing)} of the probes this profile has."""
    out = {}
    row = probe_row(profile)
    if row is not None:
        threads = row.get("threads") or "default"
        out["cpu expert"] = (f"one expert, {PROBE_TOKENS} token, {row['dtype']}, {threads} threads", row)
    loop = (profile.machine or {}).get("host_loop")
    if loop is not None:
        out["host loop"] = (f"{cal.HOST_LOOP_ITEMS} Python loop iterations, one thread", loop)
    return out


def _probe_pool(profile: CostProfile, row: dict):
    """The `cpu` row's pool of experts (its size and dtype), on the host."""
    shape = cal.ExpertShape(int(profile.shape["hidden_size"]), int(profile.shape["moe_intermediate_size"]))
    return cal.make_pool(shape, int(row["pool_experts"]), cal.dtype_of(row["dtype"]), "cpu")


def _time_cpu_expert(profile: CostProfile, row: dict, pool=None) -> dict:
    """The `cpu` row timed now as calibrate timed it (its pool size, threads and repeats); `pool`: one
    built before (`_probe_pool`), else a new one."""
    pool = _probe_pool(profile, row) if pool is None else pool
    before = torch.get_num_threads()
    torch.set_num_threads(int(row.get("threads") or before))
    try:
        repeats = int(row.get("repeats") or PROBE_REPEATS)
        return cal.time_cpu_expert(pool, PROBE_TOKENS, repeats, PROBE_WARMUP).as_dict()
    finally:
        torch.set_num_threads(before)


def probe(profile: CostProfile) -> dict[str, dict]:
    """Each of the profile's probes (`references`) timed now as calibrate timed it: {name: timing dict}."""
    timers = {
        "cpu expert": lambda row: _time_cpu_expert(profile, row),
        "host loop": lambda _: cal.time_host_loop().as_dict(),
    }
    return {name: timers[name](ref) for name, (_, ref) in references(profile).items()}


class RunProbe:
    """The "cpu expert" probe, timed again before each run (module docstring): `probe()` gives its change
    against the profile's median, in percent. Its pool is built once and held while validate runs (the
    row's pool_experts: 101 experts, 636 MB, in the shipped Qwen3.6 profile). `RunProbe.of(profile)` is
    None where the profile has no such row."""

    def __init__(self, profile: CostProfile, row: dict):
        self.profile, self.row = profile, row
        self.pool = _probe_pool(profile, row)

    @classmethod
    def of(cls, profile: CostProfile) -> RunProbe | None:
        row = probe_row(profile)
        return None if row is None else cls(profile, row)

    def probe(self) -> float:
        base = float(self.row["median_us"])
        now = float(_time_cpu_expert(self.profile, self.row, self.pool)["median_us"])
        return 100.0 * (now - base) / base


def compare(profile: CostProfile, before: dict[str, dict], after: dict[str, dict]) -> dict | None:
    """The check's record (module docstring): per probe timed both times, the profile's median, the two
    medians now and their changes in percent; None where no probe was."""
    probes = []
    for name, (what, ref) in references(profile).items():
        if name not in before or name not in after:
            continue
        base = float(ref["median_us"])
        b, a = float(before[name]["median_us"]), float(after[name]["median_us"])
        probes.append({
            "probe": name, "what": what, "profile_median_us": base, "before_median_us": b,
            "after_median_us": a, "change_pct_before": 100.0 * (b - base) / base,
            "change_pct_after": 100.0 * (a - base) / base,
        })  # fmt: skip
    if not probes:
        return None
    changed = any(abs(p[k]) > CHANGE_PCT for p in probes for k in ("change_pct_before", "change_pct_after"))
    return {"probes": probes, "change_target_pct": CHANGE_PCT, "changed": changed}
