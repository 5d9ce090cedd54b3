"""A validate artifact's runs, for the scripts that replay them through the simulator again
(rejudge_fidelity.py, fidelity_sensitivity.py, compare_hits.py): its strategies rebuilt from
validation.json, and each chosen run with its strategy and its trace under the traces root."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def replayable_runs(
    validation: Path, traces: Path, script: str, wanted: list[str] | None = None
) -> list[tuple]:
    """[(run row, Strategy, trace path)] of the runs of `wanted` strategies (None: every strategy the
    simulator replays; the unmodified reference is not one), in the artifact's order. A strategy the
    artifact did not run, or a missing trace, exits with one line naming `script`."""
    import moecache.sim.policies  # noqa: F401  (registers every policy)
    from moecache.sim.policy_spec import PolicySpec
    from moecache.validation import baselines

    data = json.loads(validation.read_text())
    selected = PolicySpec.from_dict(data["selected"], f"{validation}: selected")
    on_miss = next((r["on_miss"] for r in data["runs"] if r["strategy"] == "selected"), "cpu")
    strategies = {s.name: s for s in baselines.build(data["strategies"], selected, on_miss)}
    unknown = sorted(set(wanted or ()) - set(strategies))
    if unknown:
        sys.exit(f"{script}: --strategies {unknown}: the artifact ran {sorted(strategies)}")
    out = []
    for row in data["runs"]:
        if row["strategy"] not in (wanted if wanted is not None else strategies):
            continue
        trace = traces / row["trace"]
        if not trace.is_file():
            sys.exit(f"{script}: {trace}: no such trace (--traces holds the artifact's traces/)")
        out.append((row, strategies[row["strategy"]], trace))
    return out
