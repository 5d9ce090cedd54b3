"""Hypothesis strategies, a hand-made cost model and the compiled-vs-oracle check shared by the
policy tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from moecache.sim.cost_model import CostModel
from moecache.sim.policy import make_policy
from moecache.sim.replay import replay_instant
from tests.sim.reference import reference_run


@st.composite
def small_traces(draw, max_steps: int = 40):
    """Steps for make_trace: <= 3 layers, <= 6 experts, top-k <= 3, <= max_steps layer steps, 1-3
    requests, forward steps of 1-3 tokens whose tokens select 1..top_k experts."""
    num_layers = draw(st.integers(1, 3))
    num_experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, min(3, num_experts)))
    steps = []
    num_requests = draw(st.integers(1, 3))
    for request in range(num_requests):
        for step in range(draw(st.integers(1, max_steps // (num_layers * num_requests)))):
            tokens = draw(st.sampled_from([1, 1, 1, 2, 3]))
            for layer in range(num_layers):
                steps.append((request, step, layer, [
                    draw(st.permutations(range(num_experts)))[: draw(st.integers(1, top_k))]
                    for _ in range(tokens)
                ]))  # fmt: skip
    return steps, num_layers, num_experts, top_k


def assert_matches_reference(trace, name: str, params: dict, cost=None) -> None:
    """The compiled policy equals its plain-Python oracle (hits, admissions, evictions) at every
    capacity; `cost`: the CostModel of a cost-aware policy (bound to both)."""
    extra = {"cost": cost} if cost is not None else {}
    for capacity in range(trace.num_keys + 1):
        policy = make_policy(name, **params)
        if cost is not None:
            policy.bind_cost(cost)
        got = replay_instant(trace, policy, capacity)
        ref = reference_run(trace, name, capacity, **extra, **params)
        assert np.array_equal(got.hit_A, ref.hit_A), f"{name} {params} capacity {capacity}"
        assert int(got.admits_V.sum()) == ref.admissions, f"{name} {params} capacity {capacity}"
        assert int(got.evicts_V.sum()) == ref.evictions, f"{name} {params} capacity {capacity}"


def hand_cost(
    cpu=(0, 6, 9, 11, 12), gpu=(0, 1, 1.5, 2, 2.5), latency=2.0, bandwidth=128.0, **kw
) -> CostModel:
    """A CostModel of round numbers (microseconds per expert call on M = 0, 1, 2, ... tokens);
    expert_bytes 1024 (the conftest builder's): a copy takes 2 + 1024 / 128 = 10 us."""
    return CostModel(
        copy_latency_us=latency,
        bandwidth_bytes_per_us=bandwidth,
        expert_bytes=1024,
        cpu_us_M=np.array(cpu, float),
        gpu_us_M=np.array(gpu, float),
        **kw,
    )


def skewed_trace(make_trace, seed=0, requests=3, tokens=10, layers=3, experts=6, top_k=2, prefill=3):
    """Requests of one prefill step of `prefill` tokens, then decode steps; routing skewed towards low
    expert ids (probability 1/rank), `top_k` distinct experts per token."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1)
    p /= p.sum()
    steps = []
    for r in range(requests):
        for step, n in enumerate([prefill] + [1] * (tokens - prefill)):
            for layer in range(layers):
                toks = [list(rng.choice(experts, top_k, replace=False, p=p)) for _ in range(n)]
                steps.append((f"r{r}", step, layer, toks))
    return make_trace(steps, layers, experts, top_k)
