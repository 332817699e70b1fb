"""Per-layer columns of a trace's Arrow table, in either stored form (bytes or lists), for tests
that damage or change a file's values."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from traces.format import BINARY_DTYPES


def column_values(column: pa.Array, name: str) -> np.ndarray:
    """A per-layer column's values as (rows, width): list entries, or binary values (logits as
    float16, ids and experts as int16, weights as float32)."""
    if pa.types.is_fixed_size_binary(column.type):
        dtype = BINARY_DTYPES[name]
        return np.frombuffer(column.buffers()[1], dtype)[:len(column) * column.type.byte_width // dtype.itemsize] \
            .reshape(len(column), -1).copy()
    return column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), -1).copy()


def with_values(table: pa.Table, name: str, change) -> pa.Table:
    """The table with a per-layer column's values (rows, width) changed in place by ``change``."""
    column = table.column(name).combine_chunks()
    values = column_values(column, name)
    change(values)
    if pa.types.is_fixed_size_binary(column.type):
        array = pa.FixedSizeBinaryArray.from_buffers(column.type, len(column), [None, pa.py_buffer(values)])
    else:
        array = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
    return table.set_column(table.schema.get_field_index(name), name, array)


def list_form(column: pa.Array, name: str) -> pa.FixedSizeListArray:
    """A per-layer column in its list form (the compact encoding's type, which readers also take)."""
    values = column_values(column, name)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
