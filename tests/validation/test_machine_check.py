"""validate's machine check: the profile's one-token CPU expert row and its host loop timed again,
compared in percent."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moecache.cost_profile import CostProfile
from moecache.validation import machine_check
from tests.validation.test_fidelity import _profile


def _with_host_loop(tmp_path, median_us: float = 1000.0) -> CostProfile:
    path = _profile(tmp_path)
    data = json.loads(open(path).read())
    data["machine"]["host_loop"] = {"median_us": median_us, "p10_us": 0.0, "p90_us": 0.0, "repeats": 31}
    return CostProfile.from_dict(data, path)


def test_the_probes_time_the_profiles_own_rows_and_compare_reports_each_change(tmp_path):
    profile = _with_host_loop(tmp_path)
    assert machine_check.probe_row(profile)["median_us"] == 5.0
    now = machine_check.probe(profile)
    assert set(now) == {"cpu expert", "host loop"}
    assert now["cpu expert"]["repeats"] == machine_check.PROBE_REPEATS and now["host loop"]["repeats"] == 31
    assert all(t["median_us"] > 0 for t in now.values())
    same = machine_check.compare(
        profile, {"cpu expert": {"median_us": 5.0}, "host loop": {"median_us": 1000.0}},
        {"cpu expert": {"median_us": 5.4}, "host loop": {"median_us": 1050.0}},
    )  # fmt: skip
    cpu, host = same["probes"]
    assert (cpu["probe"], host["probe"]) == ("cpu expert", "host loop") and not same["changed"]
    assert cpu["change_pct_before"] == 0.0 and cpu["change_pct_after"] == pytest.approx(8.0)
    assert host["change_pct_after"] == pytest.approx(5.0) and cpu["what"].startswith("one expert, 1 token")
    slower = machine_check.compare(
        profile, {"cpu expert": {"median_us": 5.0}, "host loop": {"median_us": 1000.0}},
        {"cpu expert": {"median_us": 5.0}, "host loop": {"median_us": 1600.0}},
    )  # fmt: skip
    assert slower["changed"] and slower["probes"][1]["change_pct_after"] == pytest.approx(60.0)
    faster = machine_check.compare(
        profile, {"cpu expert": {"median_us": 4.0}}, {"cpu expert": {"median_us": 5.0}}
    )
    assert faster["changed"] and [p["probe"] for p in faster["probes"]] == ["cpu expert"]
    assert faster["probes"][0]["change_pct_before"] == pytest.approx(-20.0)
    assert machine_check.compare(profile, {}, now) is None


def test_a_profile_without_either_measurement_has_no_check(tmp_path):
    loaded = CostProfile.load(_profile(tmp_path))  # no host_loop: a profile from before it
    assert set(machine_check.probe(loaded)) == {"cpu expert"}
    profile = dataclasses.replace(loaded, cpu=[dict(loaded.cpu[0], tokens_per_call=4)])
    assert machine_check.probe_row(profile) is None and machine_check.probe(profile) == {}
    assert (
        machine_check.compare(profile, {"cpu expert": {"median_us": 1.0}}, {"cpu expert": {"median_us": 1.0}})
        is None
    )
