"""validate's machine check: the profile's one-token CPU expert row timed again, compared in percent."""

from __future__ import annotations

import pytest

from moecache.cost_profile import CostProfile
from moecache.validation import machine_check
from tests.validation.test_fidelity import _profile


def test_the_probe_times_the_profiles_own_row_and_compare_reports_the_change(tmp_path):
    profile = CostProfile.load(_profile(tmp_path))
    assert machine_check.probe_row(profile)["median_us"] == 5.0
    now = machine_check.probe(profile)
    assert now["median_us"] > 0 and now["repeats"] == machine_check.PROBE_REPEATS
    same = machine_check.compare(profile, {"median_us": 5.0}, {"median_us": 5.4})
    assert same["change_pct_before"] == 0.0 and same["change_pct_after"] == pytest.approx(8.0)
    assert not same["changed"] and same["probe"].startswith("cpu expert, 1 token, float32")
    slower = machine_check.compare(profile, {"median_us": 5.0}, {"median_us": 8.0})
    assert slower["changed"] and slower["change_pct_after"] == pytest.approx(60.0)
    faster = machine_check.compare(profile, {"median_us": 4.0}, {"median_us": 5.0})
    assert faster["changed"] and faster["change_pct_before"] == pytest.approx(-20.0)
    assert machine_check.compare(profile, None, now) is None


def test_a_profile_without_a_one_token_row_has_no_check(tmp_path):
    import dataclasses

    loaded = CostProfile.load(_profile(tmp_path))
    profile = dataclasses.replace(loaded, cpu=[dict(loaded.cpu[0], tokens_per_call=4)])
    assert machine_check.probe_row(profile) is None and machine_check.probe(profile) is None
    assert machine_check.compare(profile, {"median_us": 1.0}, {"median_us": 1.0}) is None
