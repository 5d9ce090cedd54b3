"""Instant mode against textbook demand caching, and one request through simulate vs the sweep path."""

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moecache.cost_profile import CostProfile
from moecache.sim.inputs import BUNDLED_PROFILES
from moecache.sim.policy import make_policy
from moecache.sim.replay import replay_instant
from moecache.sim.sweep import CostSettings, Job, run_job, run_jobs


def textbook_lru_hits_first(trace, capacity: int) -> np.ndarray:
    """Classical LRU (an OrderedDict) over the access order in which each layer step's hits (by the
    snapshot before the step) come before its misses, both in router order."""
    cache: OrderedDict = OrderedDict()
    hits = []
    for s in range(trace.num_steps):
        keys = trace.key_A[trace.start_V[s] : trace.start_V[s + 1]].tolist()
        hit = [k in cache for k in keys]
        hits += hit
        for k in [k for k, h in zip(keys, hit, strict=True) if h] + [
            k for k, h in zip(keys, hit, strict=True) if not h
        ]:
            if k in cache:
                cache.move_to_end(k)
            elif capacity > 0:
                if len(cache) >= capacity:
                    cache.popitem(last=False)
                cache[k] = True
    return np.array(hits, bool)


steps_strategy = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True), min_size=1, max_size=2),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(raw=steps_strategy, capacity=st.integers(0, 18))
def test_instant_lru_is_textbook_lru_over_the_hits_first_order(make_trace, raw, capacity):
    # each entry is its own forward step (a decode step when it routes one token)
    steps = [("r0", i, layer, tokens) for i, (layer, tokens) in enumerate(raw)]
    trace = make_trace(steps, 3, 6, 3)
    got = replay_instant(trace, make_policy("lru"), capacity).hit_A
    np.testing.assert_array_equal(got, textbook_lru_hits_first(trace, capacity))


def test_one_request_equals_itself_through_the_sweep_path(make_trace):
    steps = [
        ("only", t, layer, [sorted({(t * 3 + layer) % 5, (t + 2 * layer + 1) % 5})])
        for t in range(12)
        for layer in range(2)
    ]
    trace = make_trace(steps, 2, 5)
    profile = CostProfile.load(BUNDLED_PROFILES / "h200_qwen3_6_35b_a3b_2026-11-30.json")
    jobs = [
        Job(0, name, {}, cap, mode, CostSettings())
        for name in ("lru", "lfu", "belady")
        for cap in (0, 2, 4, 10)
        for mode in ("instant", "timed")
    ]
    table = run_jobs([trace], profile, jobs, workers=2).to_pylist()
    for job, swept in zip(jobs, table, strict=True):
        alone, _, _ = run_job(trace, profile, job)
        assert swept == alone
