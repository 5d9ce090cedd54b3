"""The decision on synthetic sweeps (moecache/decision/decide.py): a hand-computed cell, and the selection
flipping with the evidence.

`tables(groups)` builds sweep.parquet and per_block.parquet from explicit blocks; `scenario(...)` builds a
two-workload sweep: trace "mr" (workload multi_request, 12 requests x 2 blocks: request units) and trace
"ls" (long_single, 1 request x 30 blocks: block units), capacities 8, 16, 32 with baseline hit rates
0.10 (outside the useful range [0.2, 0.95]), 0.50 and 0.90, the baseline static_hindsight, the candidate
lfu (`factor` x the baseline's time on every block, times 1 + uniform(-noise, noise)) and lru, a label
that is not a candidate (1.3 x the baseline). Rows of another mode and of a scaled bandwidth, where the
candidate is 3 x slower, must be ignored.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from moecache.decision.bootstrap import paired_ratio_bootstrap
from moecache.decision.decide import VERDICT_SCHEMA, cell_seed, decide
from moecache.decision.rule import Rule
from moecache.errors import MoecacheError

BASE = ("static_hindsight", {})
LFU = ("lfu", {})
LRU = ("lru", {})
DECAY = ("lfu_decay", {"half_life_tokens": 64})
CAPS = (8, 16, 32)
BASE_HIT = {8: 0.10, 16: 0.50, 32: 0.90}
COPY_US = {"mr": 10.0, "ls": 10.0}
LFU_PARAMS = {"init_counts": None, "reset_per_request": False}  # lfu {} with the class's defaults


def label_of(policy, params) -> str:
    inner = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
    return f"{policy}({inner})" if inner else policy


def tables(groups: list[dict]) -> tuple[pa.Table, pa.Table]:
    """groups: dicts with trace, workload, policy, params, capacity, hit_rate, blocks [(request, block,
    tokens, est_us, transfers, h2d_bytes)], optionally mode (default timed) and bandwidth_scale (1.0).
    The sweep row's totals are the sums of its blocks."""
    sweep, blocks = [], []
    for g in groups:
        key = {
            "trace": g["trace"],
            "workload": g["workload"],
            "label": label_of(g["policy"], g["params"]),
            "mode": g.get("mode", "timed"),
            "capacity": g["capacity"],
            "bandwidth_scale": g.get("bandwidth_scale", 1.0),
            "cpu_scale": 1.0,
            "gpu_scale": 1.0,
        }
        cols = list(zip(*g["blocks"], strict=True))
        tokens, est_us, transfers, h2d = (sum(c) for c in cols[2:])
        sweep.append(
            {
                **key,
                "policy": g["policy"],
                "params": json.dumps(g["params"], sort_keys=True),
                "tokens": tokens,
                "hit_rate": g["hit_rate"],
                "h2d_bytes": h2d,
                "transfers": transfers,
                "est_total_ms": est_us / 1e3,
                "est_ms_per_token": est_us / 1e3 / tokens,
            }
        )
        for r, b, tok, us, tr, by in g["blocks"]:
            blocks.append(
                {
                    **key,
                    "request": r,
                    "block": b,
                    "tokens": tok,
                    "accesses": 10 * tok,
                    "hits": 5 * tok,
                    "transfers": tr,
                    "h2d_bytes": by,
                    "est_us": us,
                }
            )
    return pa.Table.from_pylist(sweep), pa.Table.from_pylist(blocks)


def scenario(
    factor: float,
    noise: float = 0.0,
    traces=(("mr", "multi_request", 12, 2), ("ls", "long_single", 1, 30)),
    cand_transfers_per_token: int = 2,
    cand_hit_delta: float = 0.0,
    base_hit: dict | None = None,
    seed: int = 0,
):
    rng = np.random.default_rng(seed)
    base_hit = base_hit or BASE_HIT
    groups = []
    for trace, workload, n_req, n_blk in traces:
        tokens_RB = rng.integers(1, 20, size=(n_req, n_blk))
        base_RB = tokens_RB * 1000.0 * rng.uniform(0.5, 1.5, size=(n_req, n_blk))  # ~1 ms per token
        for cap in CAPS:
            cand_RB = base_RB * factor * (1 + rng.uniform(-noise, noise, size=base_RB.shape))
            variants = [
                (BASE, base_RB, base_hit[cap], 2, {}),
                (LFU, cand_RB, base_hit[cap] + cand_hit_delta, cand_transfers_per_token, {}),
                (LRU, 1.3 * base_RB, base_hit[cap], 2, {}),
                (LFU, 3.0 * base_RB, base_hit[cap], 2, {"mode": "instant"}),
                (LFU, 3.0 * base_RB, base_hit[cap], 2, {"bandwidth_scale": 2.0}),
                (BASE, base_RB, base_hit[cap], 2, {"bandwidth_scale": 2.0}),
            ]
            for (policy, params), us_RB, hit, tr_per_tok, extra in variants:
                blocks = [
                    (r, b, int(tokens_RB[r, b]), float(us_RB[r, b]), tr_per_tok * int(tokens_RB[r, b]), 0)
                    for r in range(n_req)
                    for b in range(n_blk)
                ]
                blocks = [(*x[:5], 1000 * x[4]) for x in blocks]  # h2d_bytes = transfers x 1000 B
                groups.append(
                    {
                        "trace": trace,
                        "workload": workload,
                        "policy": policy,
                        "params": params,
                        "capacity": cap,
                        "hit_rate": hit,
                        "blocks": blocks,
                        **extra,
                    }
                )
    return tables(groups)


def rule(**over) -> Rule:
    d = {
        "baseline": {"policy": "static_hindsight", "params": {}},
        "candidates": [{"policy": "lfu", "params": {}}],
        "mode": "timed",
        "margin": 0.02,
        "confidence": 0.9,
        "bootstrap": {"resamples": 1000, "min_requests": 8},
        "useful_range": {"baseline_hit_rate": [0.2, 0.95]},
        "hit_rate": {"max_deficit": 0.05},
        "transfers": {"max_bytes_per_token": None, "max_link_busy": 1.0},
        "workloads": {"required": ["multi_request", "long_single"]},
        "seed": 0,
    }
    d.update(over)
    return Rule.from_dict(d)


def rows(table: pa.Table, **where) -> list[dict]:
    return [r for r in table.to_pylist() if all(r[k] == v for k, v in where.items())]


def test_hand_computed_cell():
    # Trace "t": 2 requests of one block each; min_requests 2 -> units are requests (2 units).
    # baseline: tokens [2, 3], est_us [2000, 3000] -> 5000 us / 1000 / 5 tokens = 1.0 ms/token
    # lfu:      est_us [2200, 3300] (+10% on each unit) -> 5500 / 1000 / 5 = 1.1 -> r = 1.1 / 1.0 - 1 = 0.1;
    #           every resample scales both alike -> CI [0.1, 0.1] -> lo > 0 and hi >= 0.02: worse.
    #           transfers [1, 4], h2d [100, 400] -> bytes_per_token 500 / 5 = 100;
    #           link_busy = 5 transfers x 10 us / 5500 us = 0.0090909...
    #           hit_rate 0.40 < 0.50 - 0.05 = 0.45 -> fails the hit-rate limit.
    common = {"trace": "t", "workload": "w", "capacity": 4}
    sweep, blocks = tables(
        [
            {**common, "policy": "static_hindsight", "params": {}, "hit_rate": 0.5, "blocks": [
                (0, 0, 2, 2000.0, 1, 100), (1, 0, 3, 3000.0, 1, 100)]},
            {**common, "policy": "lfu", "params": {}, "hit_rate": 0.4, "blocks": [
                (0, 0, 2, 2200.0, 1, 100), (1, 0, 3, 3300.0, 4, 400)]},
        ]
    )  # fmt: skip
    verdicts, decision = decide(
        sweep, blocks, rule(bootstrap={"resamples": 200, "min_requests": 2}, workloads={"required": None}),
        {"t": 10.0},
    )  # fmt: skip
    assert verdicts.schema == VERDICT_SCHEMA
    (v,) = verdicts.to_pylist()
    assert v["label"] == "lfu" and v["role"] == "candidate" and v["workload"] == "w"
    assert (v["unit"], v["units"]) == ("request", 2)
    assert v["metric"] == pytest.approx(1.1) and v["baseline_metric"] == pytest.approx(1.0)
    assert v["rel_diff"] == pytest.approx(0.1)
    assert v["ci_lo"] == pytest.approx(0.1) and v["ci_hi"] == pytest.approx(0.1)
    assert v["verdict"] == "worse" and v["competitive"] is False
    assert v["hit_rate"] == 0.4 and v["baseline_hit_rate"] == 0.5
    assert v["bytes_per_token"] == pytest.approx(100.0)
    assert v["link_busy"] == pytest.approx(50 / 5500)
    assert v["passes_limits"] is False and v["reasons"] == "hit_rate 0.400 < baseline 0.500 - 0.05"
    assert v["in_useful_range"] is True
    assert decision["selected"]["label"] == "static_hindsight"
    assert decision["competitive"] == {"lfu": False}
    assert "lfu: worse at t C=4 (r=+0.100, CI [+0.100, +0.100])" in decision["reasons"]
    assert decision["cells"] == 1


def test_clearly_worse_keeps_the_baseline():
    sweep, blocks = scenario(factor=1.10, noise=0.01)
    verdicts, decision = decide(sweep, blocks, rule(), COPY_US)
    useful = rows(verdicts, label="lfu", in_useful_range=True)
    assert len(useful) == 4  # 2 traces x capacities 16, 32
    assert {v["verdict"] for v in useful} == {"worse"}
    assert decision["selected"] == {"policy": "static_hindsight", "params": {}, "label": "static_hindsight"}
    assert decision["competitive"] == {"lfu": False}
    assert any(r.startswith("lfu: worse at mr C=16 (r=+0.") for r in decision["reasons"])
    assert decision["reasons"][-1] == "no candidate is competitive: keeping the baseline static_hindsight"


def test_units_roles_and_useful_range_per_cell():
    sweep, blocks = scenario(factor=1.0)
    verdicts, decision = decide(sweep, blocks, rule(), COPY_US)
    # 2 traces x 3 capacities x 2 non-baseline labels (lfu, lru); the instant and scaled rows are ignored
    assert verdicts.num_rows == 12
    assert {(v["unit"], v["units"]) for v in rows(verdicts, trace="mr")} == {("request", 12)}
    assert {(v["unit"], v["units"]) for v in rows(verdicts, trace="ls")} == {("block", 30)}
    assert {v["role"] for v in rows(verdicts, label="lfu")} == {"candidate"}
    assert {v["role"] for v in rows(verdicts, label="lru")} == {"other"}
    assert [v["in_useful_range"] for v in rows(verdicts, trace="mr", label="lru")] == [False, True, True]
    # lru is 1.3 x the baseline on every block: r = 0.3 with a zero-width interval
    for v in rows(verdicts, label="lru"):
        assert v["rel_diff"] == pytest.approx(0.3) and v["verdict"] == "worse"
    # identical candidate: r = 0 exactly, CI [0, 0] -> equivalent
    assert {(v["rel_diff"], v["ci_lo"], v["ci_hi"], v["verdict"]) for v in rows(verdicts, label="lfu")} == {
        (0.0, 0.0, 0.0, "equivalent")
    }
    assert decision["cells"] == 4
    assert decision["workloads"] == {
        "present": ["multi_request", "long_single"],
        "required": ["multi_request", "long_single"],
        "swept": ["multi_request", "long_single"],
    }


def test_equivalent_within_noise_selects_the_candidate():
    sweep, blocks = scenario(factor=1.0, noise=0.005)
    verdicts, decision = decide(sweep, blocks, rule(), COPY_US)
    useful = rows(verdicts, label="lfu", in_useful_range=True)
    assert {v["verdict"] for v in useful} == {"equivalent"}
    assert all(abs(v["ci_lo"]) < 0.02 and abs(v["ci_hi"]) < 0.02 for v in useful)
    assert decision["selected"] == {"policy": "lfu", "params": LFU_PARAMS, "label": "lfu"}
    assert decision["competitive"] == {"lfu": True}
    assert any(
        r.startswith("lfu: competitive in all 4 useful cells (equivalent 4)") for r in decision["reasons"]
    )
    assert decision["reasons"][-1] == "selected lfu: the first competitive candidate"


def test_clearly_better_selects_the_candidate():
    sweep, blocks = scenario(factor=0.90, noise=0.01)
    verdicts, decision = decide(sweep, blocks, rule(), COPY_US)
    useful = rows(verdicts, label="lfu", in_useful_range=True)
    assert {v["verdict"] for v in useful} == {"better"}
    assert all(-0.11 < v["ci_lo"] <= v["rel_diff"] <= v["ci_hi"] < -0.09 for v in useful)
    assert decision["selected"]["label"] == "lfu"
    assert any("(better 4)" in r for r in decision["reasons"])


def test_too_many_bytes_per_token_rejects_a_faster_candidate():
    # baseline: 2 transfers x 1000 B per token = 2000 B/token; candidate: 10 x 1000 = 10000 > 5000
    sweep, blocks = scenario(factor=0.90, noise=0.01, cand_transfers_per_token=10)
    r = rule(transfers={"max_bytes_per_token": 5000, "max_link_busy": 1.0})
    verdicts, decision = decide(sweep, blocks, r, COPY_US)
    useful = rows(verdicts, label="lfu", in_useful_range=True)
    assert {v["verdict"] for v in useful} == {"better"}
    assert {v["bytes_per_token"] for v in useful} == {10000.0}
    assert all(v["passes_limits"] is False and v["reasons"] == "bytes_per_token 1e+04 > 5000" for v in useful)
    assert decision["selected"]["label"] == "static_hindsight"
    assert "lfu: fails limits at ls C=32 (bytes_per_token 1e+04 > 5000)" in decision["reasons"]
    # the same sweep without the bound selects it
    assert decide(sweep, blocks, rule(), COPY_US)[1]["selected"]["label"] == "lfu"


def test_link_busy_and_hit_rate_limits():
    sweep, blocks = scenario(factor=0.90, cand_hit_delta=-0.06)
    # link_busy = transfers x copy_us / est_us = 2 per token x 600 us / (~900 us per token) > 1
    verdicts, decision = decide(sweep, blocks, rule(), {"mr": 600.0, "ls": 600.0})
    v = rows(verdicts, label="lfu", trace="mr", capacity=16)[0]
    assert v["link_busy"] > 1.0 and v["passes_limits"] is False
    assert v["reasons"] == f"hit_rate 0.440 < baseline 0.500 - 0.05; link_busy {v['link_busy']:.3f} > 1"
    assert decision["selected"]["label"] == "static_hindsight"
    # a deficit of 0.04 passes the hit-rate limit; a small copy time passes the link limit
    sweep, blocks = scenario(factor=0.90, cand_hit_delta=-0.04)
    assert decide(sweep, blocks, rule(), COPY_US)[1]["selected"]["label"] == "lfu"


def test_missing_required_workload_blocks_every_candidate():
    sweep, blocks = scenario(factor=0.90, traces=(("mr", "multi_request", 12, 2),))
    _, decision = decide(sweep, blocks, rule(), COPY_US)
    assert decision["selected"]["label"] == "static_hindsight"
    assert decision["competitive"] == {"lfu": False}
    assert "workload long_single: no trace" in decision["reasons"]
    assert decision["workloads"]["present"] == ["multi_request"]
    # required: null -> the workloads present; the same evidence selects the candidate
    _, decision = decide(sweep, blocks, rule(workloads={"required": None}), COPY_US)
    assert decision["selected"]["label"] == "lfu"
    assert decision["workloads"]["required"] == ["multi_request"]


def test_workload_without_a_useful_cell_counts_as_missing():
    # every baseline hit rate of both traces is outside [0.6, 0.95] except capacity 32 (0.90)
    sweep, blocks = scenario(factor=0.90, traces=(("mr", "multi_request", 12, 2),))
    sweep2, blocks2 = scenario(
        factor=0.90, traces=(("ls", "long_single", 1, 30),), base_hit={8: 0.1, 16: 0.2, 32: 0.3}
    )
    sweep, blocks = pa.concat_tables([sweep, sweep2]), pa.concat_tables([blocks, blocks2])
    _, decision = decide(sweep, blocks, rule(useful_range={"baseline_hit_rate": [0.6, 0.95]}), COPY_US)
    assert (
        "workload long_single: no capacity with the baseline hit rate in [0.6, 0.95]" in decision["reasons"]
    )
    assert decision["selected"]["label"] == "static_hindsight"
    assert decision["cells"] == 1  # mr C=32 only


def test_no_useful_cell_means_nothing_is_competitive():
    sweep, blocks = scenario(factor=0.90)
    verdicts, decision = decide(
        sweep,
        blocks,
        rule(useful_range={"baseline_hit_rate": [0.96, 1.0]}, workloads={"required": None}),
        COPY_US,
    )
    assert not any(verdicts["in_useful_range"].to_pylist())
    assert decision["cells"] == 0 and decision["competitive"] == {"lfu": False}
    assert decision["reasons"][0].startswith(
        "no (trace, capacity) cell has the baseline hit rate in [0.96, 1]"
    )
    assert decision["selected"]["label"] == "static_hindsight"


def test_first_competitive_candidate_in_order_of_preference():
    sweep, blocks = scenario(factor=1.10)  # lfu worse
    sweep_d, blocks_d = scenario(factor=0.9)
    # lfu_decay(half_life_tokens=64): the "lfu" rows of a second scenario (better), relabelled
    decay = sweep_d.filter(pa.compute.equal(sweep_d["policy"], "lfu"))
    decay = decay.set_column(
        decay.schema.get_field_index("policy"), "policy", pa.array(["lfu_decay"] * len(decay))
    )
    decay = decay.set_column(
        decay.schema.get_field_index("params"), "params", pa.array(['{"half_life_tokens": 64}'] * len(decay))
    )
    decay = decay.set_column(
        decay.schema.get_field_index("label"),
        "label",
        pa.array(["lfu_decay(half_life_tokens=64)"] * len(decay)),
    )
    decay_blocks = blocks_d.filter(pa.compute.equal(blocks_d["label"], "lfu"))
    decay_blocks = decay_blocks.set_column(
        decay_blocks.schema.get_field_index("label"),
        "label",
        pa.array(["lfu_decay(half_life_tokens=64)"] * len(decay_blocks)),
    )
    # the two scenarios share the seed, so the traces' blocks (tokens, baseline times) are the same
    sweep, blocks = pa.concat_tables([sweep, decay]), pa.concat_tables([blocks, decay_blocks])
    both = [{"policy": "lfu", "params": {}}, {"policy": "lfu_decay", "params": {"half_life_tokens": 64}}]
    _, decision = decide(sweep, blocks, rule(candidates=both), COPY_US)
    assert decision["competitive"] == {"lfu": False, "lfu_decay(half_life_tokens=64)": True}
    assert decision["selected"] == {
        "policy": "lfu_decay",
        "params": {"half_life_tokens": 64},
        "label": "lfu_decay(half_life_tokens=64)",
    }
    _, decision = decide(sweep, blocks, rule(candidates=both[::-1]), COPY_US)
    assert decision["selected"]["label"] == "lfu_decay(half_life_tokens=64)"


def test_same_config_same_result_and_the_seed_matters():
    sweep, blocks = scenario(factor=1.0, noise=0.01)
    a, da = decide(sweep, blocks, rule(), COPY_US)
    b, db = decide(sweep, blocks, rule(), COPY_US)
    assert a.equals(b) and da == db
    c, _ = decide(sweep, blocks, rule(seed=1), COPY_US)
    assert a["rel_diff"].equals(c["rel_diff"]) and not a["ci_lo"].equals(c["ci_lo"])
    # a cell's result does not depend on the other traces of the sweep
    only_ls = [t.filter(pa.compute.equal(t["trace"], "ls")) for t in (sweep, blocks)]
    d, _ = decide(*only_ls, rule(), COPY_US)
    assert d.to_pylist() == [r for r in a.to_pylist() if r["trace"] == "ls"]


def test_a_cell_is_the_bootstrap_of_its_blocks_with_the_cell_seed():
    sweep, blocks = scenario(factor=1.0, noise=0.01)
    verdicts, _ = decide(sweep, blocks, rule(), COPY_US)
    # trace ls (1 request: block units), capacity 16: the 30 blocks of the baseline and of lfu, in block order
    cell = {
        (r["label"], r["block"]): r
        for r in rows(blocks, trace="ls", capacity=16, mode="timed", bandwidth_scale=1.0)
    }
    num_PU = [[cell[(label, b)]["est_us"] for b in range(30)] for label in ("static_hindsight", "lfu")]
    den_PU = [[cell[(label, b)]["tokens"] for b in range(30)] for label in ("static_hindsight", "lfu")]
    rel, lo, hi = paired_ratio_bootstrap(num_PU, den_PU, 0, 1000, cell_seed(0, "ls", 16), 0.9)
    v = rows(verdicts, trace="ls", capacity=16, label="lfu")[0]
    assert (v["rel_diff"], v["ci_lo"], v["ci_hi"]) == (rel[1], lo[1], hi[1])
    # the seeds of two cells differ, and they are not the rule's seed itself
    assert (
        cell_seed(0, "ls", 16).generate_state(2).tolist() != cell_seed(0, "ls", 32).generate_state(2).tolist()
    )
    assert (
        cell_seed(0, "ls", 16).generate_state(2).tolist() != cell_seed(0, "mr", 16).generate_state(2).tolist()
    )
    assert v["ci_lo"] != rows(verdicts, trace="ls", capacity=32, label="lfu")[0]["ci_lo"]


def test_single_unit_is_inconclusive():
    sweep, blocks = scenario(factor=1.10, traces=(("one", "long_single", 1, 1),))
    verdicts, decision = decide(sweep, blocks, rule(workloads={"required": None}), {"one": 1.0})
    v = rows(verdicts, label="lfu", capacity=16)[0]
    assert (
        v["units"] == 1 and v["rel_diff"] == pytest.approx(0.1) and v["ci_lo"] == v["ci_hi"] == v["rel_diff"]
    )
    assert v["verdict"] == "inconclusive" and v["reasons"] == "fewer than 2 units" and v["passes_limits"]
    assert "lfu: inconclusive at one C=16 (fewer than 2 units)" in decision["reasons"]
    assert decision["selected"]["label"] == "static_hindsight"


def test_decision_dict_keys_and_json():
    sweep, blocks = scenario(factor=1.0)
    r = rule()
    _, decision = decide(sweep, blocks, r, COPY_US)
    assert list(decision) == [
        "selected",
        "baseline",
        "competitive",
        "reasons",
        "rule",
        "workloads",
        "cells",
        "seed",
    ]
    assert decision["baseline"] == {"policy": "static_hindsight", "params": {}, "label": "static_hindsight"}
    assert decision["rule"] == r.to_dict() and decision["seed"] == 0
    assert json.loads(json.dumps(decision)) == decision


def test_errors_name_the_fault():
    sweep, blocks = scenario(factor=1.0)
    with pytest.raises(
        MoecacheError,
        match=r"decide.candidates\[0\]: lfu_window \{\"window_tokens\": 8\} is not in the sweep",
    ):
        decide(
            sweep,
            blocks,
            rule(candidates=[{"policy": "lfu_window", "params": {"window_tokens": 8}}]),
            COPY_US,
        )
    with pytest.raises(MoecacheError, match=r"decide.candidates\[0\]: lfu \{\"x\": 1\}: unknown parameter"):
        decide(sweep, blocks, rule(candidates=[{"policy": "lfu", "params": {"x": 1}}]), COPY_US)
    # a label is only a join key: one label for two policies is refused, never guessed
    relabelled = sweep.set_column(
        sweep.schema.get_field_index("label"), "label",
        pa.array(["lfu" if x == "lru" else x for x in sweep["label"].to_pylist()]),
    )  # fmt: skip
    with pytest.raises(MoecacheError, match="label 'lfu' names two policies"):
        decide(relabelled, blocks, rule(), COPY_US)
    with pytest.raises(MoecacheError, match="copy_us: no copy time for trace 'ls'"):
        decide(sweep, blocks, rule(), {"mr": 1.0})
    null_blocks = blocks.set_column(
        blocks.schema.get_field_index("est_us"), "est_us", pa.nulls(blocks.num_rows, pa.float64())
    )
    with pytest.raises(MoecacheError, match="est_us is null for trace 'mr'"):
        decide(sweep, null_blocks, rule(), COPY_US)
    with pytest.raises(MoecacheError, match=r"per_block.parquet: missing column\(s\) \['est_us'\]"):
        decide(sweep, blocks.drop_columns(["est_us"]), rule(), COPY_US)
    lfu_missing = blocks.filter(pa.compute.invert(pa.compute.equal(blocks["label"], "lfu")))
    with pytest.raises(MoecacheError, match="no blocks for trace 'mr' label 'lfu' capacity 8"):
        decide(sweep, lfu_missing, rule(), COPY_US)
    with pytest.raises(MoecacheError, match="no blocks for trace 'mr' label 'static_hindsight' capacity 8"):
        decide(sweep, blocks.filter(pa.compute.equal(blocks["mode"], "instant")), rule(), COPY_US)
    r = rule()
    object.__setattr__(r, "metric", "est_tokens_per_s")
    with pytest.raises(MoecacheError, match="decide.metric='est_tokens_per_s'"):
        decide(sweep, blocks, r, COPY_US)
