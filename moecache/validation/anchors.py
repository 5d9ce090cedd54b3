"""A second prediction of every run, with the cost profile's decode anchors taken from this validate.

calibrate takes two of the profile's numbers from runs of its own: the fast loop's non-expert decode time
per layer (runtime.non_expert.decode_us_per_layer, from its all-resident run) and the CPU-step excess
(runtime.cpu_step_excess.decode_us, from its all-CPU run). validate runs the same two baselines,
all_resident and all_cpu, minutes later in another process, and on the H200 hosts the machine itself moved
between the two by 10-60% (the machine check, CHANGELOG.md). `anchored_profile` moves those two numbers
so that this validate's own all_resident and all_cpu runs are priced exactly (the excess kept >= 0), takes
the decoder's warm-up (runtime.decode_warmup, docs/simulator.md) from the all_cpu run's own warm-up gaps
(each beyond that run's mean decode step; a run's decoder warms up as calibrate's does), and
`add_anchored` predicts every run of the workload again with that profile (`fidelity_errors_anchored`):
the simulator's error with the machine's drift between the two processes taken out. The profile's other
rows (CPU path, copies, operator, manager) stay calibrate's. The workload's all_resident and all_cpu runs
are FITTED by that prediction (their decode priced exactly, by construction), its other runs predicted
on the workload the profile was fitted on; the targets are read on runs of another workload
(moecache/validation/holdout.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moecache.cost_profile import decode_warmup_row
from moecache.sim.policy_spec import PolicySpec
from moecache.validation import predict

ANCHORS = ("all_resident", "all_cpu")


@dataclass(frozen=True)
class Predicted:
    """A run as it was predicted: its row (measured columns) and the replay's arguments."""

    row: dict
    trace: Path
    policy: PolicySpec
    slots: int
    on_miss: str

    def predict(self, profile_path: str | None) -> dict:
        """The run's predicted columns with `profile_path` (`predict.predict`)."""
        return predict.predict(
            self.trace, self.policy, self.slots, profile_path, self.row, on_miss=self.on_miss
        )


def anchored_profile(profile_path: str, anchors: dict[str, Predicted], out: Path) -> Path | None:
    """The profile at `profile_path` with its decode anchors moved onto the runs `anchors` (all_resident,
    all_cpu), written to `out`; None where the profile has no such anchors (not calibrated with
    cost.runtime.step=fast) or a run has no measured decode. One move prices both runs exactly: the
    non-expert time is added to every layer step, so the all-resident run's decode gap per layer is it;
    the excess is added to every step with CPU work (every all-CPU step), so what remains of the all-CPU
    run's gap is the excess's. Only an excess kept at 0 leaves the all-CPU run priced high."""
    data = json.loads(Path(profile_path).read_text())
    runtime = data.get("runtime") or {}
    non_expert, excess = runtime.get("non_expert"), runtime.get("cpu_step_excess")
    if not non_expert or not excess or set(ANCHORS) - set(anchors):
        return None
    layers = int(non_expert["moe_layers"])
    gap_us = {}
    for name in ANCHORS:
        decode = json.loads(anchors[name].predict(profile_path)["fidelity_errors"])["phases"].get("decode")
        if decode is None:
            return None
        gap_us[name] = (decode["measured_ms"] - decode["predicted_ms"]) * 1e3 / layers
    non_expert["decode_us_per_layer"] = max(0.0, non_expert["decode_us_per_layer"] + gap_us["all_resident"])
    excess["decode_us"] = max(0.0, excess["decode_us"] + gap_us["all_cpu"] - gap_us["all_resident"])
    excess["anchored_on"] = "validate: " + ", ".join(ANCHORS)
    warmup = _warmup_of(anchors["all_cpu"].row)
    if warmup is not None:
        runtime["decode_warmup"] = warmup
    out.write_text(json.dumps(data, indent=1, sort_keys=True))
    return out


def _warmup_of(row: dict) -> dict | None:
    """runtime.decode_warmup from a fast-loop run's row: its warm-up gaps (`warmup_gaps_ms`) each beyond
    its mean decode step (1 / decode_tokens_per_s); None where the row has neither."""
    gaps_ms, rate = row.get("warmup_gaps_ms"), row.get("decode_tokens_per_s")
    if not gaps_ms or not rate:
        return None
    return decode_warmup_row(
        [float(g) * 1e3 for g in gaps_ms], 1e6 / float(rate), anchored_on=f"validate: {row['strategy']}"
    )


def add_anchored(runs: list[Predicted], profile_path: str, folder: Path, workload: str) -> Path | None:
    """One workload's runs: each row gains `fidelity_errors_anchored` and `anchored_profile` (the file,
    relative to `folder`) where the workload has both anchors and the profile can be anchored; None
    otherwise. Returns the anchored profile's path (None: not anchored); moecache/validation/holdout.py
    predicts the other workloads' runs with it."""
    anchors = {r.row["strategy"]: r for r in runs if r.row["strategy"] in ANCHORS}
    out = anchored_profile(profile_path, anchors, folder / f"cost_profile_anchored_{workload}.json")
    for run in runs:
        run.row["anchored_profile"] = None if out is None else out.name
        run.row["fidelity_errors_anchored"] = (
            None if out is None else run.predict(str(out))["fidelity_errors"]
        )
    return out
