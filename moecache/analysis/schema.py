"""Arrow schemas written compactly, one keyword a column, in column order:
`schema(trace=STR, layer=I64, recall=F64)`."""

from __future__ import annotations

import pyarrow as pa

STR, I64, F64, BOOL = pa.string(), pa.int64(), pa.float64(), pa.bool_()


def schema(**columns: pa.DataType) -> pa.Schema:
    """The Arrow schema of the columns `name=type`, in the order given."""
    return pa.schema(list(columns.items()))
