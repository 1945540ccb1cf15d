"""PyTorch profiler traces (Kineto's Chrome trace JSON, ``.json`` or ``.json.gz``), one per rank.

A collective is a GPU kernel event (``cat`` ``kernel``) named ``ncclKernel_*`` (NCCL < 2.19)
or ``ncclDevKernel_*``. PyTorch (``torch/csrc/distributed/c10d/ParamCommsUtils``) attaches the
call's parameters to the kernel's args, or, in older releases, only to the CPU-side
``record_param_comms`` op with the same ``External id``:

``Collective name``, ``In msg nelems``, ``Out msg nelems``, ``Group size``, ``dtype`` (a c10
ScalarType name such as ``Float``), ``In split size`` / ``Out split size`` (all_to_allv),
``Process Group Name`` / ``Description`` / ``Ranks``, ``Global rank start`` / ``stride``,
``Src Rank`` / ``Dst Rank`` (send/recv).

The dtype comes from these args, never from the kernel name (broadcasts run as ``int8_t``
kernels whatever the tensor type). ``ts`` is in microseconds (float), read as decimal text so
that times are exact to the nanosecond. When the trace has ``ProfilerStep#N`` annotations, a
call belongs to the step during which its kernel was launched (the runtime event with the
kernel's ``correlation``): ``iteration`` is N minus the first step number of all traces read,
and ``t_ready_ns`` the kernel start minus that step's start. Without steps, ``iteration`` is 0
and ``t_ready_ns`` the kernel start minus the first collective kernel's start in the trace. ``wait`` / ``barrier``-only records are not
collectives. With several traces (one per rank), the k-th call on a process group in one
trace is the k-th call on that group in every other trace (the order NCCL requires); ranks
disagreeing about op or size are a mismatch. A trace cut off mid-file is read up to the last
complete event.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from decimal import Decimal, InvalidOperation
from pathlib import Path

from .common import (UNKNOWN, Partial, Skip, counts_by_op, json_values, parallelism_from_desc, read_bytes,
                     sizes)

# c10::ScalarType names (c10/core/ScalarType.h) -> (table dtype, bytes per element).
SCALAR_TYPES = {
    "Float": ("fp32", 4), "Half": ("fp16", 2), "BFloat16": ("bf16", 2), "Double": ("fp64", 8),
    "Long": ("int64", 8), "Int": ("int32", 4), "Short": ("unknown", 2), "Char": ("int8", 1),
    "Byte": ("uint8", 1), "Bool": ("uint8", 1), "UInt16": ("unknown", 2), "UInt32": ("uint32", 4),
    "UInt64": ("uint64", 8), "ComplexHalf": ("unknown", 4), "ComplexFloat": ("unknown", 8),
    "ComplexDouble": ("unknown", 16), "Float8_e4m3fn": ("fp8", 1), "Float8_e5m2": ("fp8", 1),
    "Float8_e4m3fnuz": ("fp8", 1), "Float8_e5m2fnuz": ("fp8", 1),
}

_KERNEL = re.compile(r"^(?:ncclKernel|ncclDevKernel)_(?P<op>[A-Za-z]+)")
_KERNEL_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
               "Broadcast": "broadcast", "Reduce": "reduce", "SendRecv": "send_recv"}


def normalize_op(name: str) -> str | None:
    """Table op of a ``Collective name`` (``allreduce``, ``_allgather_base``,
    ``reduce_scatter_tensor_coalesced``, ``alltoall_base``, ``send``...); ``send``/``recv`` are
    returned as such; ``None`` for names that move no tensor (``wait``, ``barrier``) or are not
    operations of the table (``gather``, ``scatter``)."""
    n = name.lower().strip()
    n = n.split(":", 1)[1] if n.startswith("nccl:") else n
    n = n.replace("_", "")
    for suffix in ("coalesced", "intotensor", "tensor", "base", "oop"):
        n = n.removesuffix(suffix)
    return {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
            "broadcast": "broadcast", "reduce": "reduce", "alltoall": "all_to_all",
            "alltoallv": "all_to_allv", "send": "send", "recv": "recv",
            "recvanysource": "recv"}.get(n)


def _ranks_list(text) -> list[int] | None:
    if isinstance(text, list):
        return [int(x) for x in text]
    if not isinstance(text, str):
        return None
    nums = re.findall(r"-?\d+", text)
    return [int(x) for x in nums] if "..." not in text else None


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        try:
            return int(Decimal(str(v)))
        except (InvalidOperation, ValueError):
            return None


def _load(data: bytes, fname: str, skipped: list[Skip]) -> tuple[dict, list[tuple[int, dict]]]:
    """Top-level metadata and ``(index, event)`` pairs; a cut-off file yields its complete events."""
    text = data.decode("utf-8", errors="replace")
    try:
        doc = json.loads(text, parse_float=str)
        if isinstance(doc, list):
            return {}, list(enumerate(e for e in doc if isinstance(e, dict)))
        evs = doc.get("traceEvents", [])
        return {k: v for k, v in doc.items() if k != "traceEvents"}, \
            [(i, e) for i, e in enumerate(evs) if isinstance(e, dict)]
    except json.JSONDecodeError as e:
        err = e
    dec = json.JSONDecoder(parse_float=str)
    meta: dict = {}
    for key in ("distributedInfo", "baseTimeNanoseconds"):
        m = re.search(r'"%s"\s*:\s*' % key, text)
        if m:
            try:
                meta[key], _ = dec.raw_decode(text, m.end())
            except json.JSONDecodeError:
                pass
    m = re.search(r'"traceEvents"\s*:\s*\[', text)
    if m is None and text.lstrip().startswith("["):
        m = re.match(r"\s*\[", text)
    if m is None:
        skipped.append(Skip(fname, err.lineno, f"not valid JSON and no traceEvents array found ({err.msg})"))
        return meta, []
    values, cut = json_values(text, m.end(), lambda c: c in " \t\r\n,", end="]", decoder=dec)
    events = [(i, ev) for i, ev in enumerate(values) if isinstance(ev, dict)]
    if cut is not None:
        i = len(values)
        skipped.append(Skip(fname, cut[0], f"trace is cut off or damaged inside traceEvents[{i}] ({cut[1]}); "
                                            f"read the {i} events before it"))
    return meta, events


def read(paths: list[Path]) -> Partial:
    """Read PyTorch profiler traces (one per rank) into collectives rows.

    Parameters
    ----------
    paths : Chrome trace JSON files (gzip accepted).

    Returns
    -------
    Partial : one row per call and process group (matched across traces), ``source``
        ``file#traceEvents[i]`` of the earliest trace that logged it; ``t_ready_ns`` as described
        in the module docstring.
    """
    out = Partial("kineto")
    per_trace: list[dict] = []
    versions = []
    for tidx, path in enumerate(paths):
        fname = str(path)
        meta, events = _load(read_bytes(path, out.skipped), fname, out.skipped)
        dist = meta.get("distributedInfo") or {}
        if dist.get("nccl_version"):
            versions.append(str(dist["nccl_version"]))
        rank = _int(dist.get("rank"))
        if rank is None:
            m = re.search(r"rank[_\-]?(\d+)", Path(fname).name)
            rank = int(m.group(1)) if m else tidx
        pg_conf = {str(p.get("pg_name")): p for p in dist.get("pg_config", []) if isinstance(p, dict)}
        cpu_args, launches, steps = {}, {}, []
        for _, e in events:
            name, args = e.get("name", ""), e.get("args") or {}
            if name == "record_param_comms" and "External id" in args:
                cpu_args[args["External id"]] = args
            elif str(e.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver", "runtime") and "correlation" in args:
                launches[args["correlation"]] = e.get("ts")
            elif name.startswith("ProfilerStep#") and e.get("ph") == "X":
                m = re.match(r"ProfilerStep#(\d+)", name)
                if m:
                    steps.append((Decimal(str(e.get("ts"))), int(m.group(1))))
        steps.sort()
        calls = []
        for idx, e in events:
            name = e.get("name", "")
            if str(e.get("cat", "")).lower() != "kernel" or not _KERNEL.match(name):
                continue
            args = dict(e.get("args", {}))
            if "Collective name" not in args:
                args = {**cpu_args.get(args.get("External id"), {}), **args}
            call = _call(name, args, idx, e, fname, rank, pg_conf, out)
            if call is not None:
                launch = launches.get(args.get("correlation"))
                call["launch"] = Decimal(str(launch)) if launch is not None else call["ts"]
                calls.append(call)
        if calls and steps:
            starts = [t for t, _ in steps]
            for c in calls:
                start, step = steps[max(bisect.bisect_right(starts, c["launch"]) - 1, 0)]
                c["step"] = step
                c["t_ns"] = max(0, int((c["ts"] - start) * 1000))
        elif calls:
            t0 = min(c["ts"] for c in calls)
            for c in calls:
                c["t_ns"] = int((c["ts"] - t0) * 1000)
        out.files.append({"path": fname, "format": "kineto", "events": len(events), "rank": rank,
                          "collective_kernels": len(calls)})
        per_trace.append({"rank": rank, "calls": calls})
    _combine(per_trace, out)
    out.report["nccl_version"] = versions[0] if versions else None
    return out


def _call(name, args, idx, e, fname, rank, pg_conf, out) -> dict | None:
    where = f"{fname}#traceEvents[{idx}]"
    try:
        ts = Decimal(str(e.get("ts")))
    except InvalidOperation:
        out.skipped.append(Skip(fname, f"traceEvents[{idx}]", f"kernel {name[:40]} has no numeric ts"))
        return None
    algo = "ring"
    if "_TREE" in name:
        algo = "tree"
    elif "_RING" not in name and ("COLLNET" in name or "NVLS" in name or "PAT" in name):
        out.notes.append(f"{where}: kernel {name.split('(')[0]} uses an algorithm the table does not name; row says ring")
    coll = args.get("Collective name")
    km = _KERNEL.match(name)
    if coll is None:
        op = _KERNEL_OPS.get(km.group("op"))
        if op is None:
            out.skipped.append(Skip(fname, f"traceEvents[{idx}]", f"kernel {name[:40]}: unknown NCCL operation"))
            return None
        out.unknown_sizes.append({"source": where, "reason": "kernel carries no Collective name / msg nelems "
                                                            "and no record_param_comms matches its External id"})
        return {"op": op, "pg": "?", "bg": UNKNOWN, "bpr": UNKNOWN, "dtype": "unknown", "n": UNKNOWN,
                "ranks": [], "ts": ts, "idx": idx, "file": fname, "algo": algo, "rank": rank, "desc": None}
    op = normalize_op(str(coll))
    if op is None:
        if str(coll).lower() not in ("wait", "barrier"):
            out.skipped.append(Skip(fname, f"traceEvents[{idx}]", f"collective {coll!r} is not an operation of "
                                                                  f"the collectives table"))
        return None
    dt = SCALAR_TYPES.get(str(args.get("dtype")))
    nin, nout = _int(args.get("In msg nelems")), _int(args.get("Out msg nelems"))
    n = _int(args.get("Group size"))
    pg = str(args.get("Process Group Name", "?"))
    desc = args.get("Process Group Description") or (pg_conf.get(pg) or {}).get("pg_desc")
    ranks = _ranks_list(args.get("Process Group Ranks"))
    if n is not None and (ranks is None or len(ranks) != n):
        start, stride = _int(args.get("Global rank start")), _int(args.get("Global rank stride"))
        if start is not None and stride is not None and stride > 0:
            ranks = [start + stride * i for i in range(n)]
        elif pg in pg_conf and len(pg_conf[pg].get("ranks") or []) == n:
            ranks = [int(r) for r in pg_conf[pg]["ranks"]]
        else:
            ranks = list(range(n))
            out.notes.append(f"{where}: process group {pg} ranks not listed; assumed 0..{n - 1}")
    if n is None:
        n = len(ranks) if ranks else UNKNOWN
    call = {"pg": pg, "desc": desc, "n": n, "ranks": ranks or [], "ts": ts, "idx": idx, "file": fname,
            "algo": algo, "rank": rank}
    if dt is None or nin is None:
        out.unknown_sizes.append({"source": where, "reason": f"dtype {args.get('dtype')!r} / In msg nelems "
                                                            f"{args.get('In msg nelems')!r} not usable"})
        return {**call, "op": "send_recv" if op in ("send", "recv") else op, "bg": UNKNOWN, "bpr": UNKNOWN,
                "dtype": "unknown"}
    dtype, esz = dt
    nout = nout if nout is not None else nin
    if op in ("send", "recv"):
        peer = _int(args.get("Dst Rank" if op == "send" else "Src Rank"))
        if peer is None:
            out.skipped.append(Skip(fname, f"traceEvents[{idx}]", f"{op} kernel without "
                                                                  f"{'Dst' if op == 'send' else 'Src'} Rank"))
            return None
        nbytes = max(nin, nout) * esz
        src, dst = (rank, peer) if op == "send" else (peer, rank)
        return {**call, "op": "send_recv", "half": op, "src": src, "dst": dst, "bg": nbytes, "bpr": nbytes,
                "dtype": dtype}
    if op in ("all_to_all", "all_to_allv"):
        # split sizes count rows of dim 0 (c10d alltoall_base); bytes are their share of the input
        split_in = _ranks_list(args.get("In split size")) or []
        if split_in and (op == "all_to_allv" or len(set(split_in)) > 1):
            op = "all_to_allv"
            total = sum(split_in)
            call["splits_bytes"] = [nin * esz * s // total for s in split_in] if total else []
    if op == "all_gather":
        bpr, bg = nin * esz, (nout * esz if nout else nin * esz * max(n, 1))
    elif op == "reduce_scatter":
        bpr, bg = nout * esz, nin * esz
    else:
        bg, bpr = sizes(op, esz, nin, n)
    return {**call, "op": op, "bg": bg, "bpr": bpr, "dtype": dtype}


def _combine(per_trace: list[dict], out: Partial) -> None:
    """Match calls across traces and build rows."""
    step_numbers = [c["step"] for tr in per_trace for c in tr["calls"] if "step" in c]
    first_step = min(step_numbers) if step_numbers else 0
    if step_numbers:
        out.report["iterations"] = len(set(step_numbers))

    def iteration(c) -> int:
        return c["step"] - first_step if "step" in c else 0

    slots: dict[tuple, list[dict]] = defaultdict(list)   # (pg, k) -> calls of the ranks
    p2p: dict[tuple, dict[str, list]] = defaultdict(lambda: {"send": [], "recv": []})
    for tr in per_trace:
        seq: dict[str, int] = defaultdict(int)
        for c in tr["calls"]:
            if c["op"] == "send_recv" and "half" in c:
                p2p[(c["pg"], c["src"], c["dst"], c["bg"])][c["half"]].append(c)
                continue
            k = seq[c["pg"]]
            seq[c["pg"]] += 1
            slots[(c["pg"], k)].append(c)
    groups: dict[tuple, int] = {}
    info: dict[int, dict] = {}
    items = []

    def gid(pg, ranks, n, desc):
        key = (pg, tuple(ranks))
        if key not in groups:
            groups[key] = len(groups)
            info[groups[key]] = {"group": groups[key], "name": pg, "description": desc, "size": n, "calls": 0}
        return groups[key]

    for (pg, k), calls in slots.items():
        variants: dict[tuple, list[dict]] = {}
        for c in calls:
            variants.setdefault((c["op"], c["bg"], c["dtype"]), []).append(c)
        g = gid(pg, calls[0]["ranks"], calls[0]["n"], calls[0]["desc"])
        if len(variants) > 1:
            out.mismatches.append({"group": g, "index": k, "variants": [
                {"op": op, "count": bg, "dtype": dt, "ranks_reporting": len(cs),
                 "lines": [f"{c['file']}#traceEvents[{c['idx']}]" for c in cs[:8]]}
                for (op, bg, dt), cs in variants.items()]})
        rep = max(variants.values(), key=len)[0]
        first = min(calls, key=lambda c: c["t_ns"])
        info[g]["calls"] += 1
        row = dict(op=rep["op"], group=g, ranks=rep["ranks"], group_size=rep["n"], bytes_global=rep["bg"],
                   bytes_per_rank=max(c["bpr"] for c in calls) if rep["op"] == "all_to_allv" else rep["bpr"],
                   dtype=rep["dtype"], algorithm=rep["algo"], t_ready_ns=first["t_ns"], iteration=iteration(first),
                   parallelism=parallelism_from_desc(rep["desc"]),
                   source=f"{rep['file']}#traceEvents[{rep['idx']}]")
        if rep.get("splits_bytes"):
            out.report.setdefault("all_to_allv_splits", []).append(
                {"source": row["source"], "by_rank": {str(c["rank"]): c.get("splits_bytes") for c in calls}})
        items.append(((iteration(first), first["t_ns"], rep["idx"]), row))
    for (pg, src, dst, nbytes), sides in p2p.items():
        for k in range(max(len(sides["send"]), len(sides["recv"]))):
            pair = [x for x in (sides["send"][k] if k < len(sides["send"]) else None,
                                sides["recv"][k] if k < len(sides["recv"]) else None) if x]
            first = min(pair, key=lambda c: c["t_ns"])
            g = gid(pg, first["ranks"], first["n"], first["desc"])
            info[g]["calls"] += 1
            items.append(((iteration(first), first["t_ns"], first["idx"]), dict(
                op="send_recv", group=g, ranks=[src, dst], group_size=2, bytes_global=nbytes, bytes_per_rank=nbytes,
                dtype=first["dtype"], src=src, dst=dst, algorithm=first["algo"], t_ready_ns=first["t_ns"],
                iteration=iteration(first),
                parallelism=parallelism_from_desc(first["desc"]),
                source=f"{first['file']}#traceEvents[{first['idx']}]")))
    items.sort(key=lambda it: it[0])
    for _, row in items:
        out.rows.add(**row)
    out.communicators = list(info.values())
    out.report["counts"] = counts_by_op([r["op"] for _, r in items])
