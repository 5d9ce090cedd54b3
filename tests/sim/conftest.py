"""Fixtures of the policy tests that run every registered policy."""

from __future__ import annotations

import pytest

from tests.conftest import write_trace


@pytest.fixture(scope="session")
def policy_params(tmp_path_factory):
    """policy_params(name, trace): the parameters a registry-wide test makes policy `name` with for
    `trace`. None but one: profile_static has no default profile, so it gets a profile trace of the
    trace's layers and experts (written once per shape), in which expert e of layer l is used by
    ((e - l) mod E) + 1 tokens: every layer ranks its experts differently and no two tie."""
    folder = tmp_path_factory.mktemp("profiles")
    written: dict[tuple[int, int], str] = {}

    def params(name: str, trace) -> dict:
        if name != "profile_static":
            return {}
        L, E = trace.num_layers, trace.num_experts
        if (L, E) not in written:
            ranks = [r for r in range(E) for _ in range(r + 1)]  # token t's rank: r + 1 tokens of rank r
            steps = [(0, t, layer, [[(r + layer) % E]]) for t, r in enumerate(ranks) for layer in range(L)]
            written[(L, E)] = str(write_trace(folder / f"profile_{L}x{E}.parquet", steps, L, E))
        return {"profile": written[(L, E)]}

    return params
