"""The three tables (collectives, messages, packets): declared once in ``schemas/*.schema.json``.

Each schema file lists its fields as ``{"name", "type", "unit", "description"}``. This module turns
that declaration into a :class:`pyarrow.Schema` (with unit and description as field metadata) and
into NumPy dtypes, so that stages build columns (``dict[str, numpy.ndarray]``) and never lists of
dicts.

Types understood: ``int8/16/32/64``, ``uint8/16/32/64``, ``bool``, ``float64``, ``string``,
``dictionary<string>`` (repeated strings, dictionary-encoded in Parquet) and ``list<int32>``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Mapping

import numpy as np
import pyarrow as pa

TABLES = ("collectives", "messages", "packets")

_SCALAR = {
    "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
    "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64(),
    "bool": pa.bool_(), "float64": pa.float64(), "string": pa.string(),
    "dictionary<string>": pa.dictionary(pa.int32(), pa.string()),
    "list<int32>": pa.list_(pa.int32()),
}


def schema_dir() -> Path:
    """Directory holding the ``*.schema.json`` files (source tree or installed wheel)."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "schemas", here / "_schemas"):
        if (candidate / "plan.schema.json").is_file():
            return candidate
    raise FileNotFoundError("wiretrace schemas not found beside the package")


@functools.lru_cache(maxsize=None)
def declaration(table: str) -> dict:
    """The parsed ``schemas/<table>.schema.json`` declaration."""
    if table not in TABLES:
        raise KeyError(f"unknown table {table!r}; expected one of {', '.join(TABLES)}")
    return json.loads((schema_dir() / f"{table}.schema.json").read_text())


def fields(table: str) -> list[dict]:
    """Field declarations of ``table`` in column order."""
    return declaration(table)["fields"]


def column_names(table: str) -> list[str]:
    return [f["name"] for f in fields(table)]


@functools.lru_cache(maxsize=None)
def arrow_schema(table: str) -> pa.Schema:
    """The :class:`pyarrow.Schema` of ``table``; each field carries ``unit`` and ``description``."""
    out = []
    for f in fields(table):
        meta = {"unit": f.get("unit", ""), "description": f["description"]}
        out.append(pa.field(f["name"], _SCALAR[f["type"]], nullable=False, metadata=meta))
    return pa.schema(out, metadata={"table": table, "description": declaration(table)["description"]})


def numpy_dtype(table: str, name: str) -> np.dtype:
    """NumPy dtype used for column ``name`` while a stage builds it (object for strings/lists)."""
    for f in fields(table):
        if f["name"] == name:
            t = f["type"]
            if t in ("string", "dictionary<string>", "list<int32>"):
                return np.dtype(object)
            return np.dtype("bool" if t == "bool" else t)
    raise KeyError(f"table {table} has no column {name!r}")


def to_arrow(table: str, columns: Mapping[str, object]) -> pa.Table:
    """Build a :class:`pyarrow.Table` of ``table`` from columns.

    Parameters
    ----------
    table : one of ``TABLES``.
    columns : mapping name -> array-like (NumPy array, list, or pyarrow Array), all the same length.
        Every declared column must be present; extra columns are an error, except private ones
        (names starting with ``_``, such as packetize's template column), which are left out.

    Raises
    ------
    ValueError : a column is missing, unknown, or of a different length.
    """
    schema = arrow_schema(table)
    names = set(columns)
    missing = [f.name for f in schema if f.name not in names]
    extra = sorted(n for n in names - set(schema.names) if not n.startswith("_"))
    if missing or extra:
        raise ValueError(f"table {table}: missing columns {missing}, unknown columns {extra}")
    arrays = []
    for f in schema:
        col = columns[f.name]
        if isinstance(col, (pa.Array, pa.ChunkedArray)):
            arr = col if col.type == f.type else col.cast(f.type)
        elif pa.types.is_dictionary(f.type):
            arr = pa.array(np.asarray(col, dtype=object) if not isinstance(col, list) else col,
                           type=pa.string()).dictionary_encode()
            arr = arr.cast(f.type)
        else:
            arr = pa.array(col, type=f.type)
        arrays.append(arr)
    return pa.Table.from_arrays(arrays, schema=schema)


def empty(table: str) -> pa.Table:
    """A zero-row table with the declared schema."""
    return arrow_schema(table).empty_table()


def check(table: str, t: pa.Table) -> None:
    """Raise ValueError unless ``t`` has exactly the declared column names and types of ``table``."""
    want = arrow_schema(table)
    got = [(f.name, f.type) for f in t.schema]
    exp = [(f.name, f.type) for f in want]
    if got != exp:
        raise ValueError(f"table {table}: columns {got} differ from the declared {exp}")
