"""nccl-tests / rccl-tests output (``all_reduce_perf`` & co.): one collectives row per size and
op, plus :func:`compare_busbw`.

Layouts read (columns are found from the header line, so reordered or missing columns work):

- current: ``size count type redop root time algbw busbw #wrong`` then the in-place group,
  times in µs;
- older: ``error`` (max abs error) instead of ``#wrong``, no ``root`` column;
- the 2017 layout (``bytes N type op time algbw busbw res``), whose unit line says ``(ms)``;
  times are converted to µs.

Launcher prefixes (``srun --label``'s ``0:``, ``mpirun --tag-output``'s ``[1,0]<stdout>:``) are
stripped. When the run printed ``NCCL_DEBUG=INFO`` lines, its rings, transports, network devices
and NCCL version are read from them as from an NCCL log (COLL lines of the benchmark's
iterations are not rows). The op comes from the binary name (``all_gather_perf`` -> all_gather). The number of
ranks comes from the ``#  Rank N ...`` lines, else the launch command (``mpirun -np``,
``srun --nodes × --ntasks-per-node`` or ``--ntasks``, times the test's ``-g``/``-t``), else the
ratio busbw/algbw (reported as inferred).

``size`` is the nccl-tests ``S`` (whole gathered buffer for all_gather, see
nccl-tests ``doc/PERFORMANCE.md``) and ``count`` NCCL's element count, so
``bytes_per_rank = count × dtype size`` and ``bytes_global = S`` (for all_to_all the table's
``bytes_global`` is all ranks' input, ``S × n``). sendrecv runs every rank sending ``S`` to the
next, so it gives n ``send_recv`` rows per size.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import nccl_log
from .common import DTYPE_SIZE, Partial, Skip, counts_by_op, read_bytes, sizes, text_lines

_PREFIX = re.compile(r"^\s*(?:\[\d+,\d+\]<\w+>:|\d+:)\s?")
_BINARY = re.compile(r"\b(all_reduce|all_gather|reduce_scatter|alltoall|broadcast|reduce|sendrecv|"
                     r"hypercube|gather|scatter)_perf\b")
_TESTS_RANK = re.compile(r"#\s*Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)")
_AVG = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([\d.]+)")
_ALGO = re.compile(r"NCCL_ALGO=(\w+)")
_NTHREAD = re.compile(r"#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)")

TEST_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
            "alltoall": "all_to_all", "broadcast": "broadcast", "reduce": "reduce", "sendrecv": "send_recv"}
TEST_TYPES = {"float": "fp32", "half": "fp16", "bfloat16": "bf16", "double": "fp64", "int8": "int8",
              "char": "int8", "uint8": "uint8", "int32": "int32", "int": "int32", "uint32": "uint32",
              "int64": "int64", "uint64": "uint64", "f8e4m3": "fp8", "f8e5m2": "fp8", "fp8_e4m3": "fp8",
              "fp8_e5m2": "fp8"}
_SYNONYMS = {"bytes": "size", "n": "count", "op": "redop", "#wrong": "wrong", "error": "wrong", "res": "wrong"}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: busbw = algbw × factor (nccl-tests ``doc/PERFORMANCE.md``).

    all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce,
    send_recv 1. These are the bytes a ring lowering puts on each rank's link per byte of ``S``
    (DESIGN.md: wiretrace's ring lowering reproduces them exactly).
    """
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "all_to_allv"):
        return (n - 1) / n
    return 1.0


def looks_like(lines: list[str]) -> bool:
    """True when a line is an nccl-tests table header (``size``/``bytes`` ... ``busbw``)."""
    return any(_is_header(_PREFIX.sub("", line)) for line in lines[:20000])


def _is_header(line: str) -> bool:
    s = line.strip()
    return s.startswith("#") and "busbw" in s and "algbw" in s and re.search(r"\b(size|bytes)\b", s) is not None


def _ranks_from_command(text: str) -> int | None:
    joined = re.sub(r"\\\s*\n", " ", text)
    procs = None
    for line in joined.splitlines():
        line = _PREFIX.sub("", line).strip().lstrip("$ ").strip()
        if not re.search(r"\b(mpirun|mpiexec|srun|orterun)\b", line):
            continue
        m = re.search(r"(?:-np|-n|--ntasks|--np)[ =](\d+)", line)
        if m:
            procs = int(m.group(1))
        else:
            nodes = re.search(r"(?:--nodes|-N)[ =](\d+)", line)
            per = re.search(r"--ntasks-per-node[ =](\d+)", line)
            if nodes and per:
                procs = int(nodes.group(1)) * int(per.group(1))
        if procs is not None:
            g = re.search(r"_perf\b.*?\s-g\s+(\d+)", line)
            t = re.search(r"_perf\b.*?\s-t\s+(\d+)", line)
            return procs * (int(g.group(1)) if g else 1) * (int(t.group(1)) if t else 1)
    return None


def _num(tok: str) -> float | None:
    try:
        return float(tok)
    except ValueError:
        return None


def read(paths: list[Path]) -> Partial:
    """Read nccl-tests output files.

    Returns
    -------
    Partial : rows (``source`` ``file:line`` of the table row) and ``report["nccl_tests"]``:
        one dict per row with ``op``, ``n``, ``size``, ``count``, ``type``, ``time_us``,
        ``algbw``, ``busbw`` (GB/s, 10^9 bytes/s, as printed), ``wrong`` and the in-place values.
    """
    out = Partial("nccl-tests")
    results = []
    items = []
    for path in paths:
        fname = str(path)
        data = read_bytes(path, out.skipped)
        text = data.decode("utf-8", errors="replace")
        lines = text_lines(data)
        mb = _BINARY.search(text)
        test = mb.group(1) if mb else None
        op = TEST_OPS.get(test) if test else None
        ranks = {int(m.group(1)): m.group(2) for m in _TESTS_RANK.finditer(text)}
        n_src = None
        if ranks:
            n, n_src = len(ranks), "# Rank lines"
        else:
            n = _ranks_from_command(text)
            if n is not None:
                n_src = "launch command"
            else:
                nt = _NTHREAD.search(text)
                if nt and int(nt.group(1)) * int(nt.group(2)) > 1:
                    n = int(nt.group(1)) * int(nt.group(2))
                    n_src = "nThread × nGpus (single process)"
        ma = _ALGO.search(text)
        algo = ma.group(1).lower() if ma and ma.group(1).lower() in ("ring", "tree") else "ring"
        header: list[str] | None = None
        time_scale = 1.0
        file_rows = []
        for lno, raw in enumerate(lines, 1):
            line = _PREFIX.sub("", raw)
            s = line.strip()
            if _is_header(line):
                names = s.lstrip("#").split()
                header = [_SYNONYMS.get(x.lower(), x.lower()) for x in names]
                continue
            if header is not None and s.startswith("#") and ("(B)" in s or "(ms)" in s or "(us)" in s):
                time_scale = 1000.0 if "(ms)" in s else 1.0
                continue
            if header is None or not s or s.startswith("#"):
                continue
            toks = s.split()
            if not toks or _num(toks[0]) is None:
                continue
            if len(toks) < header.index("busbw") + 1:
                out.skipped.append(Skip(fname, lno, f"table row has {len(toks)} of {len(header)} columns (cut off?)"))
                continue
            row = _parse_row(header, toks, time_scale)
            if row is None:
                out.skipped.append(Skip(fname, lno, "table row does not match the header's columns"))
                continue
            row.update(file=fname, line=lno)
            file_rows.append(row)
        if n is None and file_rows and op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            n = _infer_n(op, file_rows)
            n_src = "inferred from busbw/algbw" if n else None
        if op is None:
            reason = f"{test}_perf is not an operation of the collectives table" if test else \
                "no *_perf binary name in the output: the operation is unknown"
            for row in file_rows:
                out.skipped.append(Skip(fname, row["line"], reason))
            file_rows = []
        if file_rows and n is None:
            out.notes.append(f"{fname}: number of ranks unknown (no # Rank lines or launch command); "
                             f"group_size -1")
        for row in file_rows:
            row.update(op=op, n=n if n is not None else -1, n_source=n_src)
            results.append(row)
            dtype = TEST_TYPES.get(row["type"], "unknown")
            nn = n if n is not None else -1
            esz = DTYPE_SIZE.get(dtype, -1)
            if esz < 0 and row["count"] > 0:
                esz = row["size"] // row["count"] if op not in ("all_gather", "reduce_scatter") or nn < 1 \
                    else row["size"] // (row["count"] * nn)
            bg, bpr = sizes(op, esz, row["count"], nn)
            if op != "all_to_all" and bg >= 0 and bg != row["size"]:
                out.notes.append(f"{fname}:{row['line']}: size {row['size']} differs from count × dtype"
                                 f"{' × n' if op in ('all_gather', 'reduce_scatter') else ''} = {bg}")
            source = f"{fname}:{row['line']}"
            if op == "send_recv" and nn > 1:
                for r in range(nn):
                    items.append(dict(op=op, group=0, ranks=[r, (r + 1) % nn], group_size=2, bytes_global=bpr,
                                      bytes_per_rank=bpr, dtype=dtype, src=r, dst=(r + 1) % nn,
                                      algorithm=algo, source=source))
            else:
                items.append(dict(op=op, group=0, ranks=list(range(nn)) if nn > 0 else [], group_size=nn,
                                  bytes_global=bg, bytes_per_rank=bpr, dtype=dtype, algorithm=algo, source=source))
        out.files.append({"path": fname, "format": "nccl-tests", "lines": len(lines), "op": op, "ranks": n,
                          "ranks_from": n_src, **({"algorithm_env": ma.group(1)} if ma else {})})
        avg = _AVG.search(text)
        if avg:
            out.files[-1]["avg_busbw"] = float(avg.group(1))
        if nccl_log.looks_like(lines):
            # run with NCCL_DEBUG=INFO: rings, transports, devices and version from its INFO lines
            info = nccl_log.read([path])
            out.rings = out.rings or info.rings
            out.trees = out.trees or info.trees
            out.transports.update(info.transports)
            for key in ("nccl_version", "net_devices", "hosts", "transport_edges", "ring_sets"):
                if info.report.get(key) and not out.report.get(key):
                    out.report[key] = info.report[key]
            out.notes += info.notes
    for row in items:
        out.rows.add(**row)
    if items:
        out.communicators = [{"group": 0, "size": items[0]["group_size"], "calls": len(items)}]
    out.report["nccl_tests"] = [{k: v for k, v in r.items()} for r in results]
    out.report["counts"] = counts_by_op([r["op"] for r in items])
    return out


def _parse_row(header: list[str], toks: list[str], time_scale: float) -> dict | None:
    # Columns after 'busbw' repeat for the in-place run; map the first occurrence of each name.
    first: dict[str, int] = {}
    second: dict[str, int] = {}
    for i, name in enumerate(header):
        (second if name in first else first)[name] = i
    try:
        size = int(toks[first["size"]])
        count = int(toks[first["count"]]) if "count" in first else -1
        row = {"size": size, "count": count, "type": toks[first["type"]].lower() if "type" in first else "",
               "redop": toks[first["redop"]] if "redop" in first else "",
               "root": int(toks[first["root"]]) if "root" in first else -1,
               "time_us": float(toks[first["time"]]) * time_scale,
               "algbw": float(toks[first["algbw"]]), "busbw": float(toks[first["busbw"]])}
    except (KeyError, ValueError, IndexError):
        return None
    if "wrong" in first and first["wrong"] < len(toks):
        row["wrong"] = _num(toks[first["wrong"]])
    if all(k in second and second[k] < len(toks) for k in ("time", "algbw", "busbw")):
        vals = [_num(toks[second[k]]) for k in ("time", "algbw", "busbw")]
        if None not in vals:
            row["inplace"] = {"time_us": vals[0] * time_scale, "algbw": vals[1], "busbw": vals[2]}
    return row


def _infer_n(op: str, rows: list[dict]) -> int | None:
    for row in rows:
        if row["algbw"] >= 1.0 and row["busbw"] > 0:
            ratio = row["busbw"] / row["algbw"]
            best = min(range(2, 65537), key=lambda n: abs(bus_factor(op, n) - ratio))
            return best
    return None


def compare_busbw(rows: list[dict] | object, n: int | None = None) -> list[dict]:
    """Compare each nccl-tests row's busbw with what wiretrace predicts for the same op, n and size.

    The prediction is ``S / time × bus_factor(op, n)`` (:func:`bus_factor`), i.e. the bus
    bandwidth of a ring lowering that moves ``factor × S`` bytes over each rank's link in the
    measured time. ``ok`` allows for the rounding of the printed values (time to 4 digits,
    bandwidths to 0.01 GB/s).

    Parameters
    ----------
    rows : ``report["nccl_tests"]`` of :func:`wiretrace.ingest.read_schedule` (or the
        ``ScheduleRead`` itself).
    n : number of ranks, overriding what the file said.

    Returns
    -------
    list of dict, one per row: ``file``, ``line``, ``op``, ``n``, ``size`` (bytes),
    ``time_us``, ``algbw`` / ``busbw`` (reported, GB/s), ``factor``, ``algbw_predicted`` and
    ``busbw_predicted`` (GB/s = 10^9 bytes/s), ``diff`` (reported - predicted busbw), ``ok``.

    Raises
    ------
    ValueError : a row has no known number of ranks and ``n`` is not given.
    """
    if hasattr(rows, "report"):
        rows = rows.report.get("nccl_tests", [])
    out = []
    for r in rows:
        nn = n if n is not None else r.get("n", -1)
        if nn is None or nn < 1:
            raise ValueError(f"{r.get('file')}:{r.get('line')}: number of ranks unknown; pass n")
        factor = bus_factor(r["op"], nn)
        algbw = r["size"] / (r["time_us"] * 1e-6) / 1e9
        busbw = algbw * factor
        tol = 0.011 + 1e-3 * max(busbw, r["busbw"])
        out.append({"file": r.get("file"), "line": r.get("line"), "op": r["op"], "n": nn, "size": r["size"],
                    "time_us": r["time_us"], "algbw": r["algbw"], "busbw": r["busbw"], "factor": factor,
                    "algbw_predicted": algbw, "busbw_predicted": busbw, "diff": r["busbw"] - busbw,
                    "ok": abs(r["busbw"] - busbw) <= tol and abs(r["algbw"] - algbw) <= 0.011 + 1e-3 * algbw})
    return out
