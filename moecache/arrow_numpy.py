"""Arrow <-> NumPy through the Arrow buffers themselves, for the cold-start path of the stages.

pyarrow's own conversions (`Array.to_numpy`, `np.asarray(array)`, `pa.array(...)`, `Table.from_pylist`)
all probe for pandas first, and the probe imports it: 0.12-0.18 s of a cold `moecache simulate`, for a
library the stage never uses. Reading a primitive column without nulls is a zero-copy view of its data
buffer; writing a table of plain Python scalars is a data buffer (and a validity bitmap) per column. Both
are exact: the tests compare every result with pyarrow's own conversion. Anything else (nested values,
dictionaries, nulls where a view cannot show them) goes through pyarrow's converters, as before.

    view = numpy_view(table["layer_id"])          # np.ndarray, read-only, no copy for one chunk
    table = table_from_rows([{"trace": "a", "hit_rate": 0.5}, ...])   # == pa.Table.from_pylist(rows)
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def _is_primitive(dtype: pa.DataType) -> bool:
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype)


def numpy_view(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """`values.to_numpy()` for an integer or floating column without nulls, read from its data buffer:
    one chunk is a read-only view (no copy), several are concatenated. Other columns: pyarrow's own
    `to_numpy(zero_copy_only=False)`."""
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    if not _is_primitive(values.type) or any(c.null_count for c in chunks):
        return values.to_numpy(zero_copy_only=False)
    dtype = _numpy_dtype(values.type)
    parts = [
        np.frombuffer(c.buffers()[1], dtype=dtype, count=c.offset + len(c))[c.offset :]
        if len(c)
        else np.zeros(0, dtype)
        for c in chunks
    ]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


_NUMPY_DTYPES = {
    pa.int8(): np.int8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint8(): np.uint8,
    pa.uint16(): np.uint16,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
    pa.float16(): np.float16,
    pa.float32(): np.float32,
    pa.float64(): np.float64,
}


def _numpy_dtype(dtype: pa.DataType) -> np.dtype:
    return np.dtype(_NUMPY_DTYPES[dtype])


def _bitmap(present: list[bool]) -> pa.Buffer:
    return pa.py_buffer(np.packbits(np.array(present, bool), bitorder="little"))


def _scalar_column(values: list) -> pa.Array | None:
    """The Arrow array pa.array(values) infers, for a list of one Python scalar type (bool, int, float or
    str; None allowed anywhere; all None is a null column), built from buffers; None for anything else
    (the caller falls back)."""
    present = [v is not None for v in values]
    kinds = {type(v) for v in values if v is not None}
    n, nulls = len(values), len(present) - sum(present)
    validity = _bitmap(present) if nulls else None
    if not kinds:  # every value None: from_pylist's null column
        return pa.nulls(n)
    if kinds == {bool}:
        bits = _bitmap([bool(v) for v in values])
        return pa.Array.from_buffers(pa.bool_(), n, [validity, bits], null_count=nulls)
    if kinds == {int}:
        if any(v is not None and not -(2**63) <= v < 2**63 for v in values):
            return None
        data = np.array([v if v is not None else 0 for v in values], np.int64)
        return pa.Array.from_buffers(pa.int64(), n, [validity, pa.py_buffer(data)], null_count=nulls)
    if kinds in ({float}, {int, float}):
        data = np.array([float(v) if v is not None else 0.0 for v in values], np.float64)
        return pa.Array.from_buffers(pa.float64(), n, [validity, pa.py_buffer(data)], null_count=nulls)
    if kinds == {str}:
        encoded = [v.encode() if v is not None else b"" for v in values]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        if offsets[-1] >= 2**31:
            return None
        buffers = [validity, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(encoded))]
        return pa.Array.from_buffers(pa.string(), n, buffers, null_count=nulls)
    return None


def table_from_rows(rows: list[dict]) -> pa.Table:
    """`pa.Table.from_pylist(rows)` (same columns, order, types and values), with columns of plain
    scalars built from buffers. The columns are the first row's keys, in order, and a row lacking one is
    null there, as from_pylist does. A column holding anything else (lists, dicts, NumPy scalars, mixed types) makes
    the whole table go through from_pylist."""
    names = list(rows[0]) if rows else []  # from_pylist takes the first row's keys
    arrays = []
    for name in names:
        column = _scalar_column([row.get(name) for row in rows])
        if column is None:
            return pa.Table.from_pylist(rows)
        arrays.append(column)
    return pa.Table.from_arrays(arrays, names=names) if names else pa.Table.from_pylist(rows)
