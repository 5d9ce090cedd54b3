"""Shared test helpers: small synthetic traces written as lists of layer steps.

A trace is a list of layer steps `(request, step, layer, [[experts of token 0], [experts of token 1],
...])` in canonical order (request, step, layer). A forward step (request, step) with one token is a
decode step, with several a prefill step; every layer of one forward step should list the same
number of tokens. `request` is any value (its str() becomes the request id).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moecache.sim.trace_arrays import TraceArrays, from_table
from moecache.trace.schema import SCHEMA, TraceMeta, empty_cache_columns, schema_with_meta

# Composed configs are cached on disk (moecache/compose_cache.py): the test session, and every CLI process
# it starts, uses a cache folder of its own instead of the user's.
os.environ.setdefault("MOECACHE_COMPOSE_CACHE", tempfile.mkdtemp(prefix="moecache-compose-"))


def trace_table(steps, num_layers: int, num_experts: int, top_k: int | None = None, expert_bytes: int = 1024):
    """The canonical trace table (every SCHEMA column) and its TraceMeta."""
    if top_k is None:
        top_k = max((len(tok) for *_, tokens in steps for tok in tokens), default=1)
    meta = TraceMeta(num_layers, num_experts, top_k, expert_bytes, model="synthetic", source="tests")
    rows = {
        name: [] for name in ("request_id", "step_index", "token_index", "phase", "layer_id", "expert_ids")
    }
    first_token: dict[tuple, int] = {}  # (request, step) -> its first token's index in the request
    next_token: dict = {}  # request -> tokens of its forward steps seen so far
    for request, step, layer, tokens in steps:
        fwd = (str(request), step)
        if fwd not in first_token:
            first_token[fwd] = next_token.get(fwd[0], 0)
            next_token[fwd[0]] = first_token[fwd] + len(tokens)
        for i, experts in enumerate(tokens):
            rows["request_id"].append(fwd[0])
            rows["step_index"].append(step)
            rows["token_index"].append(first_token[fwd] + i)
            rows["phase"].append("decode" if len(tokens) == 1 else "prefill")
            rows["layer_id"].append(layer)
            rows["expert_ids"].append(list(experts))
    n = len(rows["request_id"])
    columns = {
        "run_id": pa.array(["synthetic"] * n, pa.string()),
        "request_id": pa.array(rows["request_id"], pa.string()),
        "step_index": pa.array(rows["step_index"], pa.int32()),
        "token_index": pa.array(rows["token_index"], pa.int32()),
        "phase": pa.array(rows["phase"], pa.string()),
        "layer_id": pa.array(rows["layer_id"], pa.int16()),
        "expert_ids": pa.array(rows["expert_ids"], pa.list_(pa.int16())),
        "router_weights": pa.array(
            [[1.0 / len(e)] * len(e) for e in rows["expert_ids"]], pa.list_(pa.float32())
        ),
        **empty_cache_columns(n),
    }
    schema = schema_with_meta(meta)
    return pa.Table.from_arrays([columns[f.name] for f in SCHEMA], schema=schema), meta


def build_trace(steps, num_layers: int, num_experts: int, top_k: int | None = None, **kw) -> TraceArrays:
    """TraceArrays of `steps` (see the module docstring)."""
    table, meta = trace_table(steps, num_layers, num_experts, top_k)
    return from_table(table, meta, **kw)


def write_trace(path: Path, steps, num_layers: int, num_experts: int, top_k: int | None = None) -> Path:
    """Write `steps` as a canonical trace Parquet file."""
    table, _ = trace_table(steps, num_layers, num_experts, top_k)
    pq.write_table(table, path)
    return path


def decode_steps(keys_per_token, request=0, layer=0):
    """One-layer decode steps: token i selects keys_per_token[i] (a list of experts)."""
    return [(request, i, layer, [list(e)]) for i, e in enumerate(keys_per_token)]


@pytest.fixture(scope="session")
def make_trace():
    """build_trace, as a fixture: make_trace(steps, num_layers, num_experts, top_k=None)."""
    return build_trace


@pytest.fixture(scope="session")
def make_trace_file():
    """write_trace, as a fixture: make_trace_file(path, steps, num_layers, num_experts, top_k=None)."""
    return write_trace


def write_esft_npz(
    path: Path, layers: int, experts: int, top_k: int, seq_lens, seed: int = 0, random_weights: bool = False
) -> Path:
    """An ESFT-format routing file (the `import-trace` input) with skewed routing, so that caches have
    something to find: expert e is drawn with probability proportional to (experts - e)^2."""
    rng = np.random.default_rng(seed)
    p = np.arange(experts, 0, -1, dtype=float) ** 2
    p /= p.sum()
    ids = np.stack(
        [
            [rng.choice(experts, top_k, replace=False, p=p) for _ in range(layers)]
            for _ in range(sum(seq_lens))
        ]
    )
    weights = rng.random(ids.shape) if random_weights else np.full(ids.shape, 1.0 / top_k)
    np.savez(
        path,
        expert_ids=ids.astype(np.int8),
        gate_weights=weights.astype(np.float16),
        seq_offsets=np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int64),
    )
    return path


@pytest.fixture(scope="session")
def make_esft_npz():
    """write_esft_npz, as a fixture."""
    return write_esft_npz


ESFT_LAW = (
    Path(__file__).resolve().parents[1] / "../shared/data/traces/deepseek-v2-lite-esft/esft_law_routing.npz"
)


@pytest.fixture(scope="session")
def esft_law_trace() -> TraceArrays:
    """The real DeepSeek-V2-Lite esft_law routing trace (8,327 tokens, 26 layers x 64 experts, top-6,
    one token per step) as TraceArrays; the test is skipped where ../shared is absent."""
    from moecache.trace.esft_import import esft_to_table, load_esft_npz

    if not ESFT_LAW.is_file():
        pytest.skip("../shared/data is not present")
    meta = TraceMeta(num_layers=26, num_experts=64, top_k=6, expert_bytes=17301504)
    arrays = load_esft_npz(ESFT_LAW, num_layers=26, num_experts=64, top_k=6)
    table = esft_to_table(arrays, name="esft_law", run_id="esft_law", tokens_per_step=1, meta=meta)
    return from_table(table, meta, name="esft_law")
