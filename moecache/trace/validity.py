"""The row-level rules of a valid trace (docs/trace-format.md, "Validity"), checked on whole columns.

`moecache/trace/schema.py` checks a trace's columns and value ranges; this module checks what holds
between rows and inside them, which no column type can say:

- no null in a required column, nor inside an `expert_ids` list;
- `router_weights`, where present, one weight per expert of `expert_ids`;
- no repeated expert within one `expert_ids` list (a router picks top-k distinct experts);
- canonical row order: rows grouped by request (each request's rows contiguous), and within a request
  strictly ascending (step_index, layer_id, token_index). Strict, so a duplicated row (same request,
  step, layer and token) breaks it too; the error says which of the two it is.

Every check is vectorised (numpy / pyarrow.compute, no Python loop over rows), because `read_trace`
runs them on the hot path of every stage. Each failure is one MoecacheError line naming the file,
the column, the row index (0-based, in the file) and the value.

Legend: N rows, X expert selections (the items of all `expert_ids` lists), K top-k.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moecache.arrow_numpy import numpy_view
from moecache.errors import MoecacheError

ORDER_COLUMNS = ("step_index", "layer_id", "token_index")  # within a request, ascending in this order
ROW_ORDER_DOC = "docs/trace-format.md, Row order"


def check_no_nulls(table: pa.Table, columns: tuple[str, ...], where: str) -> None:
    """Refuse a null in any of `columns`, or inside an `expert_ids` list. Null counts are Arrow
    metadata, so a trace without nulls costs nothing here."""
    for name in columns:
        column = table[name]
        if column.null_count:
            row = _first_true(pc.is_null(column))
            raise MoecacheError(
                f"{where}: column '{name}' is null at row {row} ({column.null_count} null row(s)); "
                "every row needs a value"
            )
    if "expert_ids" in columns:
        items = pc.list_flatten(table["expert_ids"])
        if items.null_count:
            item = _first_true(pc.is_null(items))
            row = row_of_item(table["expert_ids"], item)
            raise MoecacheError(
                f"{where}: column 'expert_ids' holds a null expert at row {row} "
                f"({table['expert_ids'][row].as_py()}; {items.null_count} null expert(s) in all)"
            )


def check_distinct_experts(table: pa.Table, where: str) -> None:
    """Refuse an `expert_ids` list that names one expert twice. Lists are padded to [N, K] (pads get
    distinct negative values, so they never match) and every pair of positions compared: K (K-1) / 2
    vector comparisons, no sort."""
    column = table["expert_ids"]
    if table.num_rows == 0:
        return
    offsets_N1 = _list_offsets(column)
    length_N = np.diff(offsets_N1)
    K = int(length_N.max())
    if K < 2:
        return
    values_X = numpy_view(pc.list_flatten(column))
    if int(length_N.min()) == K:
        expert_KN = np.ascontiguousarray(values_X.reshape(-1, K).T)  # contiguous rows compare faster
    else:
        expert_KN = np.repeat(-1 - np.arange(K, dtype=np.int64)[:, None], table.num_rows, axis=1)
        row_X = np.repeat(np.arange(table.num_rows), length_N)
        expert_KN[np.arange(values_X.size) - offsets_N1[row_X], row_X] = values_X
    repeated_N = np.zeros(table.num_rows, bool)
    equal_N = np.empty(table.num_rows, bool)
    for i in range(K - 1):
        for j in range(i + 1, K):
            np.equal(expert_KN[i], expert_KN[j], out=equal_N)
            repeated_N |= equal_N
    if repeated_N.any():
        row = int(np.argmax(repeated_N))
        raise MoecacheError(
            f"{where}: column 'expert_ids' repeats an expert at row {row} ({column[row].as_py()}; "
            f"{int(repeated_N.sum())} such row(s)); a router picks distinct experts"
        )


def check_weights_match(table: pa.Table, where: str) -> None:
    """Refuse a `router_weights` column that is not a list column, holds a null list, or whose list
    lengths differ from those of `expert_ids` (one weight per chosen expert, same order)."""
    column = table["router_weights"]
    if not pa.types.is_list(column.type):
        raise MoecacheError(f"{where}: column 'router_weights' has type {column.type}, expected a list")
    if column.null_count:
        row = _first_true(pc.is_null(column))
        raise MoecacheError(f"{where}: column 'router_weights' is null at row {row}; every row needs a value")
    mismatch = np.flatnonzero(np.diff(_list_offsets(column)) != np.diff(_list_offsets(table["expert_ids"])))
    if mismatch.size:
        row = int(mismatch[0])
        raise MoecacheError(
            f"{where}: column 'router_weights' holds {column[row].as_py()} at row {row} for experts "
            f"{table['expert_ids'][row].as_py()}: one weight per expert ({mismatch.size} such row(s))"
        )


def request_codes(column: pa.ChunkedArray) -> np.ndarray:
    """[N]: one integer code per distinct request id, from a plain or dictionary-encoded string column
    (a dictionary column's codes are unified over its chunks)."""
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column)
    array = column.combine_chunks()  # one dictionary for all chunks
    return numpy_view(array.indices)


def row_keys(table: pa.Table) -> tuple[np.ndarray, ...]:
    """(request_N, step_N, layer_N, token_N): what orders and identifies every row, each in its
    column's own integer type (the request's dictionary codes), which compares exactly and costs no
    conversion."""
    request_N = request_codes(table["request_id"])
    return (request_N, *(numpy_view(table[name]) for name in ORDER_COLUMNS))


def canonical_order(table: pa.Table) -> np.ndarray:
    """int64 [N]: the row permutation into canonical order. Requests keep the order of their first row
    in the file; within a request, rows ascend by (step_index, layer_id, token_index); equal rows
    (duplicates) keep their file order, so that `check_row_order` can name both."""
    request_N, step_N, layer_N, token_N = row_keys(table)
    if request_N.size == 0:
        return np.zeros(0, np.int64)
    codes, first_row = np.unique(request_N, return_index=True)  # codes are 0..R-1 but may skip some
    rank_C = np.zeros(int(codes.max()) + 1, np.int64)
    rank_C[codes[np.argsort(first_row)]] = np.arange(codes.size)
    return np.lexsort((token_N, layer_N, step_N, rank_C[request_N])).astype(np.int64)


def check_row_order(table: pa.Table, where: str, row_N: np.ndarray | None = None) -> None:
    """Refuse rows out of canonical order, a request whose rows are not contiguous, and duplicated
    rows. One lexicographic strict-increase test over (step, layer, token) between neighbours of one
    request finds both disorder and duplicates (equal neighbours); a request code reappearing after
    another request's rows breaks contiguity. `row_N`: the file row of each table row, for a table the
    caller has reordered (import-trace sorts before it checks); default: the table's own row numbers."""
    if table.num_rows < 2:
        return
    request_N, step_N, layer_N, token_N = row_keys(table)
    same_M = request_N[1:] == request_N[:-1]  # M = N - 1 neighbour pairs (row m, row m + 1)
    (step_up, step_eq), (layer_up, layer_eq), (token_up, token_eq) = (
        (a[1:] > a[:-1], a[1:] == a[:-1]) for a in (step_N, layer_N, token_N)
    )
    ascending_M = step_up | (step_eq & (layer_up | (layer_eq & token_up)))
    bad_M = same_M & ~ascending_M
    starts = np.concatenate([[0], np.flatnonzero(~same_M) + 1])  # first row of each run of one request
    _, first_start = np.unique(request_N[starts], return_index=True)
    split = starts.size != first_start.size  # some request has more than one run of rows
    rows = row_N if row_N is not None else np.arange(table.num_rows)
    bad_at = int(np.argmax(bad_M)) + 1 if bad_M.any() else table.num_rows
    split_at = table.num_rows
    if split:
        repeated = np.ones(starts.size, bool)
        repeated[first_start] = False
        split_at = int(starts[np.argmax(repeated)])
    if bad_at == table.num_rows and split_at == table.num_rows:
        return
    if split_at < bad_at:
        raise _not_contiguous(table, where, request_N, split_at, rows)
    m = bad_at - 1
    duplicate = step_eq[m] and layer_eq[m] and token_eq[m]
    raise _out_of_order(table, where, bad_at, rows, duplicate=bool(duplicate))


def _out_of_order(table: pa.Table, where: str, at: int, rows: np.ndarray, duplicate: bool) -> MoecacheError:
    request = table["request_id"][at].as_py()
    this, prev = _describe(table, at), _describe(table, at - 1)
    if duplicate:
        return MoecacheError(
            f"{where}: row {rows[at]} duplicates row {rows[at - 1]}: request_id {request!r}, {this}; "
            "each (request_id, step_index, layer_id, token_index) may appear once"
        )
    return MoecacheError(
        f"{where}: row {rows[at]} is out of canonical order: request_id {request!r}, {this} comes after "
        f"row {rows[at - 1]} with {prev}; within a request rows ascend by step_index, then layer_id, "
        f"then token_index ({ROW_ORDER_DOC})"
    )


def _not_contiguous(
    table: pa.Table, where: str, request_N: np.ndarray, at: int, rows: np.ndarray
) -> MoecacheError:
    request = table["request_id"][at].as_py()
    first = int(np.argmax(request_N == request_N[at]))
    return MoecacheError(
        f"{where}: column 'request_id': the rows of request {request!r} are not contiguous: row "
        f"{rows[at]} has it again after another request's rows (its rows began at row {rows[first]}); "
        f"rows are grouped by request ({ROW_ORDER_DOC})"
    )


def first_outside(values: pa.ChunkedArray | pa.Array, low: int, high: int) -> int:
    """The index of the first value outside low..high (the caller knows there is one)."""
    inside = pc.and_(pc.greater_equal(values, low), pc.less_equal(values, high))
    return _first_true(pc.invert(inside))


def row_of_item(column: pa.ChunkedArray, item: int) -> int:
    """The row whose list holds item `item` of pc.list_flatten(column)."""
    return int(np.searchsorted(_list_offsets(column), item, side="right")) - 1


def _describe(table: pa.Table, row: int) -> str:
    return ", ".join(f"{name} {table[name][row].as_py()}" for name in ORDER_COLUMNS)


def _first_true(mask: pa.ChunkedArray | pa.Array) -> int:
    return int(np.argmax(mask.to_numpy(zero_copy_only=False)))


def _list_offsets(column: pa.ChunkedArray) -> np.ndarray:
    """int64 [N+1]: row n's items are list_flatten(column)[offsets[n]:offsets[n+1]] (null lists have
    none; the caller refuses them first)."""
    if column.num_chunks == 1 and column.chunk(0).null_count == 0:  # the usual case: read them
        offsets = numpy_view(column.chunk(0).offsets).astype(np.int64)
        return offsets - offsets[0]
    lengths = numpy_view(pc.list_value_length(column))
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(np.nan_to_num(lengths).astype(np.int64), out=offsets[1:])
    return offsets
