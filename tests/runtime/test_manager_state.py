"""The manager's state file (moecache/runtime/manager_state.py): a saved state continues identically in a
fresh manager, the file is written atomically and versioned, and a mismatch is a one-line error."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from moecache.errors import MoecacheError
from moecache.runtime.manager_state import init_manager, load_state, read_state, save_state
from tests.conftest import build_trace
from tests.runtime.helpers import manager
from tests.runtime.test_manager import routing, trail


@pytest.mark.parametrize(
    ("policy", "params"),
    [("lfu_hysteresis", {}), ("second_touch", {"base": "lfu"}), ("prefill_admit", {"prefill_max_admits": 1})],
)
def test_a_saved_state_continues_identically(tmp_path, policy, params):
    first, rest = routing(1, 30), routing(2, 30)
    a = manager(policy, 3, params=params)
    trail(a, first)
    path = save_state(a, tmp_path / "state.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["state.npz"]  # no temporary file left
    b = manager(policy, 3, params=params)
    load_state(b, path)
    assert np.array_equal(a.resident_G, b.resident_G)
    assert trail(a, rest) == trail(b, rest)


def test_a_state_is_refused_by_another_policy_capacity_or_version(tmp_path):
    a = manager("lfu", 3)
    trail(a, routing(1, 10))
    path = save_state(a, tmp_path / "state.npz")
    with pytest.raises(MoecacheError, match="state members"):
        load_state(manager("lru", 3), path)
    with pytest.raises(MoecacheError, match="saved policy 'lfu"):
        load_state(manager("lfu", 3, params={"reset_per_request": True}), path)
    with pytest.raises(MoecacheError, match="saved capacity 3, this manager has 4"):
        load_state(manager("lfu", 4), path)
    saved = read_state(path)
    header = dict(saved["header"], version=99)
    arrays = {f"state.{k}": v for k, v in saved["state"].items()}
    np.savez(
        tmp_path / "v99.npz",
        header=np.array(json.dumps(header)),
        resident_keys=saved["resident_keys"],
        **arrays,
    )
    with pytest.raises(MoecacheError, match="version 99; this moecache reads 1"):
        load_state(manager("lfu", 3), tmp_path / "v99.npz")
    with zipfile.ZipFile(tmp_path / "junk.npz", "w") as z:
        z.writestr("header.npy", b"not numpy")
    with pytest.raises(MoecacheError, match="cannot read the manager state"):
        load_state(manager("lfu", 3), tmp_path / "junk.npz")


def test_init_from_a_state_or_a_trace(tmp_path, make_trace_file):
    visits = routing(5, 20)
    steps = [(0, n // 2, layer, [i[0].tolist()]) for n, (layer, i) in enumerate(visits)]
    path = make_trace_file(tmp_path / "profile.parquet", steps, 2, 8)
    warm = manager("lfu", 3)
    assert init_manager(warm, path) == "trace"
    lived = manager("lfu", 3)
    lived.warm_from_trace(build_trace(steps, num_layers=2, num_experts=8))
    assert np.array_equal(warm.resident_G, lived.resident_G)
    saved = save_state(warm, tmp_path / "warm.npz")
    again = manager("lfu", 3)
    assert init_manager(again, saved) == "state"
    after = routing(6, 20)
    assert trail(again, after) == trail(lived, after)
    with pytest.raises(MoecacheError, match="neither a saved manager state"):
        init_manager(manager("lfu", 3), tmp_path / "nothing.txt")
