"""Parquet output of the three tables: one file per table, written in row groups as chunks arrive.

Files carry the declared Arrow schema (``schemas/<table>.schema.json``), so every column's unit and
description travel with the data. Repeated strings (``dictionary<string>`` columns) are
dictionary-encoded; numeric columns are plain-encoded (dictionary encoding of timestamps and PSNs
costs more than it saves) and every page is LZ4-compressed, which keeps writing the packets table
of tens of millions of rows a small share of a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from .. import tables

ROW_GROUP_ROWS = 1 << 20


class TableWriter:
    """Streaming writer of one wiretrace table to a Parquet file.

    ``write(columns)`` appends a chunk (a dict of equal-length arrays or a ``pyarrow.Table`` of the
    declared schema); ``close()`` finishes the file. A file is always written, with zero rows when
    nothing was appended, so that readers find every table.
    """

    def __init__(self, path: str | Path, table: str):
        self.path = Path(path)
        self.table = table
        self.rows = 0
        schema = tables.arrow_schema(table)
        dict_cols = [f.name for f in schema if pa.types.is_dictionary(f.type)]
        self._writer = pq.ParquetWriter(self.path, schema, compression="lz4",
                                        use_dictionary=dict_cols or False)

    def write(self, chunk: Mapping[str, object] | pa.Table) -> None:
        t = chunk if isinstance(chunk, pa.Table) else tables.to_arrow(self.table, chunk)
        if t.num_rows:
            self._writer.write_table(t.cast(tables.arrow_schema(self.table)), row_group_size=ROW_GROUP_ROWS)
            self.rows += t.num_rows

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "TableWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_table(path: str | Path, table: str, data: Mapping[str, object] | pa.Table) -> int:
    """Write one whole table to ``path``; returns the number of rows."""
    with TableWriter(path, table) as w:
        w.write(data)
        return w.rows


def read_table(path: str | Path, table: str) -> pa.Table:
    """Read a table written by wiretrace and check its columns against the declaration.

    Raises
    ------
    wiretrace.errors.InputFormatError : the file is not Parquet or lacks declared columns.
    """
    from ..errors import InputFormatError

    try:
        t = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputFormatError(f"{path}: not a readable Parquet file ({e})") from None
    missing = [n for n in tables.column_names(table) if n not in t.column_names]
    if missing:
        raise InputFormatError(f"{path}: not a wiretrace {table} table (missing {', '.join(missing)})")
    return t.select(tables.column_names(table))
