"""History-length selection on a prefix, judged on held-out data; achievable hit rates."""

import pytest

from moecache.analysis.history import candidates_from, capacities_for, history_table, split_access
from moecache.analysis.hit_rates import hit_rate_table
from moecache.errors import MoecacheError
from moecache.sim.policy_spec import PolicySpec


def _decode(experts, request=0):
    return [(request, i, 0, [[e]]) for i, e in enumerate(experts)]


def test_split_is_by_forward_steps(make_trace):
    trace = make_trace(_decode([0, 1, 2, 3]), 1, 4)  # 4 one-token steps, 1 access each
    assert split_access(trace, 0.5) == 2
    assert split_access(trace, 0.1) == 1  # at least one forward step in the prefix
    assert split_access(trace, 0.99) == 3  # and one in the held-out part
    with pytest.raises(MoecacheError, match="prefix_fraction"):
        split_access(trace, 1.0)
    # by tokens: a 4-token prefill (one access per token's expert: 2 distinct keys) then 4 decode
    # steps; half of the 8 tokens = 4 -> the prefix is the prefill alone, the held-out part starts at
    # the first decode step's access (index 2)
    prefill = [(0, 0, 0, [[0], [1], [0], [1]])] + [(0, i, 0, [[i % 2]]) for i in range(1, 5)]
    assert split_access(make_trace(prefill, 1, 2), 0.5) == 2


def test_selection_on_prefix_and_held_out_rates(make_trace):
    # One layer, 3 experts, capacity 1 (multiple 1 x layers x top_k = 1).
    # Prefix (steps 0-5): 0 0 0 1 0 1; held out (steps 6-11): 1 1 0 1 1 1.
    seq = [0, 0, 0, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    trace = make_trace(_decode(seq), 1, 3)
    cands = [PolicySpec.of("lfu", {"reset_per_request": False}), PolicySpec.of("lru", {})]
    table, summary = history_table([trace], cands, [1.0], 0.5)
    rows = {(r["policy"], r["split"]): r for r in table.to_pylist()}
    # cumulative LFU, one slot: admits 0 at step 0; 1 replaces it only with a strictly greater count.
    # counts: 0 reaches 4 at step 4, 1 reaches 4 at step 7 (a tie: no copy), 0:5 at step 8, 1:6 at
    # step 10 -> admitted. Hits: steps 1, 2, 4 (prefix: 3 of 6), 8, 11 (held out: 2 of 6).
    assert rows["lfu", "prefix"]["hit_rate"] == pytest.approx(3 / 6)
    assert rows["lfu", "held_out"]["hit_rate"] == pytest.approx(2 / 6)
    # LRU, one slot: hit when the key equals the previous one: steps 1, 2, 6, 7, 10, 11.
    assert rows["lru", "prefix"]["hit_rate"] == pytest.approx(2 / 6)
    assert rows["lru", "held_out"]["hit_rate"] == pytest.approx(4 / 6)
    # LFU is chosen on the prefix (0.5 > 0.333) although LRU does better held out
    assert summary["trace"]["history_selected"] == cands[0].label()
    assert summary["trace"]["history_best_held_out"] == "lru"
    assert summary["trace"]["history_held_out_regret"] == pytest.approx(4 / 6 - 2 / 6)
    assert rows["lfu", "prefix"]["selected"] and not rows["lru", "prefix"]["selected"]


def test_other_traces_get_every_candidate(make_trace):
    a = make_trace(_decode([0, 0, 1, 1]), 1, 2, name="a")
    b = make_trace(_decode([1, 0, 1, 0]), 1, 2, name="b")
    table, summary = history_table([a, b], [PolicySpec.of("lru", {}), PolicySpec.of("lfu", {})], [1.0], 0.5)
    other = [r for r in table.to_pylist() if r["trace"] == "a" and r["split"] == "other:b"]
    assert {r["policy"] for r in other} == {"lru", "lfu"}
    # LRU with one slot on b (1 0 1 0) never hits
    assert next(r for r in other if r["policy"] == "lru")["hit_rate"] == 0.0
    assert "history_other_traces_mean_regret" in summary["a"]


def test_candidates_and_capacities(make_trace):
    assert [c.label() for c in candidates_from({"lfu_window": [{"window_tokens": 8}]})] == [
        "lfu_window(window_tokens=8)"
    ]
    with pytest.raises(MoecacheError, match="nope"):
        candidates_from({"nope": [{}]})
    with pytest.raises(MoecacheError, match="empty"):
        candidates_from({})
    trace = make_trace(_decode([0, 1]), 1, 4)
    assert capacities_for(trace, [0.5, 1, 2, 100]) == [1, 2, 4]


def test_hit_rates_lru_lfu_belady(make_trace):
    trace = make_trace(_decode([0, 1, 0, 2, 0, 1]), 1, 3)
    rows = {(r["policy"], r["capacity"]): r["hit_rate"] for r in hit_rate_table(trace, [0, 1, 3]).to_pylist()}
    assert rows["lru", 0] == rows["lfu", 0] == 0.0
    # LRU with one slot: never two equal keys in a row
    assert rows["lru", 1] == 0.0
    # warm Belady with one slot starts with 0 resident: hits at steps 0, 2, 4 (bypassing 1 and 2)
    assert rows["belady", 1] == pytest.approx(3 / 6)
    assert rows["belady", 3] == 1.0  # warm: every key resident from the start
    assert rows["lru", 3] == pytest.approx(3 / 6)  # compulsory misses only
