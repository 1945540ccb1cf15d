"""NCCL debug logs (``NCCL_DEBUG=INFO``, NCCL 2.4 to current, RCCL): collective calls, rings,
trees, transports and the NCCL version.

What is read, line by line (launcher prefixes such as Ray's ``(RayTrainWorker pid=..)``,
``mpirun --tag-output``'s ``[1,0]<stdout>:``, ``srun --label``'s ``0:`` or torchrun's
``[default0]:`` are ignored: the reader looks for ``host:pid:tid [dev] NCCL INFO`` anywhere):

- COLL lines, printed by ``ncclEnqueueCheck`` (NCCL ``src/enqueue.cc``)::

      AllReduce: opCount 139d sendbuff 0x.. recvbuff 0x.. count 7382228 datatype 7 op 0 root 0
      comm 0x78cfda045840 [nranks=128] stream 0x..      (RCCL adds: task 0 globalrank 3)

  ``opCount`` is hexadecimal and shared by the ranks of one call; ``[dev]`` is the CUDA device,
  not the rank; ``datatype``/``op`` are the nccl.h enums; for Send/Recv ``root`` is the peer.
- init lines ``comm 0x.. rank R nRanks N ... [commId 0x..]`` (NCCL ``src/init.cc``): the rank of
  a process's communicator handle and, when printed, the communicator's id.
- ring orders ``Channel 00/08 :  0 5 4 ...`` (NCCL >= 2.5) or ``Ring 00 :  0 1 2 ...`` (2.4),
  printed by rank 0 with at most 20 ranks (``MAXWIDTH`` in NCCL ``src/graph/rings.cc``): a
  longer ring is truncated and reported as incomplete (``None``), never completed by guessing;
  per-rank ``Ring 00 : prev -> rank -> next`` lines, assembled when they close a full cycle.
- trees ``Trees [0] 2/-1/-1->1->0`` (children->rank->parent; NCCL 2.4 printed
  ``parent->rank->children``).
- connections ``Channel 03/0 : 5[5] -> 12[4] [send] via NET/IB/3`` (2.4: ``Ring 00 : ...``): the
  transport of each edge; ``NET/IB : Using [0]mlx5_4:1/RoCE [RO]`` tells whether an IB-verbs
  device runs on InfiniBand or RoCE.
- ``NCCL version 2.18.5+cuda12.0`` (``RCCL version ...``) and the nccl-tests
  ``#  Rank  1 Group  0 Pid .. on host device  0`` lines (rank -> host).
- the algorithm: a TUNING line ``4194304 Bytes -> Algo 0 proto 2 time ..`` after a COLL line of
  the same thread (``NCCL_ALGO_*`` index: 0 tree, 1 ring), else an ``NCCL_ALGO`` setting that
  forces one of ring/tree for the op, else ``ring``.

Grouping calls across processes
-------------------------------
A process knows its communicator only by a pointer, different in every process. Handles
``(host, pid, device, comm pointer)`` are joined into communicators by, in order: the ``commId``
of their init lines; otherwise, among handles with the same ``nranks``, (a) all of them when no
GPU holds two handles of that size, and (b) handles that logged the same ``(opCount, op, count,
datatype)``, as long as a communicator of ``nranks`` ranks gets at most ``nranks`` GPUs, never
one GPU twice and never two handles of one known rank (so that four 2-rank tensor-parallel
groups issuing identical calls stay four communicators, although which GPUs pair up is then a
guess). A call is then ``(communicator, opCount)``; several
lines of one handle at one opCount (calls fused in a group) are matched by their order.
Ranks that disagree about the op, count or datatype of one call are a schedule mismatch
(``report["mismatches"]``); the row keeps the variant most ranks logged.

Send/Recv lines become ``send_recv`` rows (src, dst); a Send and the matching Recv logged by
the peer (same communicator, ranks and size, in order) are one row. The logging rank comes from
RCCL's ``globalrank``, from the init line of its handle, or, on a 2-rank communicator, is the
rank that is not the peer; otherwise the line is skipped with that reason.

Ranks are communicator ranks (equal to global ranks for the world communicator); NCCL logs do
not map a sub-communicator's ranks to global ranks. When the log holds a complete ring order for
channel 0 of a communicator of the same size, ``ranks`` lists the ranks in that ring order, so
that lowering follows the ring NCCL built.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from .common import DTYPE_SIZE, NCCL_DTYPE, NCCL_REDOP, Partial, Skip, counts_by_op, iter_lines, sizes

MAXWIDTH = 20
"""Ranks NCCL prints on one ring-order line (``MAXWIDTH`` in NCCL ``src/graph/rings.cc``)."""

_PREFIX = re.compile(r"(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+)\s*\[(?P<dev>\d+)\]\s+"
                     r"(?:[\d.]+ \S+:\d+ )?NCCL (?P<level>INFO|WARN|TRACE|ABORT)\s(?P<msg>.*)$")
_COLL = re.compile(r"^(?P<name>[A-Za-z]+): opCount (?P<opcount>[0-9a-fA-F]+)\s+(?P<rest>.*)$")
_KV = re.compile(r"\b(sendbuff|recvbuff|count|datatype|op|root|peer|comm|commHash|commId|stream|task|"
                 r"globalrank)[ =]([^\s\]]+)")
_NRANKS = re.compile(r"\[nranks=(\d+)")
_INIT = re.compile(r"\bcomm (0x[0-9a-fA-F]+) rank (\d+) n[Rr]anks (\d+)")
_COMMID = re.compile(r"\bcommId (0x[0-9a-fA-F]+)")
_LOCAL = re.compile(r"\bnNodes (\d+) localRanks (\d+)")
_VERSION = re.compile(r"\b(NCCL|RCCL) version (\S+)")
_ALGO = re.compile(r"NCCL_ALGO(?: set by environment to |=)(\S+)")
_TESTS_RANK = re.compile(r"#\s*Rank\s+(\d+)\s+Group\s+(\d+)\s+Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\d+)")
_ORDER = re.compile(r"^(?:Channel|Ring) (\d+)(?:/(\d+))? :((?:\s+\d+)+)\s*$")
_PREVNEXT = re.compile(r"^(?:Channel|Ring) (\d+) : (-?\d+) -> (\d+) -> (-?\d+)\s*$")
_CONN = re.compile(r"^(?:Channel|Ring) (\d+)(?:/\d+)? : (\d+)(?:\[[0-9a-fA-Fx]+\])? -> (\d+)"
                   r"(?:\[[0-9a-fA-Fx]+\])?(?: \[(send|receive)\])? via (.+?)\s*$")
_CHANNEL_LIKE = re.compile(r"^(?:Channel|Ring) \d+")
_TREE_NEW = re.compile(r"\[(\d+)\] (-?\d+)/(-?\d+)/(-?\d+)->(-?\d+)->(-?\d+)")
_TREE_OLD = re.compile(r"\[(\d+)\] (-?\d+)->(-?\d+)->(-?\d+)/(-?\d+)/(-?\d+)")
_NET_IB = re.compile(r"^NET/IB : Using (.*?)(?:; OOB .*)?$")
_IB_DEV = re.compile(r"\[(\d+)\]([^\s:\[\]]+):(\d+)/(IB|RoCE)(\s*\[RO\])?")
_NETWORK = re.compile(r"^Using network (\S+)")
_TUNING = re.compile(r"(\d+) Bytes -> Algo (\d+) proto (\d+)")

ALGORITHMS = {0: "tree", 1: "ring", 2: "collnet_direct", 3: "collnet_chain", 4: "nvls", 5: "nvls_tree", 6: "pat"}
"""NCCL_ALGO_* indices of NCCL ``src/include/devcomm.h`` (TUNING lines name the algorithm by index)."""

# COLL op names -> table op (send/recv become send_recv rows).
_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
        "Broadcast": "broadcast", "Reduce": "reduce", "AllToAll": "all_to_all",
        "Send": "send", "Recv": "recv"}
_UNSUPPORTED = {"Gather", "Scatter", "AllToAllv", "AllToAllPivot", "Bcast"}


def looks_like(lines: list[str]) -> bool:
    """True when some line carries the ``host:pid:tid [dev] NCCL INFO`` prefix."""
    return any(_PREFIX.search(line) for line in lines[:5000])


def transport_class(via: str, device_link: str | None = None) -> str:
    """Class of a connection's transport from its ``via`` text.

    ``P2P/direct pointer/read`` -> ``P2P``; ``SHM/direct/direct`` -> ``SHM``; ``NET/IB/3`` ->
    ``NET/IB`` (``NET/IB/RoCE`` when the device's link layer is RoCE); ``NET/Socket/0`` ->
    ``NET/Socket`` (TCP: no RDMA on that edge); CollNet/NVLS keep their name.
    """
    parts = via.split("/")
    head = parts[0].strip()
    if head == "NET" and len(parts) > 1:
        kind = parts[1].strip()
        if kind == "IB" and device_link == "RoCE":
            return "NET/IB/RoCE"
        return f"NET/{kind}"
    return head.upper() if head.lower() in ("p2p", "shm", "nvls", "collnet") else head


_ALGO_OPS = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
             "broadcast": "broadcast", "reduce": "reduce"}


def parse_nccl_algo(value: str) -> dict[str, str]:
    """Algorithm forced by an ``NCCL_ALGO`` value, per table op (``"*"`` for every op).

    Syntax of NCCL ``src/graph/tuning.cc`` (``parseList``): ``Tree``, ``ring,collnetdirect``,
    ``ring;allreduce:tree``, ``^ring`` (all but ring). Only a list naming exactly one of ring and
    tree, without ``^``, forces that algorithm; anything else leaves NCCL a choice and is absent
    from the result.
    """
    out: dict[str, str] = {}
    for part in value.strip("\"'").split(";"):
        prefix, _, elems = part.rpartition(":")
        names = [e.strip().lower() for e in elems.split(",") if e.strip()]
        if not names or any(n.startswith("^") for n in names) or len(names) != 1 or names[0] not in ("ring", "tree"):
            continue
        for p in (prefix.split(",") if prefix else ["*"]):
            key = "*" if p == "*" else _ALGO_OPS.get(p.strip().lower())
            if key:
                out[key] = names[0]
    return out



class _UnionFind:
    """Handles joined into communicators. A communicator of n ranks holds at most n GPUs, never
    one GPU twice, and never two handles that know the same rank."""

    def __init__(self) -> None:
        self.parent: dict = {}
        self.slots: dict = {}
        self.ranks: dict = {}
        self.size: dict = {}

    def add(self, h, slot, nranks: int, rank: int | None) -> None:
        if h not in self.parent:
            self.parent[h] = h
            self.slots[h] = {slot}
            self.ranks[h] = {rank} if rank is not None else set()
            self.size[h] = nranks

    def find(self, h):
        while self.parent[h] != h:
            self.parent[h] = self.parent[self.parent[h]]
            h = self.parent[h]
        return h

    def union(self, a, b) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return True
        if self.slots[ra] & self.slots[rb] or self.ranks[ra] & self.ranks[rb] \
                or len(self.slots[ra]) + len(self.slots[rb]) > self.size[ra]:
            return False
        self.parent[rb] = ra
        self.slots[ra] |= self.slots.pop(rb)
        self.ranks[ra] |= self.ranks.pop(rb)
        return True


def read(paths: list[Path]) -> Partial:
    """Read NCCL debug logs (one file with many ranks, or one file per rank).

    Parameters
    ----------
    paths : log files (gzip accepted), all of one run.

    Returns
    -------
    Partial : rows of the collectives table (``source`` = ``file:line`` of the first line of
        the call), rings, trees, transports, communicators, mismatches and skipped lines.
    """
    out = Partial("nccl-log")
    recs: list[dict] = []
    init: dict[tuple, dict] = {}          # (host, pid, comm) -> rank, nranks, commId
    ring_sets: list[dict] = []
    cur_set: dict[tuple, dict] = {}       # (file, host, pid) -> open ring set
    prevnext: dict[int, dict[int, int]] = defaultdict(dict)
    trees: dict[int, dict[int, dict]] = defaultdict(dict)
    ib_devices: dict[tuple[str, int], dict] = {}
    conns: list[dict] = []
    versions: list[str] = []
    algos: list[str] = []
    networks: set[str] = set()
    rank_host: dict[int, str] = {}
    hosts: set[str] = set()
    last_nranks: dict[tuple, int] = {}
    local_info: dict = {}
    coll_seen: dict[tuple, str] = {}      # (host, pid, tid, dev, COLL text) -> file:line first seen

    for fidx, path in enumerate(paths):
        fname = str(path)
        lno = 0
        last_coll: dict[tuple, dict] = {}
        for lno, line in enumerate(iter_lines(path, out.skipped), 1):
            if "NCCL" not in line and "CCL version" not in line and "#" not in line and "..." not in line \
                    and "…" not in line and "opCount" not in line:
                continue
            stripped = line.strip()
            if stripped in ("...", "…", "[...]"):
                out.skipped.append(Skip(fname, lno, "elision marker: lines were left out of this log here"))
                continue
            m = _TESTS_RANK.search(line) if "Rank" in line and "#" in line else None
            if m:
                rank_host[int(m.group(1))] = m.group(4)
                hosts.add(m.group(4))
                continue
            mv = _VERSION.search(line) if "version" in line else None
            if mv:
                versions.append(f"{mv.group(1)} {mv.group(2)}" if mv.group(1) == "RCCL" else mv.group(2))
            p = _PREFIX.search(line)
            if not p:
                if "opCount" in line:
                    out.skipped.append(Skip(fname, lno, "COLL line without the host:pid:tid [dev] NCCL INFO prefix"))
                continue
            host, pid, dev = p.group("host"), int(p.group("pid")), int(p.group("dev"))
            hosts.add(host)
            msg = p.group("msg").strip()
            if mv:
                continue
            ma = _ALGO.search(msg) if "NCCL_ALGO" in msg else None
            if ma:
                algos.append(ma.group(1))
            c = _COLL.match(msg)
            if c:
                # one thread logs one call once: the same line again is the log read twice (a
                # file given twice, or stdout and NCCL_DEBUG_FILE joined), not a second call
                ckey = (host, pid, p.group("tid"), dev, msg)
                if ckey in coll_seen:
                    out.skipped.append(Skip(fname, lno, f"the same COLL line (same host, pid, thread) as "
                                                        f"{coll_seen[ckey]}: a log read twice?"))
                    continue
                coll_seen[ckey] = f"{fname}:{lno}"
                rec = _parse_coll(c, fname, fidx, lno, host, pid, dev, out.skipped)
                if rec is not None:
                    recs.append(rec)
                    last_coll[(host, pid, p.group("tid"))] = rec
                continue
            mt = _TUNING.search(msg) if "Bytes ->" in msg else None
            if mt:
                rec = last_coll.get((host, pid, p.group("tid")))
                # nBytes is count x size, times nranks for all_gather / reduce_scatter (enqueue.cc)
                if rec is not None and "algo" not in rec and int(mt.group(1)) in (
                        rec["count"] * DTYPE_SIZE[rec["dtype"]], rec["count"] * DTYPE_SIZE[rec["dtype"]] * rec["nranks"]):
                    rec["algo"] = ALGORITHMS.get(int(mt.group(2)), f"algo{mt.group(2)}")
                continue
            if " opCount " in msg:
                out.skipped.append(Skip(fname, lno, "COLL line in no known layout (opCount is not hexadecimal, "
                                                    "or the line is garbled)"))
                continue
            mi = _INIT.search(msg)
            if mi:
                key = (host, pid, mi.group(1).lower())
                info = {"rank": int(mi.group(2)), "nranks": int(mi.group(3))}
                cid = _COMMID.search(msg)
                if cid:
                    info["commId"] = cid.group(1).lower()
                init.setdefault(key, {}).update(info)
                init[key]["host"] = host
                last_nranks[(host, pid)] = info["nranks"]
                ml = _LOCAL.search(msg)
                if ml:
                    local_info = {"nodes": int(ml.group(1)), "local_ranks": int(ml.group(2))}
                continue
            mo = _ORDER.match(msg)
            if mo:
                ch = int(mo.group(1))
                order = [int(x) for x in mo.group(3).split()]
                skey = (fname, host, pid)
                rs = cur_set.get(skey)
                if rs is None or ch in rs["orders"]:
                    rs = {"file": fname, "host": host, "pid": pid, "line": lno, "orders": {},
                          "nchannels": None, "nranks": last_nranks.get((host, pid))}
                    cur_set[skey] = rs
                    ring_sets.append(rs)
                rs["orders"][ch] = order
                if mo.group(2) is not None:
                    rs["nchannels"] = int(mo.group(2))
                continue
            mp = _PREVNEXT.match(msg)
            if mp:
                ch, prv, rank, nxt = (int(x) for x in mp.groups())
                prevnext[ch][rank] = nxt
                continue
            mc = _CONN.match(msg)
            if mc:
                conns.append({"channel": int(mc.group(1)), "src": int(mc.group(2)), "dst": int(mc.group(3)),
                              "dir": mc.group(4), "via": mc.group(5), "host": host, "file": fname, "line": lno})
                continue
            if msg.startswith("Trees"):
                got = False
                for t in _TREE_NEW.finditer(msg):
                    ch, d0, d1, d2, rank, up = (int(x) for x in t.groups())
                    trees[ch][rank] = {"up": up, "down": [d for d in (d0, d1, d2) if d >= 0]}
                    got = True
                if not got:
                    for t in _TREE_OLD.finditer(msg):
                        ch, up, rank, d0, d1, d2 = (int(x) for x in t.groups())
                        trees[ch][rank] = {"up": up, "down": [d for d in (d0, d1, d2) if d >= 0]}
                        got = True
                if not got:
                    out.skipped.append(Skip(fname, lno, "Trees line in no known layout"))
                continue
            mn = _NET_IB.match(msg)
            if mn:
                for d in _IB_DEV.finditer(mn.group(1)):
                    ib_devices[(host, int(d.group(1)))] = {
                        "host": host, "index": int(d.group(1)), "name": d.group(2), "port": int(d.group(3)),
                        "link_layer": d.group(4), "relaxed_ordering": bool(d.group(5))}
                networks.add("IB")
                continue
            mw = _NETWORK.match(msg)
            if mw:
                networks.add(mw.group(1))
                continue
            if _CHANNEL_LIKE.match(msg) and " : " in msg and "->" not in msg and not msg.rstrip().endswith(":"):
                out.skipped.append(Skip(fname, lno, "ring/channel line in no known layout"))
        out.files.append({"path": fname, "format": "nccl-log", "lines": lno})

    if init:   # ranks of the largest communicator (the world, when it was logged) -> host
        world = max(v["nranks"] for v in init.values())
        for v in init.values():
            if v["nranks"] == world:
                rank_host.setdefault(v["rank"], v["host"])
    algorithm = parse_nccl_algo(algos[-1]) if algos else {}
    if algos and not algorithm:
        out.notes.append(f"NCCL_ALGO={algos[-1]} leaves NCCL a choice; rows say ring unless a TUNING line names it")

    rings = _assemble_rings(ring_sets, prevnext, out)
    out.rings = rings
    out.trees = {ch: dict(sorted(v.items())) for ch, v in sorted(trees.items())}
    _transports(conns, ib_devices, out)
    _calls(recs, init, rings, algorithm, out)

    out.report.update({
        "nccl_version": versions[0] if versions else None,
        "hosts": sorted(hosts),
        "rank_host": {str(k): v for k, v in sorted(rank_host.items())},
        "network": sorted(networks),
        "net_devices": [ib_devices[k] for k in sorted(ib_devices)],
        "algorithm_env": algos[-1] if algos else None,
        **({"topology": local_info} if local_info else {}),
    })
    return out


def _parse_coll(c, fname, fidx, lno, host, pid, dev, skipped) -> dict | None:
    name = c.group("name")
    where = f"{name} COLL line"
    if name in _UNSUPPORTED:
        skipped.append(Skip(fname, lno, f"{name} is not an operation of the collectives table"))
        return None
    if name not in _OPS:
        skipped.append(Skip(fname, lno, f"unknown COLL operation {name!r}"))
        return None
    kv = dict(_KV.findall(c.group("rest")))
    nr = _NRANKS.search(c.group("rest"))
    need = ["count", "datatype", "comm"]
    missing = [k for k in need if k not in kv] + ([] if nr else ["[nranks=N]"])
    if missing:
        skipped.append(Skip(fname, lno, f"{where} is missing {', '.join(missing)} (cut off?)"))
        return None
    try:
        count = int(kv["count"])
        datatype = int(kv["datatype"])
        nranks = int(nr.group(1))
        root = int(kv.get("peer", kv.get("root", "-1")))
        redop = int(kv.get("op", "0"))
    except ValueError as e:
        skipped.append(Skip(fname, lno, f"{where}: a field is not an integer ({e})"))
        return None
    if datatype not in NCCL_DTYPE:
        skipped.append(Skip(fname, lno, f"{where}: datatype {datatype} is not an ncclDataType_t of nccl.h (0..11)"))
        return None
    if count < 0 or nranks < 1:
        skipped.append(Skip(fname, lno, f"{where}: count {count} / nranks {nranks} out of range"))
        return None
    op = _OPS[name]
    if op in ("send", "recv") and not 0 <= root < nranks:
        skipped.append(Skip(fname, lno, f"{where}: peer {root} is not a rank of a {nranks}-rank communicator"))
        return None
    rec = {"file": fname, "fidx": fidx, "line": lno, "host": host, "pid": pid, "dev": dev,
           "name": name, "op": op, "opcount": int(c.group("opcount"), 16), "count": count,
           "dtype": NCCL_DTYPE[datatype], "redop": NCCL_REDOP.get(redop, f"custom{redop}"), "root": root,
           "comm": kv["comm"].lower(), "nranks": nranks,
           "in_place": kv.get("sendbuff") == kv.get("recvbuff") and kv.get("sendbuff") not in (None, "(nil)")}
    if "globalrank" in kv:
        try:
            rec["globalrank"] = int(kv["globalrank"])
        except ValueError:
            pass
    for key in ("commHash", "commId"):
        if key in kv:
            rec["commid"] = kv[key].lower()
    return rec


def _ring_ok(order: list[int], nranks: int | None) -> bool:
    if nranks is None:
        if len(order) >= MAXWIDTH:
            return False
        nranks = len(order)
    return len(order) == nranks and sorted(order) == list(range(nranks))


def _assemble_rings(ring_sets: list[dict], prevnext: dict, out: Partial) -> dict[int, list[int] | None]:
    sets_report = []
    for rs in ring_sets:
        n = rs["nranks"]
        nch = rs["nchannels"] if rs["nchannels"] is not None else (max(rs["orders"]) + 1)
        rings: dict[int, list[int] | None] = {}
        for ch in range(max(nch, max(rs["orders"]) + 1)):
            order = rs["orders"].get(ch)
            rings[ch] = list(order) if order is not None and _ring_ok(order, n) else None
        rs["rings"] = rings
        if n is None:
            complete = [r for r in rings.values() if r is not None]
            rs["nranks"] = len(complete[0]) if complete else None
        sets_report.append({"file": rs["file"], "line": rs["line"], "host": rs["host"], "pid": rs["pid"],
                            "nranks": rs["nranks"], "channels": len(rings),
                            "complete": sorted(ch for ch, r in rings.items() if r is not None),
                            "incomplete": sorted(ch for ch, r in rings.items() if r is None)})
    if sets_report:
        out.report["ring_sets"] = sets_report
    best: dict[int, list[int] | None] = {}
    if ring_sets:
        chosen = max(ring_sets, key=lambda rs: (rs["nranks"] or 0, -ring_sets.index(rs)))
        best = chosen["rings"]
        for ch, r in best.items():
            if r is None:
                why = "not in the log" if ch not in chosen["orders"] else \
                    f"{len(chosen['orders'][ch])} of {chosen['nranks'] or 'unknown'} ranks printed"
                out.notes.append(f"ring of channel {ch} is incomplete ({why})")
    for ch, nxt in sorted(prevnext.items()):
        if ch in best and best[ch] is not None:
            continue
        ring, r, seen = [], 0 if 0 in nxt else min(nxt), set()
        while r in nxt and r not in seen:
            seen.add(r)
            ring.append(r)
            r = nxt[r]
        closed = r == ring[0] and len(ring) == len(nxt) and sorted(ring) == list(range(len(ring)))
        best[ch] = ring if closed else None
        if not closed:
            out.notes.append(f"ring of channel {ch}: prev -> rank -> next lines of {len(nxt)} ranks do not close a ring")
    return dict(sorted(best.items()))


def _transports(conns: list[dict], ib_devices: dict, out: Partial) -> None:
    edges: dict[tuple[int, int], str] = {}
    detail = []
    for c in conns:
        link = None
        m = re.match(r"NET/IB/(\d+)", c["via"])
        if m:
            dev = ib_devices.get((c["host"], int(m.group(1))))
            link = dev["link_layer"] if dev else None
        cls = transport_class(c["via"], link)
        key = (c["src"], c["dst"])
        if key in edges and edges[key] != cls:
            out.notes.append(f"edge {key[0]}->{key[1]} uses {edges[key]} and {cls} on different channels")
        edges.setdefault(key, cls)
        detail.append({k: c[k] for k in ("channel", "src", "dst", "dir", "via", "host")})
    out.transports = dict(sorted(edges.items()))
    if detail:
        counts: dict[str, int] = {}
        for cls in edges.values():
            counts[cls] = counts.get(cls, 0) + 1
        out.report["transport_edges"] = dict(sorted(counts.items()))
        out.report["connections"] = len(detail)


def _row_algorithm(lines: list[dict], op: str, env: dict[str, str], out: Partial) -> str:
    """ring or tree: what a TUNING line of the call says (most ranks), else NCCL_ALGO, else ring."""
    named = [r["algo"] for r in lines if "algo" in r]
    if named:
        algo = max(set(named), key=named.count)
        if algo in ("ring", "tree"):
            return algo
        note = f"NCCL chose {algo} for some {op} calls; the table names ring for them"
        if note not in out.notes:
            out.notes.append(note)
        return "ring"
    return env.get(op, env.get("*", "ring"))


def _calls(recs: list[dict], init: dict, rings: dict, algorithm: dict[str, str], out: Partial) -> None:
    # --- communicators -------------------------------------------------------------------
    def slot(r):
        return (r["host"], r["pid"], r["dev"])

    def handle(r):
        return (r["host"], r["pid"], r["dev"], r["comm"])

    comm_of: dict[tuple, tuple] = {}
    uf = _UnionFind()
    by_size: dict[int, dict[tuple, set]] = defaultdict(lambda: defaultdict(set))
    for r in recs:
        h = handle(r)
        cid = r.get("commid") or init.get((r["host"], r["pid"], r["comm"]), {}).get("commId")
        if cid:
            comm_of[h] = ("id", cid)
        else:
            rank = r.get("globalrank", init.get((r["host"], r["pid"], r["comm"]), {}).get("rank"))
            uf.add(h, slot(r), r["nranks"], rank)
            by_size[r["nranks"]][slot(r)].add(h)
    for n, slots in by_size.items():
        if all(len(hs) == 1 for hs in slots.values()) and len(slots) <= n:
            hs = [next(iter(v)) for v in slots.values()]
            for h in hs[1:]:
                uf.union(hs[0], h)
    seen_sig: dict[tuple, list] = {}
    for r in recs:
        h = handle(r)
        if h in comm_of or r["op"] in ("send", "recv"):
            continue
        sig = (r["nranks"], r["opcount"], r["op"], r["count"], r["dtype"])
        groups = seen_sig.setdefault(sig, [])
        if not any(uf.find(g) == uf.find(h) for g in groups) and not any(uf.union(g, h) for g in groups):
            groups.append(h)
    for r in recs:
        h = handle(r)
        if h not in comm_of:
            comm_of[h] = ("uf", uf.find(h))

    group_id: dict[tuple, int] = {}
    comm_info: dict[int, dict] = {}
    for r in sorted(recs, key=lambda r: (r["line"], r["fidx"])):
        key = comm_of[handle(r)]
        if key not in group_id:
            g = len(group_id)
            group_id[key] = g
            comm_info[g] = {"group": g, "size": r["nranks"], "commId": key[1] if key[0] == "id" else None,
                            "handles": set(), "calls": 0}
        comm_info[group_id[key]]["handles"].add(handle(r))

    def ring_ranks(n: int) -> list[int]:
        r0 = rings.get(0)
        return list(r0) if r0 is not None and len(r0) == n else list(range(n))

    # --- collectives ---------------------------------------------------------------------
    calls: dict[tuple, dict[tuple, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in recs:
        if r["op"] in ("send", "recv"):
            continue
        calls[(comm_of[handle(r)], r["opcount"])][handle(r)].append(r)
    items = []
    in_place = 0
    for (ckey, opcount), per_handle in calls.items():
        g = group_id[ckey]
        depth = max(len(v) for v in per_handle.values())
        for k in range(depth):
            lines = [v[k] for v in per_handle.values() if len(v) > k]
            variants: dict[tuple, list[dict]] = {}
            for r in lines:
                variants.setdefault((r["op"], r["count"], r["dtype"]), []).append(r)
            if len(variants) > 1:
                out.mismatches.append({
                    "group": g, "opCount": f"{opcount:x}",
                    "variants": [{"op": op, "count": cnt, "dtype": dt, "ranks_reporting": len(rs),
                                  "lines": [f"{x['file']}:{x['line']}" for x in rs[:8]]}
                                 for (op, cnt, dt), rs in variants.items()]})
            best = max(variants.values(), key=len)
            first = min(lines, key=lambda x: (x["line"], x["fidx"]))
            rep = best[0]
            n = rep["nranks"]
            bg, bpr = sizes(rep["op"], DTYPE_SIZE[rep["dtype"]], rep["count"], n)
            algo = _row_algorithm(lines, rep["op"], algorithm, out)
            items.append(((first["line"], first["fidx"], k), dict(
                op=rep["op"], group=g, ranks=ring_ranks(n), group_size=n, bytes_global=bg,
                bytes_per_rank=bpr, dtype=rep["dtype"], algorithm=algo,
                source=f"{first['file']}:{first['line']}")))
            comm_info[g]["calls"] += 1
            in_place += all(x["in_place"] for x in lines)

    # --- send/recv -----------------------------------------------------------------------
    halves: dict[tuple, dict[str, list]] = defaultdict(lambda: {"send": [], "recv": []})
    for r in recs:
        if r["op"] not in ("send", "recv"):
            continue
        me = r.get("globalrank")
        if me is None:
            me = init.get((r["host"], r["pid"], r["comm"]), {}).get("rank")
        if me is None and r["nranks"] == 2:
            me = 1 - r["root"]
        if me is None:
            out.skipped.append(Skip(r["file"], r["line"],
                                    f"{r['name']}: own rank on comm {r['comm']} unknown (no 'comm {r['comm']} rank N' "
                                    f"init line for this process)"))
            continue
        src, dst = (me, r["root"]) if r["op"] == "send" else (r["root"], me)
        key = (comm_of[handle(r)], src, dst, r["count"], r["dtype"])
        halves[key][r["op"]].append(r)
    for (ckey, src, dst, count, dtype), sides in halves.items():
        g = group_id[ckey]
        sends, recvs = sides["send"], sides["recv"]
        for k in range(max(len(sends), len(recvs))):
            pair = [x for x in (sends[k] if k < len(sends) else None, recvs[k] if k < len(recvs) else None) if x]
            first = min(pair, key=lambda x: (x["line"], x["fidx"]))
            nbytes = count * DTYPE_SIZE[dtype]
            items.append(((first["line"], first["fidx"], k), dict(
                op="send_recv", group=g, ranks=[src, dst], group_size=2, bytes_global=nbytes,
                bytes_per_rank=nbytes, dtype=dtype, src=src, dst=dst, algorithm="ring",
                source=f"{first['file']}:{first['line']}")))
            comm_info[g]["calls"] += 1

    items.sort(key=lambda it: it[0])
    for _, row in items:
        out.rows.add(**row)
    out.communicators = [{"group": c["group"], "size": c["size"], "commId": c["commId"],
                          "processes": len(c["handles"]),
                          "comm_pointers": sorted({h[3] for h in c["handles"]})[:4],
                          "calls": c["calls"]} for c in comm_info.values()]
    out.report["coll_lines"] = len(recs)
    out.report["in_place_calls"] = in_place
    out.report["counts"] = counts_by_op([row["op"] for _, row in items])
