"""Every cost profile shipped in moecache/data/cost_profiles loads and is self-consistent."""

from pathlib import Path

import pytest

from moecache.cost_profile import CostProfile

PROFILES = sorted((Path(__file__).parents[1] / "moecache" / "data" / "cost_profiles").glob("*.json"))


def test_profiles_are_shipped():
    assert PROFILES, "no shipped cost profile"


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_shipped_profile_loads_and_its_fit_matches_its_points(path):
    profile = CostProfile.load(path)
    assert profile.cpu_expert_us(1) > 0
    assert profile.cuda_expert_us(1) is not None  # shipped profiles come from GPU machines
    # the latency + bytes/bandwidth fit reproduces the measured pinned copy of one expert within 20%
    measured = profile.pinned_at(profile.expert_bytes)["median_us"]
    assert abs(profile.expert_copy_us() - measured) / measured < 0.2
