"""The decision end to end (sweep -> decide) on a constructed trace whose requests each use a fresh small
set of experts: per-request reset and LRU must win at small capacity against hindsight static and
cumulative LFU, and the decision must flip to one of them and name the wins (issue 9, section 4).

The trace: 2 layers x 16 experts, top-2; 16 requests of 24 decode tokens; request r selects experts
2 (r mod 8) and 2 (r mod 8) + 1 at both layers for every token, so each request's 4 keys are fresh (the
previous 7 requests used other keys). Hindsight static sees every key used equally and keeps C of the 32:
hit rate about C / 32. A recency policy (LRU, LFU reset per request) misses only a request's first token:
23 / 24 = 0.958 at any capacity >= 4. Cumulative LFU keeps the keys counted most so far, earlier requests'.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from moecache.config import compose
from moecache.stages import decide, sweep
from tests.conftest import trace_table

LAYERS, EXPERTS, TOP_K, REQUESTS, TOKENS = 2, 16, 2, 16, 24
EXPERT_BYTES = 6 * 2**20  # a DeepSeek-V2-Lite-sized expert: copies take about as long as a few tokens
POLICIES = "{static_hindsight:[{}],lfu:[{reset_per_request:false},{reset_per_request:true}],lru:[{}]}"


def fresh_expert_steps() -> list:
    steps = []
    for r in range(REQUESTS):
        experts = [2 * (r % 8), 2 * (r % 8) + 1]
        for t in range(TOKENS):
            steps += [(f"req{r:02d}", t, layer, [experts]) for layer in range(LAYERS)]
    return steps


@pytest.fixture(scope="module")
def decided(tmp_path_factory):
    root = tmp_path_factory.mktemp("fresh")
    trace = root / "fresh.parquet"
    pq.write_table(trace_table(fresh_expert_steps(), LAYERS, EXPERTS, TOP_K, EXPERT_BYTES)[0], trace)
    overrides = [
        f"output_root={root / 'out'}",
        f"traces=[{trace}]",
        "~sweep.policies",
        f"+sweep.policies={POLICIES}",
        "sweep.sensitivity.policies=[]",
        "decide.bootstrap.resamples=500",
        "decide.workloads.required=null",
    ]
    s = sweep.run(compose(overrides))
    d = decide.run(compose(overrides))
    return (
        pq.read_table(s.artifact / "sweep.parquet").to_pylist(),
        json.loads((d.artifact / "decision.json").read_text()),
    )


def test_recency_beats_static_and_cumulative_lfu_at_small_capacity(decided):
    rows, _ = decided
    hit = {(r["label"], r["capacity"]): r["hit_rate"] for r in rows}
    # C = 8 of 32 keys: static keeps a quarter of the keys; the recency policies miss a request's first token
    assert hit["static_hindsight", 8] == pytest.approx(0.25, abs=0.02)
    assert hit["lru", 8] == pytest.approx(23 / 24, abs=0.01)
    assert hit["lfu(init_counts=None,reset_per_request=True)", 8] == pytest.approx(23 / 24, abs=0.01)
    assert hit["lfu(init_counts=None,reset_per_request=False)", 8] < 0.5


def test_the_decision_flips_and_names_the_wins(decided):
    _, decision = decided
    recency = {"lru", "lfu(init_counts=None,reset_per_request=True)"}
    assert decision["selected"]["label"] in recency
    assert decision["selected"]["label"] != decision["first_part"]["label"]
    assert decision["extensions"]["judged"] == ["lfu", "lru"]
    assert all(decision["extensions"]["policies"][p]["consistent"] for p in ("lfu", "lru"))
    # the other recency policy is named with its wins: every useful capacity, r < 0 with its interval
    (other,) = recency - {decision["selected"]["label"]}
    (win,) = [w for w in decision["wins"] if w["label"] == other]
    assert win["trace"] == "fresh" and win["split"] == "held_out" and win["capacities"]
    assert len(win["capacities"]) == win["of_capacities"]
    assert all(c["ci_hi"] < 0 for c in win["cells"])
    assert decision["best_generic"]["label"] in recency
