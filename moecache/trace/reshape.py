"""Reshape a canonical trace onto another MoE routing shape: a labelled approximation.

Real routing of one model (the DeepSeek-V2-Lite ESFT traces: L=26 MoE layers x E=64 experts, top-6)
drives a model of another shape (Qwen3.6-35B-A3B: L'=40 x E'=256, top-8) that has no trace of its own.
The result is NOT that model's routing; it keeps the source's locality (per layer, across tokens and
across neighbouring layers) inside a trace of the target's shape. The rule, version RESHAPE_VERSION
(docs/trace-format.md, "Reshaped traces: an approximation"):

- G = E' / E source layers feed each target layer: target MoE layer l' (0..L'-1), in pass p = l' // L
  over the source layers, draws on s_q(l') = (l' + q * stride_p) mod L, q = 0..G-1, where stride_p is
  the smallest stride >= L // G + p (and above the previous pass's) whose G multiples are distinct mod L:
  the G source layers are distinct, and a target layer l' + L does not repeat layer l's selections.
  Expert e of source layer s_q becomes target expert q * E + e.
- Per token, the candidates are the G * K source selections with their source router weights; the
  target selection is the K' candidates of largest weight (ties: the smaller target id), in descending
  weight order, the weights renormalised to sum 1 (as Qwen's norm_topk_prob does).
- Every token keeps its run_id, request_id, step_index, token_index and phase. The cache columns and
  `lens_token` are null (they describe the source model); columns outside the format are dropped.
- The metadata names the target shape; `model` says "<target> (reshaped from <source>)", `source`
  starts with "reshaped-v<version>:", and `run["reshaped_from"]` records the source shape and model,
  the rule, its version and the layer map, so a reshaped trace is always labelled as one.

A token missing some source layer has fewer candidates (a row of fewer than K' experts, or no row where
all G are missing); the ESFT traces have every layer of every token. Vectorised over tokens (one pass
per target layer), deterministic.

Legend: T tokens, L source layers, E source experts, K source top-k, G source layers per target layer,
C = G * K candidates, R output rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from omegaconf import OmegaConf

from moecache.errors import MoecacheError
from moecache.trace.schema import TraceMeta, empty_cache_columns, schema_with_meta
from moecache.trace.validity import request_codes

RESHAPE_VERSION = 2
RULE = (
    "target layer l' draws on source layers s_q = (l' + q*stride_p) mod L, q = 0..G-1, G = E'/E, "
    "p = l' // L, stride_p the smallest stride >= L//G + p (and above the previous pass's) with G "
    "distinct multiples mod L; source expert e of s_q is target expert q*E + e; per token the K' of the G*K "
    "source selections with the largest source router weight (ties: smaller target id), in descending "
    "weight order, weights renormalised to sum 1"
)
SHAPE_KEYS = ("num_layers", "num_experts", "top_k", "expert_bytes")
OPTION = "trace_import.reshape"
INT16_LIMIT = 2**15  # layer_id and expert_ids are int16 columns (moecache/trace/schema.py)


@dataclass(frozen=True)
class TargetShape:
    """The routing shape a trace is reshaped onto."""

    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    model: str = "unknown"


def target_from_option(option, conf_dir) -> TargetShape:
    """`trace_import.reshape`: a model group name (`qwen3_6_35b_a3b`: its `architecture` numbers and
    `name` from conf/model/<name>.yaml) or a mapping {num_layers, num_experts, top_k, expert_bytes,
    model (optional label)}."""
    if isinstance(option, str):
        path = conf_dir / "model" / f"{option}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in (conf_dir / "model").glob("*.yaml"))
            raise MoecacheError(f"{OPTION}={option!r}: no model group {path} (known: {', '.join(known)})")
        group = OmegaConf.load(path)
        arch = group.get("architecture") or {}
        values = {k: arch.get(k) for k in SHAPE_KEYS}
        where = f"{path}: architecture"
        label = str(group.get("name") or option)
    elif isinstance(option, dict):
        unknown = sorted(set(option) - {*SHAPE_KEYS, "model"})
        if unknown:
            raise MoecacheError(
                f"{OPTION}: unknown key(s) {unknown}; expected {list(SHAPE_KEYS)} and optionally 'model'"
            )
        values = {k: option.get(k) for k in SHAPE_KEYS}
        where = OPTION
        label = str(option.get("model") or "unknown")
    else:
        raise MoecacheError(
            f"{OPTION}={option!r}: expected null, a model group name (conf/model/) or a mapping with "
            f"{list(SHAPE_KEYS)}"
        )
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MoecacheError(f"{where}.{key} must be a positive integer, got {value!r}")
    return TargetShape(**values, model=label)


def pass_strides(source_layers: int, target_layers: int, groups: int) -> list[int]:
    """The stride of each pass p = l' // L over the source layers: the smallest stride >= L // G + p
    whose G multiples are distinct mod L (so the G source layers of a target layer are distinct, and a
    later pass never repeats an earlier pass's layer assignment)."""
    strides: list[int] = []
    for p in range(-(-target_layers // source_layers)):
        stride = (
            source_layers // groups + p if not strides else max(source_layers // groups + p, strides[-1] + 1)
        )
        while len({(q * stride) % source_layers for q in range(groups)}) < groups:
            stride += 1
        strides.append(stride)
    return strides


def layer_map(source_layers: int, target_layers: int, groups: int) -> np.ndarray:
    """int64 [L', G]: the source layers s_q(l') = (l' + q * stride_p) mod L, p = l' // L (pass_strides)."""
    strides = np.array(pass_strides(source_layers, target_layers, groups), np.int64)
    target_L = np.arange(target_layers)
    stride_L = strides[target_L // source_layers]
    return (target_L[:, None] + np.arange(groups)[None, :] * stride_L[:, None]) % source_layers


def check_shapes(source: TraceMeta, target: TargetShape, where: str) -> int:
    """G = E' / E; refuses in one line a target the rule cannot map onto."""
    L, E, K = source.num_layers, source.num_experts, source.top_k
    src = f"{L} layers x {E} experts, top-{K}"
    if target.num_layers < 1:
        raise MoecacheError(f"{where}: reshape needs num_layers >= 1, got {target.num_layers}")
    if E < 1 or target.num_experts % E:
        raise MoecacheError(
            f"{where}: reshape needs num_experts a multiple of the source's {E} ({src}), got "
            f"{target.num_experts}"
        )
    if max(target.num_layers, target.num_experts) > INT16_LIMIT:
        raise MoecacheError(
            f"{where}: reshape onto {target.num_layers} layers x {target.num_experts} experts: the trace "
            f"format holds layer and expert ids as int16 (at most {INT16_LIMIT} of each)"
        )
    groups = target.num_experts // E
    if groups > L:
        raise MoecacheError(
            f"{where}: reshape onto {target.num_experts} experts needs G = {groups} distinct source layers "
            f"per target layer; the source has {L} ({src})"
        )
    if target.top_k > groups * K:
        raise MoecacheError(
            f"{where}: reshape needs top_k <= G*K = {groups}*{K} = {groups * K} candidates ({src}, "
            f"{target.num_experts} experts), got {target.top_k}"
        )
    return groups


def reshape_table(
    table: pa.Table, meta: TraceMeta, target: TargetShape, where: str
) -> tuple[pa.Table, TraceMeta]:
    """The canonical trace table of `target`'s shape (module docstring), in canonical row order, and
    its labelled metadata. `table` is a valid canonical trace table with `router_weights`."""
    groups = check_shapes(meta, target, where)
    for name, why in (("router_weights", "the target selection is by weight"), ("run_id", "kept per token")):
        if name not in table.column_names:
            raise MoecacheError(f"{where}: reshape needs the column '{name}' ({why})")
    if table.num_rows == 0:
        raise MoecacheError(f"{where}: the trace has no rows; nothing to reshape")
    L, E, K = meta.num_layers, meta.num_experts, meta.top_k
    first_T, token_of_row, rank_T, step_T, position_T = _tokens(table, where)
    ids_TLK, w_TLK = _dense(table, token_of_row, first_T.size, L, K, where)
    map_LG = layer_map(L, target.num_layers, groups)
    offset_C = np.repeat(np.arange(groups, dtype=np.int64) * E, K)
    big = np.int64(groups * E)  # sorts after every real target id
    Kt = target.top_k
    ids_parts, w_parts, count_parts = [], [], []
    for layer in range(target.num_layers):
        cand_TC = ids_TLK[:, map_LG[layer], :].reshape(-1, groups * K)
        w_TC = w_TLK[:, map_LG[layer], :].reshape(-1, groups * K)
        valid_TC = cand_TC >= 0
        tgt_TC = np.where(valid_TC, cand_TC + offset_C, big)
        w_TC = np.where(valid_TC, w_TC, -np.inf)
        order_TC = np.lexsort((tgt_TC, -w_TC), axis=-1)[:, :Kt]  # weight descending, then id
        ids_TK = np.take_along_axis(tgt_TC, order_TC, axis=1)
        sel_TK = np.take_along_axis(w_TC, order_TC, axis=1)
        keep_TK = ids_TK < big
        sel_TK = np.where(keep_TK, sel_TK, 0.0)
        total_T = sel_TK.sum(axis=1)
        count_T = keep_TK.sum(axis=1)
        zero = np.flatnonzero((count_T > 0) & (total_T <= 0))
        if zero.size:
            t = int(zero[0])
            raise MoecacheError(
                f"{where}: reshape: target layer {layer} of the token at row {int(first_T[t])} selects "
                f"experts {ids_TK[t, : count_T[t]].tolist()} whose source weights sum to 0; cannot "
                "renormalise"
            )
        ids_parts.append(ids_TK)
        w_parts.append(sel_TK / np.where(total_T > 0, total_T, 1.0)[:, None])
        count_parts.append(count_T)
    # Rows (token, target layer), ordered by (request, step, layer, token).
    T, Lt = first_T.size, target.num_layers
    ids_RK = np.stack(ids_parts, axis=1).reshape(T * Lt, Kt)
    w_RK = np.stack(w_parts, axis=1).reshape(T * Lt, Kt)
    count_R = np.stack(count_parts, axis=1).reshape(-1)
    token_R = np.repeat(np.arange(T), Lt)
    layer_R = np.tile(np.arange(Lt), T)
    order = np.lexsort((position_T[token_R], layer_R, step_T[token_R], rank_T[token_R]))
    order = order[count_R[order] > 0]
    ids_RK, w_RK, count_R = ids_RK[order], w_RK[order], count_R[order]
    token_R, layer_R = token_R[order], layer_R[order]
    keep = np.arange(Kt)[None, :] < count_R[:, None]
    list_offsets = pa.array(np.concatenate([[0], np.cumsum(count_R)]).astype(np.int32))
    source_row_R = pa.array(first_T[token_R])
    rows = int(order.size)
    columns = {
        "run_id": _strings(table, "run_id", source_row_R),
        "request_id": _strings(table, "request_id", source_row_R),
        "step_index": pa.array(step_T[token_R].astype(np.int32)),
        "token_index": pa.array(position_T[token_R].astype(np.int32)),
        "phase": _strings(table, "phase", source_row_R),
        "layer_id": pa.array(layer_R.astype(np.int16)),
        "expert_ids": pa.ListArray.from_arrays(list_offsets, pa.array(ids_RK[keep].astype(np.int16))),
        "router_weights": pa.ListArray.from_arrays(list_offsets, pa.array(w_RK[keep].astype(np.float32))),
        **empty_cache_columns(rows),
    }
    out_meta = _label(meta, target, groups, map_LG)
    schema = schema_with_meta(out_meta)
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema), out_meta


def _tokens(table: pa.Table, where: str):
    """The trace's tokens, sorted by (request in order of first row, token_index): (first row of each
    token [T], token of every row [N], request rank [T], step_index [T], token_index [T]). Refuses a
    token whose rows disagree on run_id, step_index or phase: a reshaped row takes them per token."""
    req_N = request_codes(table["request_id"]).astype(np.int64)
    codes, first_row = np.unique(req_N, return_index=True)
    rank_C = np.zeros(int(codes.max()) + 1, np.int64)
    rank_C[codes[np.argsort(first_row)]] = np.arange(codes.size)
    token_N = table["token_index"].to_numpy().astype(np.int64)
    key_N = rank_C[req_N] * (int(token_N.max()) + 1) + token_N
    _, first_T, token_of_row = np.unique(key_N, return_index=True, return_inverse=True)
    token_of_row = token_of_row.reshape(-1)
    for name in ("run_id", "step_index", "phase"):
        if name not in table.column_names:
            continue
        values = table[name]
        codes_N = (
            request_codes(values) if pa.types.is_string(values.type) or pa.types.is_dictionary(values.type)
            else values.to_numpy()
        )  # fmt: skip
        differ = np.flatnonzero(codes_N != codes_N[first_T][token_of_row])
        if differ.size:
            row, first = int(differ[0]), int(first_T[token_of_row[differ[0]]])
            raise MoecacheError(
                f"{where}: column '{name}' is {values[row].as_py()!r} at row {row} and "
                f"{values[first].as_py()!r} at row {first}, the same token "
                f"({table['request_id'][row].as_py()!r}, token_index {int(token_N[row])}); reshape needs "
                "one value per token"
            )
    step_T = table["step_index"].to_numpy().astype(np.int64)[first_T]
    return first_T, token_of_row, rank_C[req_N][first_T], step_T, token_N[first_T]


def _dense(table: pa.Table, token_of_row: np.ndarray, T: int, L: int, K: int, where: str):
    """(ids int64 [T, L, K], -1 where absent; weights float64 [T, L, K], -inf where absent)."""
    lengths_N = pc.list_value_length(table["expert_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
    flat_ids = pc.list_flatten(table["expert_ids"]).to_numpy().astype(np.int64)
    flat_w = pc.list_flatten(table["router_weights"]).to_numpy(zero_copy_only=False).astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(flat_w) | (flat_w < 0))
    if bad.size:
        row = int(np.searchsorted(np.cumsum(lengths_N), bad[0], side="right"))
        raise MoecacheError(
            f"{where}: column 'router_weights' holds {table['router_weights'][row].as_py()} at row {row}: "
            f"reshape needs finite, non-negative weights ({bad.size} such weight(s))"
        )
    row_of_item = np.repeat(np.arange(lengths_N.size), lengths_N)
    slot = np.arange(flat_ids.size) - np.repeat(np.cumsum(lengths_N) - lengths_N, lengths_N)
    layer_N = table["layer_id"].to_numpy().astype(np.int64)
    ids_TLK = np.full((T, L, K), -1, np.int64)
    w_TLK = np.full((T, L, K), -np.inf, np.float64)
    at = (token_of_row[row_of_item], layer_N[row_of_item], slot)
    ids_TLK[at] = flat_ids
    w_TLK[at] = flat_w
    return ids_TLK, w_TLK


def _strings(table: pa.Table, name: str, rows: pa.Array) -> pa.Array:
    """Column `name` (string, plain or dictionary) at `rows`, as plain strings."""
    taken = table[name].combine_chunks().take(rows)
    return taken.cast(pa.string()) if pa.types.is_dictionary(taken.type) else taken


def _label(meta: TraceMeta, target: TargetShape, groups: int, map_LG: np.ndarray) -> TraceMeta:
    source_model = meta.model
    reshaped_from = {
        "version": RESHAPE_VERSION,
        "rule": RULE,
        "source_shape": {k: getattr(meta, k) for k in SHAPE_KEYS},
        "source_model": source_model,
        "source": meta.source,
        "groups": groups,
        "strides": pass_strides(meta.num_layers, target.num_layers, groups),
        "source_layers": map_LG.tolist(),
    }
    return TraceMeta(
        num_layers=target.num_layers,
        num_experts=target.num_experts,
        top_k=target.top_k,
        expert_bytes=target.expert_bytes,
        model=f"{target.model} (reshaped from {source_model})",
        source=f"reshaped-v{RESHAPE_VERSION}:{meta.source}",
        run={**meta.run, "reshaped_from": reshaped_from},
    )
