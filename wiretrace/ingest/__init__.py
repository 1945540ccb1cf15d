"""Measured schedules: NCCL debug logs, PyTorch profiler traces, Chakra execution traces and
nccl-tests output, read into the collectives table the analytical stage produces.

>>> got = read_schedule(["rank0.log", "rank1.log"])        # doctest: +SKIP
>>> got.table            # collectives table (schemas/collectives.schema.json)
>>> print(format_report(got.report))

One module per format (:mod:`.nccl_log`, :mod:`.kineto`, :mod:`.chakra`, :mod:`.nccl_tests`);
this module detects formats, runs each reader on all files of its format (calls are matched
across the files of one run), and merges the results. The conventions for what a measured
file does not say (phase ``unknown``, size ``-1``, ...) are listed in :mod:`.common`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pyarrow as pa

from ..errors import InputFormatError, WiretraceError
from . import chakra, kineto, nccl_log, nccl_tests
from .common import Partial, Rows, Skip, counts_by_op, read_head, text_lines

FORMATS = ("nccl-log", "kineto", "chakra", "nccl-tests")
"""Names accepted by ``fmt`` (and ``wiretrace schedule --format``), besides ``auto``."""

_READERS = {"nccl-log": nccl_log.read, "kineto": kineto.read, "chakra": chakra.read,
            "nccl-tests": nccl_tests.read}


@dataclass
class ScheduleRead:
    """What :func:`read_schedule` extracted.

    Attributes
    ----------
    table : collectives table (schemas/collectives.schema.json), one row per call; ``source``
        names ``file:line`` (logs, nccl-tests), ``file#traceEvents[i]`` (kineto) or
        ``file:node ID`` (Chakra).
    report : JSON-serialisable summary: ``files``, ``counts`` (calls per op), ``ranks``,
        ``world_size``, ``communicators``, ``nccl_version``, ``skipped`` (list of
        ``{file, line, reason}``), ``mismatches``, ``unknown_sizes``, ``notes`` and
        format-specific entries (``nccl_tests`` rows, ``net_devices``, ``ring_sets``...).
    rings : channel -> ring order (list of ranks) read from NCCL logs, or ``None`` when NCCL
        truncated the ring or the log leaves it out; empty when no log gave rings.
    transports : ``(src_rank, dst_rank)`` -> transport class of that connection
        (``P2P``, ``SHM``, ``NET/IB``, ``NET/IB/RoCE``, ``NET/Socket``, ...).
    trees : channel -> rank -> ``{"up": parent, "down": [children]}`` from NCCL ``Trees`` lines.
    """

    table: pa.Table
    report: dict
    rings: dict[int, list[int] | None] = field(default_factory=dict)
    transports: dict[tuple[int, int], str] = field(default_factory=dict)
    trees: dict[int, dict[int, dict]] = field(default_factory=dict)

    def complete_rings(self) -> dict[int, list[int]]:
        """The rings NCCL printed whole (channel -> ranks in ring order), without the incomplete
        (``None``) channels: what a lowering can follow without guessing."""
        return {ch: r for ch, r in self.rings.items() if r is not None}


def detect_format(path: Path | str) -> str:
    """The format of one file: ``nccl-log``, ``kineto``, ``chakra`` or ``nccl-tests``.

    Looks at the content (gzip is opened first), not at the name, except that a binary file is
    taken as a Chakra ``.et`` only when it parses as length-prefixed protobuf messages.

    Raises
    ------
    InputFormatError : the file is empty, or none of the known formats (the message lists them).
    FileNotFoundError : the file does not exist.
    """
    path = Path(path)
    data = read_head(path)
    if not data.strip():
        raise InputFormatError(f"{path}: no content (empty, or whitespace only)")
    head = data[:4096]
    stripped = head.lstrip()
    if stripped[:1] in (b"{", b"["):
        text = data[:1 << 20].decode("utf-8", errors="replace")
        if '"traceEvents"' in text:
            return "kineto"
        if chakra.looks_like_json(text):
            return "chakra"
    elif _is_text(head):
        lines = text_lines(data)
        if nccl_tests.looks_like(lines):
            return "nccl-tests"
        if nccl_log.looks_like(lines):
            return "nccl-log"
    elif chakra.looks_like_binary(data):
        return "chakra"
    raise InputFormatError(f"{path}: not a format wiretrace reads; known formats: "
                           f"{', '.join(FORMATS)} (NCCL_DEBUG=INFO log, PyTorch profiler trace JSON, "
                           f"Chakra .et/JSON, nccl-tests output)")


def _is_text(head: bytes) -> bool:
    if not head:
        return False
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        return e.start > len(head) - 4  # a multi-byte character cut at the 4 KiB boundary


def read_schedule(paths: Iterable[Path | str] | Path | str, fmt: str = "auto",
                  world_size: int | None = None) -> ScheduleRead:
    """Read measured collective schedules into one collectives table.

    Parameters
    ----------
    paths : files of one run: NCCL debug logs (one file with all ranks or one per rank),
        PyTorch profiler traces (Chrome trace JSON, ``.gz`` too; one per rank), Chakra
        execution traces (``.et`` binary, jsonizer JSON, older JSON, PyTorch host execution
        trace) or nccl-tests output. Files of different formats may be mixed; calls are matched
        across the files of one format.
    fmt : ``auto`` (detect per file) or one of :data:`FORMATS` for all files.
    world_size : ranks taking part when a trace does not say (Chakra GPU nodes carry no group
        size); ``None`` leaves ``group_size`` -1 and ``ranks`` empty for those rows.

    Returns
    -------
    ScheduleRead : table, report, rings, transports, trees.

    Raises
    ------
    InputFormatError : a file is in no known format, or ``fmt`` is not a known name.
    WiretraceError : nothing usable was read from any file (every line malformed or skipped);
        the message names the first reasons.
    FileNotFoundError : a path does not exist.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise WiretraceError("no input files given")
    if fmt != "auto" and fmt not in FORMATS:
        raise InputFormatError(f"unknown format {fmt!r}; known formats: auto, {', '.join(FORMATS)}")
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(2, "No such file or directory", str(p))
        if p.is_dir():
            raise IsADirectoryError(21, "Is a directory", str(p))
    by_fmt: dict[str, list[Path]] = {}
    for p in paths:
        f = detect_format(p) if fmt == "auto" else fmt
        by_fmt.setdefault(f, []).append(p)

    parts: list[Partial] = []
    for f in FORMATS:
        if f in by_fmt:
            if f == "chakra":
                parts.append(chakra.read(by_fmt[f], world_size=world_size))
            else:
                parts.append(_READERS[f](by_fmt[f]))
    return _merge(parts, paths)


def _merge(parts: list[Partial], paths: list[Path]) -> ScheduleRead:
    rows = Rows()
    communicators, mismatches, unknown, notes, files, skipped = [], [], [], [], [], []
    rings: dict = {}
    transports: dict = {}
    trees: dict = {}
    extra: dict = {}
    offset = 0
    for part in parts:
        rows.extend(part.rows, group_offset=offset)
        for c in part.communicators:
            communicators.append({**c, "group": c["group"] + offset, "format": part.fmt})
        for m in part.mismatches:
            mismatches.append({**m, "group": m["group"] + offset} if "group" in m else m)
        ngroups = max([g + 1 for g in part.rows.cols["group"]] + [len(part.communicators)] + [0])
        offset += ngroups
        unknown += part.unknown_sizes
        for note in part.notes:
            if note not in notes:
                notes.append(note)
        files += part.files
        skipped += [s.as_dict() for s in part.skipped]
        if part.rings and not rings:
            rings = part.rings
        transports.update(part.transports)
        if part.trees and not trees:
            trees = part.trees
        for k, v in part.report.items():
            if k in ("counts",):
                continue
            if k not in extra or extra[k] in (None, [], {}):
                extra[k] = v
    table = rows.table()
    ranks = sorted({r for rs in rows.cols["ranks"] for r in rs})
    report = {
        "files": files,
        "collectives": len(rows),
        "counts": counts_by_op(rows.cols["op"]),
        "bytes_global": _bytes_by_op(rows),
        "ranks": ranks,
        "world_size": (max(ranks) + 1) if ranks else None,
        "communicators": communicators,
        "nccl_version": extra.pop("nccl_version", None),
        "skipped": skipped,
        "mismatches": mismatches,
        "unknown_sizes": unknown,
        "notes": notes,
        "rings": {str(ch): r for ch, r in rings.items()},
        "transports": {f"{a}->{b}": t for (a, b), t in sorted(transports.items())},
        **extra,
    }
    usable = len(rows) or rings or transports or trees or report.get("net_devices") or report.get("nccl_tests")
    if not usable:
        why = "; ".join(f"{s['file']}:{s['line']}: {s['reason']}" for s in skipped[:3])
        names = ", ".join(str(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
        raise WiretraceError(f"nothing usable read from {names}" + (f" ({why})" if why else
                                                                   " (no collective calls, rings or transports)"))
    json.dumps(report)  # the report must stay JSON-serialisable
    return ScheduleRead(table=table, report=report, rings=rings, transports=transports, trees=trees)


def _bytes_by_op(rows: Rows) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, b in zip(rows.cols["op"], rows.cols["bytes_global"]):
        if b >= 0:
            out[op] = out.get(op, 0) + b
    return dict(sorted(out.items()))


def _plural(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_report(report: dict, max_skipped: int = 10) -> str:
    """Human-readable summary of :attr:`ScheduleRead.report`: files, calls and bytes per op,
    ranks, communicators, rings, transports, mismatches, unknown sizes, skipped lines and why.

    Parameters
    ----------
    report : the ``report`` of :func:`read_schedule`.
    max_skipped : skipped lines listed one by one; the rest are counted.
    """
    out = []
    for f in report.get("files", []):
        size = f.get("lines", f.get("events", f.get("nodes")))
        unit = "lines" if "lines" in f else "events" if "events" in f else "nodes"
        out.append(f"read {f['path']} ({f['format']}" + (f", {size:,} {unit})" if size is not None else ")"))
    if report.get("nccl_version"):
        out.append(f"NCCL version   {report['nccl_version']}")
    out.append(f"collectives    {report.get('collectives', 0):,}")
    bytes_by_op = report.get("bytes_global", {})
    for op, n in report.get("counts", {}).items():
        b = bytes_by_op.get(op)
        out.append(f"  {op:<15} {n:>8,} {'call ' if n == 1 else 'calls'}"
                   + (f"  {_human_bytes(b):>12} (bytes_global)" if b else ""))
    ranks = report.get("ranks") or []
    if ranks:
        out.append(f"ranks          {len(ranks):,} (world size {report.get('world_size')})")
    hosts = report.get("hosts") or []
    if hosts:
        out.append(f"hosts          {len(hosts)} ({', '.join(hosts[:6])}{', ...' if len(hosts) > 6 else ''})")
    comms = report.get("communicators", [])
    if comms:
        out.append(f"communicators  {len(comms)}")
        for c in comms[:12]:
            extra = f", {_plural(c['processes'], 'process', 'processes')} logged" if "processes" in c else ""
            name = f" (process group {c['name']})" if c.get("name") else ""
            size = f"{c['size']} ranks" if c["size"] >= 0 else "ranks unknown"
            out.append(f"  group {c['group']}{name}: {size}, {_plural(c['calls'], 'call', 'calls')}{extra}")
        if len(comms) > 12:
            out.append(f"  ... {len(comms) - 12} more")
    rings = report.get("rings") or {}
    if rings:
        done = [ch for ch, r in rings.items() if r is not None]
        out.append(f"rings          {len(rings)} channels, {len(done)} complete"
                   + (f", {len(rings) - len(done)} incomplete (truncated or not in the log)" if len(done) < len(rings) else ""))
    edges = report.get("transport_edges")
    if edges:
        out.append("transports     " + ", ".join(f"{k}: {v} edges" for k, v in edges.items()))
    for d in report.get("net_devices", []):
        out.append(f"net device     {d['host']} [{d['index']}] {d['name']} port {d['port']} {d['link_layer']}"
                   + (" (relaxed ordering)" if d.get("relaxed_ordering") else ""))
    mism = report.get("mismatches", [])
    if mism:
        out.append(f"MISMATCHES     {len(mism)} calls where ranks disagree")
        for m in mism[:5]:
            vs = "; ".join(f"{v['op']} count {v['count']} {v['dtype']} ({v['ranks_reporting']} ranks)"
                           for v in m.get("variants", []))
            out.append(f"  group {m.get('group')} opCount {m.get('opCount', m.get('index'))}: {vs}")
    unk = report.get("unknown_sizes", [])
    if unk:
        out.append(f"unknown size   {len(unk)} calls (bytes -1 in the table)")
        for u in unk[:5]:
            out.append(f"  {u['source']}: {u['reason']}")
    notes = report.get("notes", [])
    for note in notes[:10]:
        out.append(f"note           {note}")
    if len(notes) > 10:
        out.append(f"               ... {len(notes) - 10} more notes")
    sk = report.get("skipped", [])
    for f in report.get("files", []):
        if f.get("format") == "nccl-tests" and f.get("op"):
            tests = [t for t in report.get("nccl_tests", []) if t.get("file") == f["path"]]
            if tests:
                sizes = [t["size"] for t in tests]
                peak = max(tests, key=lambda t: t["busbw"])
                out.append(f"nccl-tests     {f['op']} over {f.get('ranks') or '?'} ranks "
                           f"({f.get('ranks_from') or 'unknown'}): {len(tests)} sizes "
                           f"{_human_bytes(min(sizes))}..{_human_bytes(max(sizes))}, peak busbw "
                           f"{peak['busbw']:.2f} GB/s at {_human_bytes(peak['size'])}")
    out.append(f"skipped        {len(sk)}")
    for s in sk[:max_skipped]:
        out.append(f"  {s['file']}:{s['line']}: {s['reason']}")
    if len(sk) > max_skipped:
        out.append(f"  ... {len(sk) - max_skipped} more")
    return "\n".join(out)


__all__ = ["FORMATS", "ScheduleRead", "detect_format", "format_report", "read_schedule", "Skip"]
