"""A Parquet manifest's record batches read in bounded runs: each row's decoded size computed from
the Arrow buffers before any value becomes a Python object (``catalogue.manifests`` refuses a row
over its bound and decodes the others through :func:`decode`, the one place a value is decoded).

Pure Arrow and NumPy: no Django, nothing of the app.
"""
from __future__ import annotations

import datetime as dt
import decimal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: Parquet rows decoded per batch.
BATCH_ROWS = 1024
#: Uncompressed bytes a Parquet batch holds on average: a row group of large rows is read in
#: batches of fewer rows (:func:`batch_rows`).
BATCH_BYTES = 8 << 20
#: Most decoded bytes of Parquet rows turned into Python objects at once.
MAX_DECODED_BYTES = 4 << 20
#: Decoded bytes counted for one fixed-width Parquet value (a number, a date, a boolean).
FIXED_BYTES = 8


def batches(parquet, first_group: int) -> Iterator[pa.RecordBatch]:
    """The record batches of the row groups from ``first_group`` on, one group at a time
    (:func:`batch_rows` rows each). Arrow decompresses a data page whole (a writer may put a
    column chunk in one page: up to ``manifests.MAX_ROW_GROUP_BYTES``), and its allocator (mimalloc,
    jemalloc) keeps freed pages for reuse: after each group, and when the reading stops, the
    pool gives them back, so a large group leaves the process where it was."""
    try:
        for g in range(first_group, parquet.num_row_groups):
            yield from parquet.iter_batches(batch_size=batch_rows(parquet.metadata.row_group(g)), row_groups=[g])
            pa.default_memory_pool().release_unused()
    finally:
        pa.default_memory_pool().release_unused()


def batch_rows(group) -> int:
    """Rows per batch for one row group: :data:`BATCH_ROWS`, fewer where its rows are large, so a
    batch holds about :data:`BATCH_BYTES` of plain (not dictionary) values on average; a batch
    never spans two row groups, so it never holds more than one group's uncompressed bytes."""
    size = sum(group.column(c).total_uncompressed_size for c in range(group.num_columns))
    if size <= 0 or group.num_rows <= 0:
        return BATCH_ROWS
    return max(1, min(BATCH_ROWS, BATCH_BYTES * group.num_rows // size))


def decode(batch: pa.RecordBatch, start: int, stop: int) -> list[dict]:
    """Rows ``start`` to ``stop`` (exclusive) of ``batch`` as Python dicts: the one place a
    Parquet value is decoded."""
    return batch.slice(start, stop - start).to_pylist()


def runs(sizes: np.ndarray, cap: int) -> Iterator[tuple[int, int, bool]]:
    """``(start, stop, too_long)`` over a batch's row sizes, in order: a row over ``cap`` alone
    (``too_long``), the others in runs of at most :data:`MAX_DECODED_BYTES` (at least one row)."""
    start, total = 0, 0
    for i, size in enumerate(sizes.tolist()):
        if size > cap:
            if i > start:
                yield start, i, False
            yield i, i + 1, True
            start, total = i + 1, 0
            continue
        if total + size > MAX_DECODED_BYTES and i > start:
            yield start, i, False
            start, total = i, 0
        total += size
    if len(sizes) > start:
        yield start, len(sizes), False


def row_sizes(batch: pa.RecordBatch) -> np.ndarray:
    """The decoded size of each row of ``batch`` (int64, one per row): the UTF-8 bytes of its
    strings plus :data:`FIXED_BYTES` per other value, nulls 0; computed from the Arrow buffers
    (a dictionary's value lengths taken by index) without decoding a value."""
    total = np.zeros(batch.num_rows, dtype=np.int64)
    for column in batch.columns:
        total += value_sizes(column)
    return total


def value_sizes(arr: pa.Array) -> np.ndarray:
    """Decoded bytes per element of ``arr`` (see :func:`row_sizes`), for every type a Parquet
    file reads as."""
    n = len(arr)
    kind = arr.type
    if isinstance(arr, pa.ExtensionArray):
        arr, kind = arr.storage, arr.type.storage_type
    if n == 0 or pa.types.is_null(kind):
        return np.zeros(n, dtype=np.int64)
    if pa.types.is_dictionary(kind):
        values = value_sizes(arr.dictionary)
        indices = arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        out = values[indices] if len(values) else np.zeros(n, dtype=np.int64)
    elif (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
          or pa.types.is_large_binary(kind) or pa.types.is_string_view(kind) or pa.types.is_binary_view(kind)):
        out = pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    elif pa.types.is_struct(kind):
        out = np.zeros(n, dtype=np.int64)
        for child in arr.flatten():  # the struct's offset and nulls applied
            out += value_sizes(child)
    elif pa.types.is_fixed_size_list(kind):
        counts = np.where(arr.is_null().to_numpy(zero_copy_only=False), 0, kind.list_size)
        out = per_parent(value_sizes(arr.flatten()), counts, n)
    elif (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind)
          or pa.types.is_list_view(kind) or pa.types.is_large_list_view(kind)):
        counts = arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        out = per_parent(value_sizes(arr.flatten()), counts, n)  # flatten: nulls and the offset applied
    else:  # numbers, booleans, dates, times, timestamps, decimals: fixed width
        out = np.full(n, FIXED_BYTES, dtype=np.int64)
    if arr.null_count:
        out[arr.is_null().to_numpy(zero_copy_only=False)] = 0
    return out


def per_parent(child_sizes: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """Sum the sizes of a list column's flattened elements per list (``counts`` elements each),
    plus :data:`FIXED_BYTES` per element (its place in the list)."""
    parents = np.repeat(np.arange(n), counts)
    return (np.bincount(parents, weights=child_sizes, minlength=n).astype(np.int64)
            + counts.astype(np.int64) * FIXED_BYTES)


def microseconds(field):
    """``field`` with nanosecond timestamps and times as microseconds: Python's datetime and time
    stop at microseconds, and pyarrow refuses to convert nanoseconds it would lose without pandas."""
    kind = field.type
    if pa.types.is_timestamp(kind) and kind.unit == "ns":
        return field.with_type(pa.timestamp("us", tz=kind.tz))
    if pa.types.is_time64(kind) and kind.unit == "ns":
        return field.with_type(pa.time64("us"))
    return field


def native(value: Any) -> Any:
    """A Parquet value as JSON: decimals as floats, dates and times as ISO-8601 strings."""
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: native(v) for k, v in value.items()}
    if isinstance(value, list):
        return [native(v) for v in value]
    return value
