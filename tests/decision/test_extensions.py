"""The second part of the decision (moecache/decision/extensions.py) on synthetic sweeps: parameters
chosen on a prefix, judged on held-out tokens and on the other workload; selection flips with the evidence;
every judged policy's capacity- or workload-specific wins are named.

Traces as in test_decide.py: "mr" (multi_request, 12 requests x 2 blocks) and "ls" (long_single, one
request of 30 blocks); capacities 8, 16, 32 with static_hindsight hit rates 0.10 (outside the useful range),
0.50 and 0.90. The reference (first-part selection) is lfu; the predictive policy transition_prefetch has
two parameter sets whose time per block is the reference's times a factor that may differ between the
first and the second half of each trace's tokens, and between traces.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from test_decide import rule, tables

from moecache.decision.decide import BlockIndex
from moecache.decision.extensions import SCHEMA, _prefix_mask, apply, evaluate
from moecache.sim.policy_spec import PolicySpec

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
                groups.append(_group(trace, workload, policy, params, cap, hit, keys, tokens_N, us_N))
    return tables(groups)


def _group(trace, workload, policy, params, cap, hit, keys, tokens_N, us_N) -> dict:
    """One (trace, policy, capacity) group for `tables`: a block per (request, block) key with its tokens
    and time, one transfer of 1000 bytes each."""
    blocks = [(r, b, int(t), float(u), 1, 1000) for (r, b), t, u in zip(keys, tokens_N, us_N, strict=True)]
    return {"trace": trace, "workload": workload, "policy": policy, "params": params,
            "capacity": cap, "hit_rate": hit, "blocks": blocks}  # fmt: skip


RULE = rule(extensions={"policies": ["transition_prefetch"], "prefix_fraction": 0.5})


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
        "params": PolicySpec.of("transition_prefetch", {"budget": 2}).params,
        "label": "transition_prefetch(budget=2)",
    }
    assert summary["wins"] == []  # the selected policy's wins are its generic result, not specific ones
    assert summary["best_generic"]["label"] == "transition_prefetch(budget=2)"


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
    none = rule(extensions={"policies": ["impact"]})  # registered, not swept
    decision = {**d1, "selected": {"policy": "lfu", "params": {}, "label": "lfu"}, "reasons": []}
    apply(decision, sweep, blocks, none)
    assert decision["selected"]["label"] == "lfu" and "impact: not in the sweep" in decision["reasons"]


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
    one_rule = rule(extensions={"policies": ["transition_prefetch"]}, workloads={"required": None})
    _, summary = evaluate(one, blocks, one_rule, "lfu", "static_hindsight")
    p = summary["policies"]["transition_prefetch"]
    assert p["consistent"] and p["notes"] == [
        "transition_prefetch: judged on one workload class only (['multi_request']): a workload-specific result"
    ]


RESET = ("lfu", {"reset_per_request": True})


def every_policy(factors: dict, seed: int = 1):
    """A sweep of static_hindsight (1.05 x lfu), lfu (the reference), lfu reset per request, lru and belady
    (0.5 x: the offline bound, never judged); factors[(policy, params label)][capacity] = time factor
    against lfu, times 1 + uniform(-0.005, 0.005) per block."""
    rng = np.random.default_rng(seed)
    groups = []
    for trace, workload, n_req, n_blk in TRACES:
        tokens_N = rng.integers(5, 20, size=n_req * n_blk)
        ref_N = tokens_N * 1000.0 * rng.uniform(0.8, 1.2, size=tokens_N.shape)
        keys = [(r, b) for r in range(n_req) for b in range(n_blk)]
        for cap, hit in CAPS.items():
            variants = [
                (("static_hindsight", {}), 1.05),
                (("lfu", {}), 1.0),
                (("belady", {"warm": True}), 0.5),
            ]
            variants += [(pp, factors[pp[0], str(pp[1])][cap]) for pp in (RESET, ("lru", {}))]
            for (policy, params), f in variants:
                us_N = ref_N * f * (1 if f == 1.0 else rng.uniform(0.995, 1.005, ref_N.shape))
                groups.append(_group(trace, workload, policy, params, cap, hit, keys, tokens_N, us_N))
    return tables(groups)


def decide_all(factors, **over):
    """The whole decision (both parts, the shipped `extensions: all`) on `every_policy(factors)`."""
    from moecache.decision.decide import decide

    sweep, blocks = every_policy(factors)
    r = rule(**over)  # lfu is the first-part candidate: 1/1.05 - 1 = -4.8% against the baseline: better
    verdicts, decision = decide(sweep, blocks, r, {"mr": 1.0, "ls": 1.0})
    table = apply(decision, sweep, blocks, r, verdicts)
    return decision, table


def test_every_swept_policy_is_judged_and_capacity_specific_wins_are_named():
    # lfu reset per request: 15% faster than lfu at capacity 16, the same at 32; lru: 10% faster at 16,
    # 10% slower at 32. Neither is better in every cell: the first-part selection (lfu) stays.
    decision, table = decide_all({("lfu", str(RESET[1])): {8: 1.0, 16: 0.85, 32: 1.0},
                                  ("lru", "{}"): {8: 1.0, 16: 0.90, 32: 1.10}})  # fmt: skip
    ext = decision["extensions"]
    assert ext["judged"] == ["lfu", "lru"]  # belady excluded, static_hindsight is the baseline's policy
    assert decision["first_part"]["label"] == "lfu" and decision["selected"]["label"] == "lfu"
    assert ext["policies"]["lfu"]["chosen"] == {
        "ls": "lfu(reset_per_request=True)",
        "mr": "lfu(reset_per_request=True)",
    }
    # wins: (policy, trace, split) groups, each at capacity 16 only of the 2 useful capacities
    found = {(w["label"], w["trace"], w["split"]): w for w in decision["wins"]}
    assert set(found) == {
        (label, t, split)
        for label in ("lfu(reset_per_request=True)", "lru")
        for t in ("mr", "ls")
        for split in ("held_out", "other_workload")
    }
    for w in found.values():
        assert w["capacities"] == [16] and w["of_capacities"] == 2 and not w["consistent"]
        (cell,) = w["cells"]
        expected = -0.15 if w["policy"] == "lfu" else -0.10
        assert cell["ci_lo"] <= cell["rel_diff"] <= cell["ci_hi"] < 0
        assert cell["rel_diff"] == pytest.approx(expected, abs=0.01)
    w = found["lru", "mr", "held_out"]
    assert w["policy"] == "lru" and w["params"] == {} and w["reference"] == "lfu"
    assert any(r.startswith("specific win: lru better than lfu on mr (multi_request, held out) at 1 of 2")
               for r in decision["reasons"])  # fmt: skip
    # best generic: reset per request is competitive everywhere (better, equivalent) with mean r < 0;
    # lru is worse at 32
    best = decision["best_generic"]
    assert best["label"] == "lfu(reset_per_request=True)" and best["params"]["reset_per_request"] is True
    assert best["mean_rel_diff"] == pytest.approx(-0.075, abs=0.01) and not best["consistent"]
    assert not ext["policies"]["lru"]["competitive_everywhere"]
    assert set(table["policy"].to_pylist()) == {"lfu", "lru"}


def test_better_everywhere_flips_the_decision_to_the_extension():
    decision, _ = decide_all({("lfu", str(RESET[1])): {8: 1.0, 16: 0.85, 32: 0.9},
                              ("lru", "{}"): {8: 1.0, 16: 0.90, 32: 1.10}})  # fmt: skip
    assert decision["selected"] == {
        "policy": "lfu",
        "params": {"init_counts": None, "reset_per_request": True},
        "label": "lfu(reset_per_request=True)",
    }
    assert decision["first_part"]["label"] == "lfu"
    assert decision["extensions"]["policies"]["lfu"]["consistent"]
    # lru's win at capacity 16 is still named; the selected policy's cells are not "specific"
    assert {w["label"] for w in decision["wins"]} == {"lru"}
    assert json.loads(json.dumps(decision)) == decision


def test_preference_order_among_consistent_policies():
    factors = {
        ("lfu", str(RESET[1])): {8: 1.0, 16: 0.85, 32: 0.9},
        ("lru", "{}"): {8: 1.0, 16: 0.9, 32: 0.95},
    }
    # both better everywhere: the lower mean held-out r (lfu reset: -12.5% against lru's -7.5%) wins...
    decision, _ = decide_all(factors)
    assert decision["selected"]["label"] == "lfu(reset_per_request=True)"
    assert [w["policy"] for w in decision["wins"]] == ["lru"] * 4 and all(
        w["consistent"] for w in decision["wins"]
    )
    # ...unless the rule prefers lru; a preferred policy that is not consistent is passed over
    pref = {"policies": "all", "preference": ["lru"]}
    assert decide_all(factors, extensions=pref)[0]["selected"]["label"] == "lru"
    factors["lru", "{}"][32] = 1.1
    assert decide_all(factors, extensions=pref)[0]["selected"]["label"] == "lfu(reset_per_request=True)"
