"""The admission filters (second_touch, prefill_admit over any online base), lfu_hysteresis and
profile_static: golden hits, the compiled policies against their plain Python references, identities
with the policies they generalise, the prompt split of teacher-forced traces, and the simulator against
the runtime's cache manager on the real DeepSeek-V2-Lite trace."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from moecache.errors import MoecacheError
from moecache.sim.policy import make_policy
from moecache.sim.prompt_split import prompt_as_prefill
from moecache.sim.replay import initial_resident_mask, replay_from, replay_instant
from moecache.sim.trace_arrays import DECODE, PREFILL
from tests.conftest import ESFT_LAW
from tests.sim.reference import per_key_uses, reference_run
from tests.sim.strategies import assert_matches_reference, small_traces
from tests.sim.test_policies_basic import GOLDEN

VARIANTS = [
    ("second_touch", {}),
    ("second_touch", {"window_tokens": 1}),
    ("second_touch", {"base": "lfu"}),
    ("prefill_admit", {}),
    ("prefill_admit", {"base": "lfu", "prefill_max_admits": 1, "prefill_weight": 0.5}),
    ("prefill_admit", {"decode_admits": False, "prefill_max_admits": -1}),
    ("prefill_admit", {"base": "second_touch", "base_params": {"base": "lfu_decay", "window_tokens": 2}}),
    ("lfu_hysteresis", {}),
    ("lfu_hysteresis", {"half_life_tokens": 1, "hysteresis": 0.5, "min_residency_tokens": 2}),
]
# Hits at capacities 0..6 on test_policies_basic's GOLDEN trace (its first step is a 2-token prefill
# step), computed by the reference and frozen. By hand: prefill_admit over lru (no admission from a
# prefill step) loses lru's 28 at capacity 6 to 22: the prefill's 3 misses of each layer miss once more.
GOLDEN_HITS = {
    ("second_touch", ()): [0, 0, 0, 2, 14, 16, 22],
    ("second_touch", (("window_tokens", 1),)): [0, 0, 7, 8, 10, 11, 12],
    ("second_touch", (("base", "lfu"),)): [0, 3, 4, 11, 13, 18, 22],
    ("prefill_admit", ()): [0, 0, 0, 2, 14, 16, 22],
    ("prefill_admit", (("base", "lfu"), ("prefill_max_admits", 1), ("prefill_weight", 0.5))): [
        0,
        4,
        8,
        13,
        16,
        20,
        24,
    ],  # fmt: skip
    ("prefill_admit", (("decode_admits", False), ("prefill_max_admits", -1))): [0, 4, 9, 14, 19, 23, 28],
    ("lfu_hysteresis", (("half_life_tokens", 1), ("hysteresis", 0.5), ("min_residency_tokens", 2))): [
        0,
        5,
        8,
        13,
        17,
        21,
        28,
    ],  # fmt: skip
}


@pytest.mark.parametrize(
    "variant", list(GOLDEN_HITS), ids=lambda v: v[0] + "".join(f",{k}={x}" for k, x in v[1])
)
def test_golden_hits(make_trace, variant):
    name, params = variant[0], dict(variant[1])
    trace = make_trace(GOLDEN, 2, 3)
    want = GOLDEN_HITS[variant]
    assert [int(replay_instant(trace, make_policy(name, **params), c).hit_A.sum()) for c in range(7)] == want
    assert [int(reference_run(trace, name, c, **params).hit_A.sum()) for c in range(7)] == want


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=small_traces())
def test_matches_reference(make_trace, case):
    steps, num_layers, num_experts, top_k = case
    trace = make_trace(steps, num_layers, num_experts, top_k)
    for name, params in VARIANTS:
        assert_matches_reference(trace, name, params)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=small_traces())
def test_identities(make_trace, case):
    """lfu_hysteresis without margin nor residency is lfu_decay; prefill_admit letting everything
    through at weight 1 is its base."""
    steps, num_layers, num_experts, top_k = case
    trace = make_trace(steps, num_layers, num_experts, top_k)
    for c in range(trace.num_keys + 1):
        plain = replay_instant(trace, make_policy("lfu_decay", half_life_tokens=4), c).hit_A
        hyst = make_policy("lfu_hysteresis", half_life_tokens=4, hysteresis=0.0, min_residency_tokens=0)
        assert np.array_equal(replay_instant(trace, hyst, c).hit_A, plain)
        for base in ("lru", "lfu"):
            open_ = make_policy("prefill_admit", base=base, prefill_max_admits=-1, prefill_weight=1.0)
            assert np.array_equal(
                replay_instant(trace, open_, c).hit_A, replay_instant(trace, make_policy(base), c).hit_A
            )


def test_profile_static_ranks_the_profile(make_trace, make_trace_file, tmp_path):
    trace = make_trace(GOLDEN, 2, 3)
    profile_steps = [(0, t, layer, [[2, (t + layer) % 2]]) for t in range(4) for layer in range(2)]
    path = make_trace_file(tmp_path / "profile.parquet", profile_steps, 2, 3)
    counts = per_key_uses(make_trace(profile_steps, 2, 3))
    for split in ("global", "per_layer"):
        for c in range(7):
            got = replay_instant(trace, make_policy("profile_static", profile=str(path), split=split), c)
            ref = reference_run(trace, "profile_static", c, profile=counts, split=split)
            assert np.array_equal(got.hit_A, ref.hit_A), (split, c)
    # profile uses: keys 2 and 5 four each, 0, 1, 3, 4 two each. At 3 slots, global: 2, 5, then 0 (the
    # smallest key of 2 uses); per_layer: 2 (layer 0), 5 (layer 1), then 0 (the rest ranked globally)
    for split in ("global", "per_layer"):
        state = make_policy("profile_static", profile=str(path), split=split).init_state(trace, 3)
        assert state[0].tolist() == [0, 2, 5]
    # at 4 they differ: global takes key 1 (2 uses), per_layer the second best of layer 1, key 3
    for split, want in (("global", [0, 1, 2, 5]), ("per_layer", [0, 2, 3, 5])):
        assert (
            make_policy("profile_static", profile=str(path), split=split).init_state(trace, 4)[0].tolist()
            == want
        )
    with pytest.raises(MoecacheError, match="profile_static profile=.*trace has 2 layers x 3 experts"):
        make_policy("profile_static", profile=str(path)).init_state(make_trace(GOLDEN, 2, 4), 2)


@pytest.mark.parametrize(
    ("name", "params", "word"),
    [
        ("second_touch", {"base": "belady"}, "is offline"),
        ("second_touch", {"base": "second_touch"}, "is second_touch itself"),
        ("second_touch", {"base": "nope"}, "unknown policy"),
        ("second_touch", {"base_params": {"x": 1}}, "unknown parameter"),
        ("second_touch", {"window_tokens": -1}, "window_tokens"),
        ("prefill_admit", {"prefill_max_admits": -2}, "prefill_max_admits"),
        ("prefill_admit", {"prefill_weight": -1.0}, "prefill_weight"),
        ("prefill_admit", {"decode_admits": 1}, "decode_admits"),
        ("lfu_hysteresis", {"hysteresis": -0.1}, "hysteresis"),
        ("lfu_hysteresis", {"min_residency_tokens": 1.5}, "min_residency_tokens"),
        ("profile_static", {"profile": "{trace}", "split": "entropy"}, "split"),
        # no profile: the tie rule alone would place static_cold's keys, never what was meant
        ("profile_static", {}, "profile_static: profile=null: give the trace"),
        ("profile_static", {"profile": None, "split": "per_layer"}, "profile=null"),
        ("profile_static", {"profile": ""}, "profile must be a path, got ''"),
        ("profile_static", {"profile": 3}, "profile must be a path, got 3"),
        ("profile_static", {"profile": "{tmp}/absent.parquet"}, "absent.parquet: no such file or folder"),
        ("profile_static", {"profile": "{tmp}"}, "the folder holds no trace.parquet"),
        (
            "lfu",
            {"init_counts": "{tmp}/absent.parquet"},
            "lfu: init_counts=.*absent.parquet: no such file or folder",
        ),
        ("lfu", {"init_counts": "{tmp}"}, "lfu: init_counts=.*: the folder holds no trace.parquet"),
    ],
)
def test_bad_parameters(name, params, word, make_trace_file, tmp_path):
    trace = make_trace_file(tmp_path / "t.parquet", GOLDEN, 2, 3)
    params = {
        k: v.replace("{trace}", str(trace)).replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v
        for k, v in params.items()
    }
    with pytest.raises(MoecacheError, match=word):
        make_policy(name, **params)


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "traces=[{trace}]", "capacity=4", "policy=profile_static"],
        [
            "simulate",
            "traces=[{trace}]",
            "capacity=4",
            "policy=profile_static",
            "policy.params.split=per_layer",
        ],
        ["sweep", "traces=[{trace}]", "policy=profile_static"],
        ["sweep", "traces=[{trace}]", "~sweep.policies", "+sweep.policies={lru:[{}],profile_static:[{}]}"],
        [
            "generate",
            "model=tiny",
            "prompt=hi",
            "generation.max_new_tokens=2",
            "capacity=4",
            "policy=profile_static",
        ],
    ],
    ids=["simulate", "simulate-per-layer", "sweep-policy", "sweep-policies", "generate"],
)
def test_profile_static_without_a_profile_is_refused_in_one_line(
    argv, make_trace_file, tmp_path, monkeypatch
):
    """Wherever profile_static is selected without a profile: exit code 2, one stderr line naming the key,
    nothing written (the check runs before any trace or model is read)."""
    from typer.testing import CliRunner

    from moecache.cli import app

    root = tmp_path / "out"
    monkeypatch.setenv("MOECACHE_OUTPUT_ROOT", str(root))
    trace = make_trace_file(tmp_path / "t.parquet", GOLDEN, 2, 3)
    argv = [a.replace("{trace}", str(trace)) for a in argv]
    res = CliRunner().invoke(app, argv)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, (res.output, res.exception)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"moecache {argv[0]}: error: policy profile_static: profile=null"), lines[0]
    assert "policy.params.profile=PATH" in lines[0]
    assert not root.exists() or not list(root.rglob("manifest.json"))


def test_a_filter_is_one_class_per_base_and_pickles(make_trace):
    a = make_policy("second_touch", base="lfu", base_params={"reset_per_request": True})
    b = make_policy("second_touch", base="lfu")
    assert type(a) is type(b) and type(a).__name__ == "SecondTouch__LFU"
    assert type(make_policy("second_touch")).__name__ == "SecondTouch"
    assert a.label() == "second_touch(base=lfu,base_params={'reset_per_request': True},window_tokens=32)"
    c = pickle.loads(pickle.dumps(a))
    assert type(c) is type(a) and c.params == a.params and c.base.params == a.base.params
    trace = make_trace(GOLDEN, 2, 3)
    assert np.array_equal(replay_instant(trace, c, 3).hit_A, replay_instant(trace, a, 3).hit_A)


def test_prompt_as_prefill(make_trace):
    steps = [
        (r, t, layer, [[(t + layer + r) % 4, (t + 2) % 4]])
        for r in range(2)
        for t in range(5)
        for layer in range(2)
    ]
    trace = make_trace(steps, 2, 4, 2)
    split = prompt_as_prefill(trace, 0.5)  # ceil(2.5) = 3 tokens of each request's 5
    assert split.num_steps == 2 * (1 + 2) * 2
    assert split.tokens_V.tolist() == [3, 3, 1, 1, 1, 1] * 2
    assert split.phase_V.tolist() == [PREFILL] * 2 + [DECODE] * 4 + [PREFILL] * 2 + [DECODE] * 4
    assert split.clock_V.tolist() == [0, 0, 3, 3, 4, 4, 5, 5, 8, 8, 9, 9]
    assert split.uses_A.sum() == trace.uses_A.sum()
    # request 0, layer 0, tokens 0-2 select [0, 2], [1, 3], [2, 0]: keys 0, 2, 1, 3 with uses 2, 2, 1, 1
    a0, a1 = split.start_V[0], split.start_V[1]
    assert split.key_A[a0:a1].tolist() == [0, 2, 1, 3] and split.uses_A[a0:a1].tolist() == [2, 2, 1, 1]
    same = prompt_as_prefill(trace, 0.0)
    assert np.array_equal(same.key_A, trace.key_A) and np.array_equal(same.clock_V, trace.clock_V)
    with pytest.raises(MoecacheError, match="more than one token"):
        prompt_as_prefill(split, 0.5)


# ---- the real trace: the simulator equals the runtime's manager ----------------------------------

REAL = [
    ("second_touch", {"base": "lfu_decay", "base_params": {"half_life_tokens": 64}}),
    ("prefill_admit", {"base": "lru", "prefill_max_admits": 8, "prefill_weight": 0.5}),
    ("lfu_hysteresis", {}),
    ("profile_static", {"split": "per_layer"}),
]


@pytest.mark.parametrize(("name", "params"), REAL, ids=[n for n, _ in REAL])
def test_real_trace_simulator_equals_the_manager(esft_law_trace, name, params, tmp_path):
    """The first 2 law sequences, each replayed as a 25% prompt (one prefill step) and decode steps,
    through the simulator and, visit by visit, through the cache manager on the CPU stand-in: the same
    hits, admissions and evictions at every layer step, and the same residents at the end."""
    from moecache.trace.esft_import import load_esft_npz
    from tests.runtime.helpers import manager, random_store

    if name == "profile_static":  # profiled on the law trace's sequences 2-4 (not the replayed ones)
        import pyarrow.parquet as pq

        from moecache.trace.esft_import import esft_to_table
        from moecache.trace.schema import TraceMeta

        meta = TraceMeta(num_layers=26, num_experts=64, top_k=6, expert_bytes=17301504)
        arrays = load_esft_npz(ESFT_LAW, num_layers=26, num_experts=64, top_k=6)
        table = esft_to_table(arrays, name="esft_law", run_id="esft_law", tokens_per_step=1, meta=meta)
        ids = set(esft_law_trace.request_ids[2:5])
        mask = np.isin(np.asarray(table["request_id"].to_pylist(), dtype=object), list(ids))
        pq.write_table(table.filter(mask), tmp_path / "profile.parquet")
        params = {**params, "profile": str(tmp_path / "profile.parquet")}
    trace = prompt_as_prefill(esft_law_trace.subset_requests(np.arange(2)), 0.25)
    capacity = 416
    policy = make_policy(name, **params)
    state = policy.init_state(trace, capacity)
    resident_G = initial_resident_mask(policy, state, trace, capacity)
    sim = replay_from(trace, policy, state, resident_G, capacity)

    arrays = load_esft_npz(ESFT_LAW, num_layers=26, num_experts=64, top_k=6)
    m = manager(name, capacity, store=random_store(L=26, E=64, H=4, inter=2), top_k=6, params=params)
    ids_NLK = arrays.expert_ids.astype(np.int64)
    s = 0
    for r in range(2):
        lo, hi = int(arrays.seq_offsets[r]), int(arrays.seq_offsets[r + 1])
        prompt = lo + int(np.ceil(0.25 * (hi - lo)))
        m.begin_request()
        for t0, t1 in [(lo, prompt)] + [(t, t + 1) for t in range(prompt, hi)]:
            for layer in range(26):
                got = m.visit(layer, np.ascontiguousarray(ids_NLK[t0:t1, layer]))
                a0, a1 = trace.start_V[s], trace.start_V[s + 1]
                hit_E = np.zeros(64, bool)
                hit_E[ids_NLK[t0:t1, layer][got.hit_TK]] = True
                keys = trace.key_A[a0:a1] - layer * 64
                assert hit_E[keys].tolist() == sim.hit_A[a0:a1].tolist(), (s, t0)
                assert (len(got.admitted), len(got.evicted)) == (sim.admits_V[s], sim.evicts_V[s]), s
                s += 1
    assert s == trace.num_steps
    assert np.array_equal(m.resident_G, resident_G)
