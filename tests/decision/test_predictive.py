"""The second part of the decision (moecache/decision/predictive.py) on synthetic sweeps: parameters
chosen on a prefix, judged on held-out tokens and on the other workload; selection flips with the evidence.

Traces as in test_decide.py: "mr" (multi_request, 12 requests x 2 blocks) and "ls" (long_single, one
request of 30 blocks); capacities 8, 16, 32 with static_hindsight hit rates 0.10 (outside the useful range),
0.50 and 0.90. The reference (first-part selection) is lfu; the predictive policy transition_prefetch has
two parameter sets whose time per block is the reference's times a factor that may differ between the
first and the second half of each trace's tokens, and between traces.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from test_decide import rule, tables

from moecache.decision.decide import BlockIndex
from moecache.decision.predictive import SCHEMA, _prefix_mask, apply, evaluate

CAPS = {8: 0.10, 16: 0.50, 32: 0.90}
TRACES = (("mr", "multi_request", 12, 2), ("ls", "long_single", 1, 30))
B1 = ("transition_prefetch", {"budget": 1})
B2 = ("transition_prefetch", {"budget": 2})


def scenario(factors: dict, seed: int = 0):
    """factors[(params label, trace)] = (factor on the first half of the tokens, on the second half)."""
    rng = np.random.default_rng(seed)
    groups = []
    for trace, workload, n_req, n_blk in TRACES:
        tokens_N = rng.integers(5, 20, size=n_req * n_blk)
        ref_N = tokens_N * 1000.0 * rng.uniform(0.8, 1.2, size=tokens_N.shape)
        first_half = (np.cumsum(tokens_N) - tokens_N) < 0.5 * tokens_N.sum()
        keys = [(r, b) for r in range(n_req) for b in range(n_blk)]
        for cap, hit in CAPS.items():
            variants = [(("static_hindsight", {}), ref_N * 1.05), (("lfu", {}), ref_N)]
            for name, pp in (("b1", B1), ("b2", B2)):
                early, late = factors[name, trace]
                variants.append(
                    (pp, ref_N * np.where(first_half, early, late) * rng.uniform(0.995, 1.005, ref_N.shape))
                )
            for (policy, params), us_N in variants:
                blocks = [
                    (r, b, int(t), float(u), 1, 1000)
                    for (r, b), t, u in zip(keys, tokens_N, us_N, strict=True)
                ]
                groups.append(
                    {"trace": trace, "workload": workload, "policy": policy, "params": params,
                     "capacity": cap, "hit_rate": hit, "blocks": blocks}
                )  # fmt: skip
    return tables(groups)


RULE = rule(predictive={"policies": ["transition_prefetch"], "prefix_fraction": 0.5})


def run(factors):
    sweep, blocks = scenario(factors)
    return evaluate(sweep, blocks, RULE, reference="lfu", baseline="static_hindsight")


def test_prefix_mask_by_tokens():
    # block tokens 2, 2, 2, 2 start at 0, 2, 4, 6: the prefix (start < 0.5 x 8 = 4) is the first two
    sweep, blocks = tables(
        [{"trace": "t", "workload": "w", "policy": "lfu", "params": {}, "capacity": 1, "hit_rate": 0.5,
          "blocks": [(0, i, 2, 1.0, 0, 0) for i in range(4)]}]
    )  # fmt: skip
    index = BlockIndex(blocks, {"lfu"}, "timed")
    assert _prefix_mask(index, index.get("t", 1, "lfu"), 0.5).tolist() == [True, True, False, False]


def test_consistently_better_is_selected_with_the_prefix_choice():
    # budget 2 is 20% faster everywhere, budget 1 10% faster: budget 2 is chosen on both prefixes
    table, summary = run({(k, t): (f, f) for k, f in (("b1", 0.9), ("b2", 0.8)) for t in ("mr", "ls")})
    assert table.schema == SCHEMA
    p = summary["policies"]["transition_prefetch"]
    assert p["chosen"] == {"ls": "transition_prefetch(budget=2)", "mr": "transition_prefetch(budget=2)"}
    # useful capacities 16 and 32: 2 held-out cells per trace + 2 cells of the other workload per trace
    assert sorted(table["split"].to_pylist()).count("held_out") == 4
    assert sorted(table["split"].to_pylist()).count("other_workload") == 4
    assert set(table["verdict"].to_pylist()) == {"better"}
    assert p["consistent"] and p["mean_held_out_rel_diff"] == pytest.approx(-0.2, abs=0.01)
    assert summary["selected"] == {
        "policy": "transition_prefetch",
        "params": {"budget": 2},
        "label": "transition_prefetch(budget=2)",
    }


def test_a_win_on_one_workload_is_workload_specific():
    table, summary = run({("b1", "mr"): (0.8, 0.8), ("b2", "mr"): (0.9, 0.9), ("b1", "ls"): (1.1, 1.1),
                          ("b2", "ls"): (1.1, 1.1)})  # fmt: skip
    p = summary["policies"]["transition_prefetch"]
    assert not p["consistent"] and summary["selected"] is None
    assert p["better_on_workloads"] == ["multi_request"]
    assert any("workload-specific" in r for r in p["reasons"])


def test_a_choice_that_only_wins_on_the_prefix_fails_held_out():
    # budget 1: 20% faster on the first half, 20% slower on the second; budget 2: 1% slower throughout
    factors = {(k, t): f for k, f in (("b1", (0.8, 1.2)), ("b2", (1.01, 1.01))) for t in ("mr", "ls")}
    table, summary = run(factors)
    p = summary["policies"]["transition_prefetch"]
    assert set(p["chosen"].values()) == {"transition_prefetch(budget=1)"}
    held = [r for r in table.to_pylist() if r["split"] == "held_out"]
    assert {r["verdict"] for r in held} == {"worse"}
    assert not p["consistent"] and summary["selected"] is None


def test_apply_records_first_part_and_is_deterministic():
    factors = {(k, t): (f, f) for k, f in (("b1", 0.9), ("b2", 0.8)) for t in ("mr", "ls")}
    sweep, blocks = scenario(factors)
    decisions = []
    for _ in range(2):
        decision = {"selected": {"policy": "lfu", "params": {}, "label": "lfu"},
                    "baseline": {"policy": "static_hindsight", "params": {}, "label": "static_hindsight"},
                    "reasons": []}  # fmt: skip
        table = apply(decision, sweep, blocks, RULE)
        decisions.append((decision, table))
    (d1, t1), (d2, t2) = decisions
    assert d1 == d2 and t1.equals(t2)
    assert d1["first_part"]["label"] == "lfu" and d1["selected"]["label"] == "transition_prefetch(budget=2)"
    none = rule(predictive={"policies": ["nope"]})
    decision = {**d1, "selected": {"policy": "lfu", "params": {}, "label": "lfu"}, "reasons": []}
    apply(decision, sweep, blocks, none)
    assert decision["selected"]["label"] == "lfu" and "nope: not in the sweep" in decision["reasons"]


def test_failed_limits_and_one_workload_class():
    factors = {(k, t): (f, f) for k, f in (("b1", 0.9), ("b2", 0.8)) for t in ("mr", "ls")}
    sweep, blocks = scenario(factors)
    label = "transition_prefetch(budget=2)"
    # the first part's limits fail for the chosen label at one cell: no longer consistent
    limits = {("ls", 32, label): "link_busy 1.300 > 1"}
    _, summary = evaluate(sweep, blocks, RULE, "lfu", "static_hindsight", limits)
    p = summary["policies"]["transition_prefetch"]
    assert (
        not p["consistent"] and f"transition_prefetch [{label}]: fails limits at ls C=32" in p["reasons"][0]
    )
    # with the "ls" rows relabelled to the workload of "mr", one class is present: consistent, with a note
    one = sweep.set_column(
        sweep.schema.get_field_index("workload"), "workload", pa.array(["multi_request"] * sweep.num_rows)
    )
    one_rule = rule(predictive={"policies": ["transition_prefetch"]}, workloads={"required": None})
    _, summary = evaluate(one, blocks, one_rule, "lfu", "static_hindsight")
    p = summary["policies"]["transition_prefetch"]
    assert p["consistent"] and p["notes"] == [
        "transition_prefetch: judged on one workload class only (['multi_request']): a workload-specific result"
    ]
