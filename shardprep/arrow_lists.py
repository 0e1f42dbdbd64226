"""Arrow arrays from Python lists without importing pandas.

``pa.array(list)`` (and ``pa.table``, ``Table.from_pydict``, which call it) asks pyarrow's pandas shim
whether the list is a pandas object, and the shim imports pandas to answer: 0.27-0.35 CPU-seconds
once per process (pandas, then ``pyarrow.compute`` from its Arrow accessors), which a download
process pays for its one parquet of 10,000 rows, and any process that reads the state index
(``shardprep status``, a run's first shard step) for a few comparisons (bench/IMAGES.md). Strings,
integers and float64, the columns the shard writers and the state index make, are built here from
their buffers (offsets, bytes, validity bitmap), the same arrays ``pa.array`` gives; any other type, or
values these builders do not take, go to ``pa.array`` as before. A Python scalar in a compute call
(``pc.equal(column, "v1")``, and ``pa.scalar`` itself) goes through the same shim: ``is_value`` compares
without one.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_INTEGERS = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
             pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64}
_MAX_STRING_BYTES = (1 << 31) - 1  # pa.string()'s int32 offsets; past that pa.array chunks the column


def table(columns: dict[str, list], schema: pa.Schema) -> pa.Table:
    """``pa.Table.from_pydict(columns, schema=schema)``, without pandas for string and integer columns."""
    return pa.Table.from_arrays([array(columns[field.name], field.type) for field in schema], schema=schema)


def array(values: list, type: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """``pa.array(values, type)``: the same values and nulls, without pandas for strings, integers and float64."""
    try:
        if type == pa.string():
            return _strings(values)
        if type in _INTEGERS:
            return _integers(values, type)
        if type == pa.float64():
            return _floats(values)
    except (AttributeError, TypeError, ValueError, OverflowError):
        pass  # not all str / int (or out of range): pyarrow converts, or raises its own error
    return pa.array(values, type)


def is_value(column: pa.Array | pa.ChunkedArray, value) -> pa.Array | pa.ChunkedArray:
    """``column == value`` with nulls False: ``pc.fill_null(pc.equal(column, value), False)``, whose Python
    scalars pyarrow converts through the same pandas shim (``pa.scalar`` imports pandas too)."""
    # a None value: pc.equal gives nulls, so all False; a null in the value set would match the nulls
    return pc.is_in(column, value_set=array([] if value is None else [value], column.type))


def is_other_value(column: pa.Array | pa.ChunkedArray, value) -> pa.Array | pa.ChunkedArray:
    """``column != value`` with nulls False (``pc.fill_null(pc.not_equal(column, value), False)``)."""
    if value is None:  # pc.not_equal against a null is null throughout: all False
        return is_value(column, None)
    return pc.and_(pc.is_valid(column), pc.invert(is_value(column, value)))


def _validity(values: list) -> tuple[pa.Buffer | None, int]:
    valid = np.fromiter((v is not None for v in values), np.bool_, len(values))
    nulls = len(values) - int(np.count_nonzero(valid))
    return (pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None), nulls


def _strings(values: list) -> pa.Array:
    encoded = [b"" if v is None else v.encode("utf-8") for v in values]  # AttributeError: not a str
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    if int(lengths.sum()) > _MAX_STRING_BYTES:
        raise ValueError("past int32 offsets")
    offsets = np.zeros(len(encoded) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    bitmap, nulls = _validity(values)
    return pa.Array.from_buffers(pa.string(), len(values), [bitmap, pa.py_buffer(offsets),
                                                            pa.py_buffer(b"".join(encoded))], null_count=nulls)


def _integers(values: list, arrow_type: pa.DataType) -> pa.Array:
    if not all(v is None or type(v) is int for v in values):
        raise TypeError("not all int")  # bools, floats, numpy scalars: pyarrow's own rules decide
    # through int64 and a range check: numpy 1.x wraps an out-of-range int silently where pyarrow raises
    wide = np.fromiter((0 if v is None else v for v in values), np.int64, len(values))  # OverflowError
    dtype = _INTEGERS[arrow_type]
    info = np.iinfo(dtype)
    if len(wide) and (int(wide.min()) < info.min or int(wide.max()) > info.max):
        raise OverflowError("out of the type's range")
    return _fixed_width(values, arrow_type, wide.astype(dtype))


def _floats(values: list) -> pa.Array:
    if not all(v is None or type(v) is float for v in values):
        raise TypeError("not all float")  # ints, numpy scalars, ...: pyarrow's own rules decide
    return _fixed_width(values, pa.float64(), np.fromiter((0.0 if v is None else v for v in values), np.float64,
                                                          len(values)))


def _fixed_width(values: list, arrow_type: pa.DataType, data: np.ndarray) -> pa.Array:
    """The array of ``data`` (the values, a placeholder where ``values`` has None) with ``values``' nulls."""
    bitmap, nulls = _validity(values)
    return pa.Array.from_buffers(arrow_type, len(values), [bitmap, pa.py_buffer(data)], null_count=nulls)
