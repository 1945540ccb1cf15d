"""Pieces every measured-schedule reader shares: dtype and op names, the two size conventions,
a column builder for the collectives table, and tolerant file opening.

Conventions for facts a measured file does not state (also written in
``schemas/collectives.schema.json``):

- ``phase`` is ``unknown``: logs and traces do not say which training phase issued a call.
- ``bytes_global`` / ``bytes_per_rank`` are ``-1`` and ``dtype`` is ``unknown`` when the file
  gives no size; such rows are listed in ``report["unknown_sizes"]``; nothing is invented.
- ``group_size`` is ``-1`` and ``ranks`` is empty when the file does not say who took part.
- ``parallelism`` is ``other`` unless the process-group description names one.
- ``algorithm`` is ``ring`` unless the file names the algorithm (kernel name, ``NCCL_ALGO``).
- ``iteration`` is 0, ``layer``/``microbatch``/``stage`` are -1, ``tensor`` is empty.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..tables import column_names, to_arrow

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
       "all_to_allv", "send_recv")
"""Operations of the collectives table."""

UNKNOWN = -1
"""Value of an integer column whose quantity the measured file does not give."""

# dtype name -> bytes per element, names as in wiretrace.plan.DTYPE_BYTES.
DTYPE_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp64": 8, "int8": 1, "uint8": 1,
              "int32": 4, "uint32": 4, "int64": 8, "uint64": 8}

# ncclDataType_t (nccl.h; RCCL uses the same numbers): 9 bfloat16 from NCCL 2.10, 10/11 fp8
# e4m3/e5m2 from NCCL 2.24 (RCCL: rccl_float8 / rccl_bfloat8).
NCCL_DTYPE = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64",
              6: "fp16", 7: "fp32", 8: "fp64", 9: "bf16", 10: "fp8", 11: "fp8"}

# ncclRedOp_t (nccl.h); values >= 5 are created at run time (ncclRedOpCreatePreMulSum).
NCCL_REDOP = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}

# Parallelism named by a process-group description (Megatron-LM parallel_state group_desc,
# torchtitan DeviceMesh dim names).
_PARALLELISM_WORDS = (
    ("tp", ("tensor_model_parallel", "tensor_parallel", "tp")),
    ("pp", ("pipeline_model_parallel", "pipeline_parallel", "pp")),
    ("cp", ("context_parallel", "cp")),
    ("ep", ("expert_model_parallel", "expert_parallel", "ep")),
    ("dp", ("data_parallel", "dp", "dp_shard", "dp_replicate", "fsdp")),
)


def parallelism_from_desc(desc: str | None) -> str:
    """``dp``/``tp``/``pp``/``cp``/``ep`` when a process-group description names one, else ``other``.

    Matches whole words of the lower-cased description (``TENSOR_MODEL_PARALLEL_GROUP`` -> tp,
    ``mesh_dp_shard`` -> dp); ``default_pg`` and unnamed groups stay ``other``.
    """
    if not desc:
        return "other"
    text = desc.lower()
    words = set(re.split(r"[^a-z0-9]+", text))
    for name, keys in _PARALLELISM_WORDS:
        for key in keys:
            if "_" in key:
                if key in text:
                    return name
            elif key in words:
                return name
    return "other"


def sizes(op: str, elem_bytes: int, count: int, n: int) -> tuple[int, int]:
    """``(bytes_global, bytes_per_rank)`` of one call from NCCL's ``count`` convention.

    ``count`` is NCCL's element count (nccl.h): the whole buffer for all_reduce, broadcast and
    reduce; each rank's send count for all_gather; each rank's receive count for reduce_scatter;
    each rank's input for all_to_all; the message for send_recv. ``bytes_global`` is the
    nccl-tests size ``S`` (whole gathered/scattered buffer), and for all_to_all all ranks' input
    (schemas/collectives.schema.json). Unknown inputs (-1) give -1.

    Parameters
    ----------
    op : operation name of the collectives table.
    elem_bytes : bytes per element (-1 when unknown).
    count : elements (NCCL convention above; -1 when unknown).
    n : ranks in the communicator (-1 when unknown).
    """
    if elem_bytes < 0 or count < 0:
        return UNKNOWN, UNKNOWN
    per_rank = count * elem_bytes
    if op in ("all_gather", "reduce_scatter", "all_to_all", "all_to_allv"):
        return (per_rank * n if n > 0 else UNKNOWN), per_rank
    return per_rank, per_rank


@dataclass
class Skip:
    """One input line or event that was not used, and why."""

    file: str
    line: int | str
    reason: str

    def as_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "reason": self.reason}


class Rows:
    """Column builder for the collectives table: ``add`` one call, ``table()`` at the end.

    Columns not given take the measured-schedule defaults documented in this module.
    ``op_id`` is assigned in row order by :meth:`table`.
    """

    DEFAULTS = {"iteration": 0, "parallelism": "other", "phase": "unknown", "layer": -1,
                "microbatch": -1, "stage": -1, "tensor": "", "src": -1, "dst": -1,
                "algorithm": "ring", "t_ready_ns": 0, "dtype": "unknown"}

    REQUIRED = ("op", "group", "ranks", "group_size", "bytes_global", "bytes_per_rank", "source")

    def __init__(self) -> None:
        self.cols: dict[str, list] = {name: [] for name in column_names("collectives") if name != "op_id"}

    def __len__(self) -> int:
        return len(self.cols["op"])

    def add(self, **values) -> None:
        missing = [k for k in self.REQUIRED if k not in values]
        if missing:
            raise TypeError(f"collectives row lacks {missing}")
        if values["op"] not in OPS:
            raise ValueError(f"unknown op {values['op']!r}")
        for name, col in self.cols.items():
            col.append(values[name] if name in values else self.DEFAULTS[name])

    def extend(self, other: "Rows", group_offset: int = 0) -> None:
        for name, col in self.cols.items():
            vals = other.cols[name]
            if name == "group":
                vals = [g + group_offset for g in vals]
            col.extend(vals)

    def table(self, order: list[int] | None = None) -> pa.Table:
        """The collectives table; ``order`` (indices) reorders the rows first."""
        cols = dict(self.cols)
        if order is not None:
            cols = {k: [v[i] for i in order] for k, v in cols.items()}
        n = len(cols["op"])
        out: dict[str, object] = {"op_id": np.arange(n, dtype=np.int64)}
        for name, vals in cols.items():
            if name == "ranks":
                out[name] = pa.array([list(map(int, r)) for r in vals], type=pa.list_(pa.int32()))
            else:
                out[name] = vals
        return to_arrow("collectives", out)


def json_values(text: str, pos: int, gap, end: str | None = None,
                decoder: json.JSONDecoder | None = None) -> tuple[list, tuple[int, str] | None]:
    """The JSON values of ``text`` from ``pos`` on, one after another, the characters for which
    ``gap(c)`` is true between them, up to the end of the text or a character ``end``; decoded
    by ``decoder`` (default: a plain :class:`json.JSONDecoder`).

    Returns ``(values, cut)``: ``cut`` is None, or ``(line, message)`` of the first value that
    does not decode (a file cut off while written): the values before it are kept.
    """
    dec = decoder or json.JSONDecoder()
    values: list = []
    while True:
        while pos < len(text) and gap(text[pos]):
            pos += 1
        if pos >= len(text) or text[pos] == end:
            return values, None
        try:
            value, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            return values, (text.count("\n", 0, pos) + 1, e.msg)
        values.append(value)


def read_bytes(path: Path, skipped: list[Skip]) -> bytes:
    """Whole file content, gunzipped when it starts with the gzip magic.

    A gzip stream cut off before its end yields what could be decompressed and a :class:`Skip`
    entry saying so (never an exception).
    """
    raw = Path(path).read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as e:
        d = zlib.decompressobj(wbits=47)
        try:
            out = d.decompress(raw)
        except zlib.error:
            out = b""
        skipped.append(Skip(str(path), "end", f"gzip stream is cut off or damaged ({e}); "
                                               f"read the first {len(out):,} bytes"))
        return out


def read_head(path: Path, n: int = 4 << 20) -> bytes:
    """The first ``n`` bytes of a file's content (gunzipped when it is gzip), for format detection."""
    with open(path, "rb") as f:
        raw = f.read(n)
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        with gzip.open(path, "rb") as g:
            return g.read(n)
    except (EOFError, OSError, zlib.error):
        return zlib.decompressobj(wbits=47).decompress(raw)


def iter_lines(path: Path, skipped: list[Skip]):
    """Lines of a text file (gzip accepted) without line ends, streamed: a multi-GB log is never
    held in memory. A cut-off gzip stream ends the lines where it breaks, with a :class:`Skip`."""
    path = Path(path)
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    n = 0
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace", newline=None) as f:
            for line in f:
                n += 1
                yield line.rstrip("\r\n")
    except (EOFError, OSError, zlib.error) as e:
        skipped.append(Skip(str(path), n + 1, f"gzip stream is cut off or damaged ({e}); read {n:,} lines"))


def text_lines(data: bytes) -> list[str]:
    """Decode as UTF-8 (bad bytes replaced) and split into lines without line ends."""
    return data.decode("utf-8", errors="replace").splitlines()


def counts_by_op(ops: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in ops:
        out[op] = out.get(op, 0) + 1
    return dict(sorted(out.items()))


@dataclass
class Partial:
    """What one reader extracted from its files, before the readers' results are merged."""

    fmt: str
    rows: Rows = field(default_factory=Rows)
    order_keys: list = field(default_factory=list)
    report: dict = field(default_factory=dict)
    skipped: list[Skip] = field(default_factory=list)
    rings: dict[int, list[int] | None] = field(default_factory=dict)
    transports: dict[tuple[int, int], str] = field(default_factory=dict)
    trees: dict[int, dict[int, dict]] = field(default_factory=dict)
    communicators: list[dict] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)
    unknown_sizes: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)
