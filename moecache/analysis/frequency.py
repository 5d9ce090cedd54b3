"""How often each expert is selected, and how concentrated the selections are.

Legend: T tokens, L MoE layers, K experts chosen per token and layer (top-k), E experts per layer,
N keys of a scope (L*E for the whole trace, E for one layer). The key of (layer l, expert e) is l * E + e.

Tables (see the issue-4 spec): `frequency_table` -> frequency.parquet, `concentration_table` ->
concentration.parquet.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import pyarrow as pa

from moecache.analysis.schema import F64, I64, STR, schema
from moecache.analysis.tokens import TokenTrace
from moecache.errors import MoecacheError

FREQUENCY_SCHEMA = schema(trace=STR, layer=I64, expert=I64, count=I64, share=F64, global_rank=I64)

# the fraction whose cover placement defines global_top_share and the per-layer cover summary
PLACEMENT_FRACTION = 0.8


def keys_TLK(tt: TokenTrace) -> np.ndarray:
    """int64 [T, L, K]: the key l * E + e of every selection."""
    layer_offset = np.arange(tt.num_layers, dtype=np.int64)[None, :, None] * tt.num_experts
    return tt.expert_TLK.astype(np.int64) + layer_offset


def expert_counts(tt: TokenTrace) -> np.ndarray:
    """int64 [L, E]: how many times each (layer, expert) was selected."""
    n = tt.num_layers * tt.num_experts
    counts_N = np.bincount(keys_TLK(tt).ravel(), minlength=n)
    return counts_N.astype(np.int64).reshape(tt.num_layers, tt.num_experts)


def order_by_count(counts_N: np.ndarray) -> np.ndarray:
    """int64 [N]: the keys by count descending, then key ascending (the hindsight-static order)."""
    return np.argsort(-np.asarray(counts_N, np.int64), kind="stable")


def frequency_table(tt: TokenTrace) -> pa.Table:
    """One row per (layer, expert), zero counts included: count, share of the layer's selections,
    global_rank (1 = most selected key over all layers; ties: lower key first)."""
    L, E = tt.num_layers, tt.num_experts
    counts_LE = expert_counts(tt)
    layer_total_L = counts_LE.sum(axis=1)
    share_LE = counts_LE / np.maximum(layer_total_L, 1)[:, None]
    share_valid_LE = np.broadcast_to((layer_total_L > 0)[:, None], (L, E))
    rank_N = np.empty(L * E, np.int64)
    rank_N[order_by_count(counts_LE.ravel())] = np.arange(1, L * E + 1)
    return pa.table(
        {
            "trace": pa.array([tt.name] * (L * E), pa.string()),
            "layer": np.repeat(np.arange(L, dtype=np.int64), E),
            "expert": np.tile(np.arange(E, dtype=np.int64), L),
            "count": counts_LE.ravel(),
            "share": pa.array(share_LE.ravel(), pa.float64(), mask=~share_valid_LE.ravel()),
            "global_rank": rank_N,
        },
        schema=FREQUENCY_SCHEMA,
    )


def cover(counts_N: np.ndarray, fraction: float) -> int | None:
    """Fewest keys, taken by count descending, whose counts sum to >= fraction * total (exact in
    integers: the fraction is read as a ratio of small integers). None when the total is 0."""
    counts_N = np.asarray(counts_N, np.int64)
    total = int(counts_N.sum())
    if total == 0:
        return None
    frac = Fraction(fraction).limit_denominator(1_000_000)
    cum_N = np.cumsum(np.sort(counts_N)[::-1]) * frac.denominator
    return int(np.searchsorted(cum_N, frac.numerator * total, side="left")) + 1


def entropy_bits(counts_N: np.ndarray) -> float | None:
    """Shannon entropy (bits) of the counts normalised to a distribution; None when all are 0."""
    counts_N = np.asarray(counts_N, np.float64)
    total = counts_N.sum()
    if total == 0:
        return None
    p = counts_N[counts_N > 0] / total
    return float(max(0.0, -(p * np.log2(p)).sum()))


def gini(counts_N: np.ndarray) -> float:
    """Gini coefficient over all N keys, zeros included: sum_i sum_j |x_i - x_j| / (2 N^2 mean);
    0 when all counts are equal (all zero included)."""
    x = np.sort(np.asarray(counts_N, np.float64))
    n = x.size
    total = x.sum()
    if n == 0 or total == 0:
        return 0.0
    # sum_i sum_j |x_i - x_j| = 2 * sum_i (2i - n + 1) x_(i) over the ascending order, i from 0
    pair_sum = 2.0 * float(((2.0 * np.arange(n) - n + 1.0) * x).sum())
    return pair_sum / (2.0 * n * total)  # 2 n^2 mean = 2 n total


def _cover_name(fraction: float) -> str:
    return f"cover_{int(round(fraction * 100))}"


def _scope_row(counts_N: np.ndarray, fractions: Sequence[float]) -> dict:
    n = counts_N.size
    h = entropy_bits(counts_N)
    row = {
        "selections": int(counts_N.sum()),
        "entropy_bits": h,
        "normalized_entropy": None if h is None or n < 2 else h / float(np.log2(n)),
        "effective_experts": None if h is None else float(2.0**h),
        "gini": gini(counts_N),
    }
    for f in fractions:
        row[_cover_name(f)] = cover(counts_N, f)
    return row


def concentration_table(
    tt: TokenTrace, fractions: Sequence[float] = (0.5, 0.8, 0.9, 0.95)
) -> tuple[pa.Table, dict]:
    """One "global" row (all L*E keys, layer -1) then one row per layer (its E keys): selections,
    entropy_bits, normalized_entropy (H / log2 N), effective_experts (2^H), gini, cover_<f> per
    fraction, global_top_share (layer rows: share of the keys of the global cover_80 placement that
    lie in this layer; global row: 1.0). Summary: the global row's figures and, across layers,
    cover_80 min/median/max and normalized_entropy min/max."""
    fractions = [float(f) for f in fractions]
    for f in fractions:
        if not 0.0 < f <= 1.0:
            raise MoecacheError(f"concentration fractions: {f} is not in (0, 1]")
    names = [_cover_name(f) for f in fractions]
    if len(set(names)) != len(names):
        raise MoecacheError(f"concentration fractions {fractions} give duplicate columns {names}")
    L, E = tt.num_layers, tt.num_experts
    counts_LE = expert_counts(tt)
    counts_N = counts_LE.ravel()

    # the global cover_80 placement: its keys' layers
    placement_size = cover(counts_N, PLACEMENT_FRACTION)
    placed_per_layer_L = np.zeros(L, np.int64)
    if placement_size is not None:
        placed_N = order_by_count(counts_N)[:placement_size]
        placed_per_layer_L = np.bincount(placed_N // E, minlength=L)

    rows = [{"scope": "global", "layer": -1, **_scope_row(counts_N, fractions), "global_top_share": 1.0}]
    for layer in range(L):
        row = _scope_row(counts_LE[layer], fractions)
        share = None if placement_size is None else int(placed_per_layer_L[layer]) / placement_size
        rows.append({"scope": "layer", "layer": layer, **row, "global_top_share": share})

    columns = schema(
        trace=STR,
        scope=STR,
        layer=I64,
        selections=I64,
        entropy_bits=F64,
        normalized_entropy=F64,
        effective_experts=F64,
        gini=F64,
        **dict.fromkeys(names, I64),
        global_top_share=F64,
    )
    table = pa.Table.from_pylist([{"trace": tt.name, **r} for r in rows], schema=columns)

    g = rows[0]
    summary: dict = {
        "global_selections": g["selections"],
        "global_entropy_bits": g["entropy_bits"],
        "global_normalized_entropy": g["normalized_entropy"],
        "global_effective_experts": g["effective_experts"],
        "global_gini": g["gini"],
    }
    for name in names:
        summary[f"global_{name}"] = g[name]
    layer_cover_L = [cover(counts_LE[layer], PLACEMENT_FRACTION) for layer in range(L)]
    layer_cover = np.array([c for c in layer_cover_L if c is not None], np.float64)
    layer_h = np.array([r["normalized_entropy"] for r in rows[1:] if r["normalized_entropy"] is not None])
    summary["layer_cover_80_min"] = int(layer_cover.min()) if layer_cover.size else None
    summary["layer_cover_80_median"] = float(np.median(layer_cover)) if layer_cover.size else None
    summary["layer_cover_80_max"] = int(layer_cover.max()) if layer_cover.size else None
    summary["layer_normalized_entropy_min"] = float(layer_h.min()) if layer_h.size else None
    summary["layer_normalized_entropy_max"] = float(layer_h.max()) if layer_h.size else None
    return table, summary
