"""Inputs of the analysis tools, turned into packet batches for :class:`~.summary.Summary`.

Two kinds of input:

* a **wiretrace Parquet directory** (``generate --parquet DIR``) holding ``packets.parquet``,
  ``messages.parquet`` and ``collectives.parquet``. Packets are read in record batches; each
  packet's ``msg_id`` is joined to its message and that message's ``op_id`` to its collective
  call, so every byte gets the parallelism (dp, tp, pp...) and phase (forward, backward...) that
  caused it. Messages are read once, in record batches; the join keeps the message id and two
  one-byte codes per network message in memory (10 bytes each).
* a **capture** (pcap, pcapng, ERF) read by :func:`wiretrace.io.capture.iter_frames` and decoded
  by :func:`wiretrace.transport.parse.parse_frames`; frames that are neither RoCEv2 nor native
  InfiniBand are counted and skipped.

With a plan (``--plan``), NIC addresses are mapped to wiretrace NIC indices and nodes
(:mod:`wiretrace.topology`), which names NICs by address and gives the node x node matrix; the
plan's ``cluster.nic_rate`` is the default line rate.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputFormatError
from .burstiness import ETHERNET_L1_OVERHEAD_BYTES
from .stats import Distribution
from .summary import Endpoints

PARQUET_TABLES = ("packets.parquet", "messages.parquet", "collectives.parquet")
BATCH_ROWS = 1 << 18
CAPTURE_BATCH_FRAMES = 65536
"""Frames of a capture parsed at a time."""


@dataclass
class Input:
    """An opened input: where its packets come from and what is known about them.

    Attributes
    ----------
    kind : ``"parquet"`` or ``"capture"``.
    path : the file or directory.
    endpoints : endpoint registry the batches' ``src``/``dst`` refer to.
    labels : names of the ``parallelism`` / ``phase`` codes (Parquet input only).
    line_rate_bps : from ``--line-rate`` or the plan; None when unknown.
    batches : callable returning an iterator of packet batches (one pass over the input).
    message_sizes : callable returning an iterator of message-size distributions (bytes on the
        wire per network message), or None when messages are reassembled from the packets'
        opcodes.
    phase_spans : callable returning ``[(phase, start_ns, end_ns), ...]`` (Parquet input only).
    info : counters filled while reading (frames skipped and why; ``cut_off_after_frames`` when
        a capture ends inside a record: the number of complete frames summarized).
    """

    kind: str
    path: Path
    endpoints: Endpoints
    labels: dict
    line_rate_bps: float | None
    batches: Callable[[], Iterator[dict]]
    message_sizes: Callable[[], Iterator[Distribution]] | None = None
    phase_spans: Callable[[], list] | None = None
    info: dict = field(default_factory=dict)


def _address_map(plan):
    """(topology, {address bytes or LID: NIC index}) for a plan, or (None, {})."""
    if plan is None:
        return None, {}
    from .. import topology

    topo = topology.build(plan)
    amap = {}
    for i in range(topo.num_nics):
        amap[("ip", int(topo.nic_ipv4[i]).to_bytes(4, "big"))] = i   # IPv4 (from ::ffff:a.b.c.d)
        amap[("ip", bytes(topo.nic_ipv6[i]))] = i
        amap[("lid", int(topo.nic_lid[i]))] = i
    return topo, amap


def _nic_label(topo, plan, nic: int) -> str:
    if topo is None:
        return f"nic{nic}"
    if plan.transport.kind != "rocev2":
        return f"lid {int(topo.nic_lid[nic])}"
    return topo.ipv6_str(nic) if plan.transport.ip_version == 6 else topo.ipv4_str(nic)


def open_input(path: str | Path, plan=None, line_rate_bps: float | None = None) -> Input:
    """Open a capture file or a wiretrace Parquet directory.

    Parameters
    ----------
    path : capture (pcap/pcapng/ERF) or directory with ``packets.parquet``.
    plan : optional :class:`wiretrace.plan.Plan` (addresses -> NICs and nodes, line rate); for a
        Parquet directory holding a ``plan.json``, that plan by default.
    line_rate_bps : line rate in bits/s; overrides the plan's ``cluster.nic_rate``.

    Raises
    ------
    InputFormatError : a directory without the wiretrace tables, or a file that is not a capture.
    FileNotFoundError : ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "no such file", str(path))
    if plan is None and path.is_dir() and (path / "plan.json").is_file():
        from ..plan import load

        plan = load(path / "plan.json", require_model=False)   # a copy kept beside the tables
    rate = line_rate_bps or (plan.cluster.nic_rate_bps if plan is not None else None)
    if path.is_dir():
        return _open_parquet(path, plan, rate)
    return _open_capture(path, plan, rate)


# --------------------------------------------------------------------------------------------
# Parquet directory
# --------------------------------------------------------------------------------------------


def _open_parquet(path: Path, plan, rate) -> Input:
    missing = [t for t in PARQUET_TABLES if not (path / t).is_file()]
    if missing:
        raise InputFormatError(f"{path}: not a wiretrace Parquet directory (missing {', '.join(missing)})")
    msg_cols = ["msg_id", "op_id", "link", "src_nic", "src_node", "dst_nic", "dst_node", "wire_bytes",
                "t_start_ns", "t_end_ns"]
    need = {"ts_ns", "msg_id", "src_nic", "dst_nic", "udp_sport", "dest_qp", "opcode",
            "payload_len", "frame_len", "dscp", "ecn"}
    try:
        pkt_file = pq.ParquetFile(path / "packets.parquet")
        msg_file = pq.ParquetFile(path / "messages.parquet")
        coll = pq.read_table(path / "collectives.parquet", columns=["op_id", "parallelism", "phase"])
    except (pa.ArrowInvalid, OSError, KeyError) as e:
        raise InputFormatError(f"{path}: unreadable wiretrace table ({e})") from None
    for f, cols, name in ((pkt_file, need, "packets"), (msg_file, set(msg_cols), "messages")):
        lacking = sorted(cols - set(f.schema_arrow.names))
        if lacking:
            raise InputFormatError(f"{path / (name + '.parquet')}: not a wiretrace {name} table "
                                   f"(missing {', '.join(lacking)})")

    # collective call -> parallelism / phase codes
    labels, op_codes = {}, {}
    coll_op = coll.column("op_id").to_numpy()
    o = np.argsort(coll_op)
    for g in ("parallelism", "phase"):
        vals = np.asarray(coll.column(g).cast(pa.string()).to_numpy(zero_copy_only=False), dtype=object)
        names = sorted(set(vals.tolist()), key=_phase_order if g == "phase" else str)
        code = {n: i for i, n in enumerate(names)}
        labels[g] = names
        op_codes[g] = np.array([code[v] for v in vals], dtype=np.int8)[o]
    coll_op = coll_op[o]

    def codes_of_ops(ops: np.ndarray) -> dict[str, np.ndarray]:
        pos = np.minimum(np.searchsorted(coll_op, ops), max(len(coll_op) - 1, 0))
        ok = (coll_op[pos] == ops) if len(coll_op) else np.zeros(len(ops), dtype=bool)
        return {g: np.where(ok, c[pos] if len(c) else -1, -1).astype(np.int8) for g, c in op_codes.items()}

    # one streaming pass over the network messages: id -> codes (10 bytes per message), NIC ->
    # node, message sizes, and when each phase has messages in flight
    ids, codes = [], {g: [] for g in op_codes}
    nic_node: dict[int, int] = {}
    sizes = Distribution()
    phase_iv: dict[int, list] = {}
    t_lo, t_hi = _time_range(msg_file)
    min_gap = max(1, int((t_hi - t_lo) * 0.002))
    for rb in msg_file.iter_batches(batch_size=BATCH_ROWS, columns=msg_cols):
        c = {n: rb.column(n) for n in msg_cols}
        net = np.asarray(c["link"].cast(pa.string()).to_numpy(zero_copy_only=False)) == "network"
        if not net.any():
            continue
        mid = c["msg_id"].to_numpy()[net]
        cc = codes_of_ops(c["op_id"].to_numpy()[net])
        ids.append(mid)
        for g in codes:
            codes[g].append(cc[g])
        sizes.add(c["wire_bytes"].to_numpy()[net])
        for a, b in (("src_nic", "src_node"), ("dst_nic", "dst_node")):
            pairs = np.unique(np.stack([c[a].to_numpy()[net], c[b].to_numpy()[net]], 1), axis=0)
            nic_node.update({int(n): int(d) for n, d in pairs})
        t0, t1 = c["t_start_ns"].to_numpy()[net], c["t_end_ns"].to_numpy()[net]
        for code in np.unique(cc["phase"]):
            m = cc["phase"] == code
            phase_iv.setdefault(int(code), []).extend(merge_intervals(t0[m], t1[m], min_gap))
    msg_id = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    order = np.argsort(msg_id, kind="stable")
    msg_id = msg_id[order]
    msg_codes = {g: (np.concatenate(v)[order] if v else np.zeros(0, np.int8)) for g, v in codes.items()}

    topo, _ = _address_map(plan)
    eps = Endpoints()

    def endpoint_ids(nics: np.ndarray) -> np.ndarray:
        un, inv = np.unique(nics, return_inverse=True)
        ids = np.array([eps.get(int(n), _nic_label(topo, plan, int(n)), int(n),
                                int(topo.nic_node[n]) if topo is not None and 0 <= n < topo.num_nics
                                else nic_node.get(int(n), -1)) for n in un], dtype=np.int64)
        return ids[inv.ravel()]

    def batches() -> Iterator[dict]:
        for rb in pkt_file.iter_batches(batch_size=BATCH_ROWS, columns=sorted(need)):
            c = {n: rb.column(n).to_numpy(zero_copy_only=False) for n in need}
            sport = c["udp_sport"].astype(np.int32)
            flen = c["frame_len"].astype(np.int64)
            b = {
                "ts_ns": c["ts_ns"].astype(np.int64),
                "src": endpoint_ids(c["src_nic"]), "dst": endpoint_ids(c["dst_nic"]),
                "udp_sport": sport, "dest_qp": c["dest_qp"].astype(np.int32),
                "opcode": c["opcode"].astype(np.uint8), "payload_len": c["payload_len"].astype(np.int64),
                "frame_len": flen, "wire_len": flen + np.where(sport >= 0, ETHERNET_L1_OVERHEAD_BYTES, 0),
                "ecn": c["ecn"].astype(np.uint8), "dscp": c["dscp"].astype(np.uint8),
            }
            pos = np.minimum(np.searchsorted(msg_id, c["msg_id"]), max(len(msg_id) - 1, 0))
            known = (msg_id[pos] == c["msg_id"]) if len(msg_id) else np.zeros(len(pos), dtype=bool)
            for g, mc in msg_codes.items():
                b[g] = np.where(known, mc[pos] if len(mc) else -1, -1).astype(np.int8)
            yield b

    def message_sizes() -> Iterator[Distribution]:
        yield sizes

    def phase_spans() -> list:
        """Per phase, the merged intervals during which its network messages are in flight."""
        out = []
        for code, iv in sorted(phase_iv.items()):
            if code < 0 or not iv:
                continue
            a = np.array([x[0] for x in iv])
            b = np.array([x[1] for x in iv])
            out.extend((labels["phase"][code], s, e) for s, e in merge_intervals(a, b, min_gap))
        return out

    return Input("parquet", path, eps, labels, rate, batches, message_sizes, phase_spans,
                 info={"messages": int(len(msg_id)), "collectives": coll.num_rows})


def _time_range(f: pq.ParquetFile) -> tuple[int, int]:
    """Smallest t_start_ns and largest t_end_ns of a messages file (row-group statistics when
    present, else a pass over those two columns)."""
    lo, hi = None, None
    meta = f.metadata
    names = f.schema_arrow.names
    try:
        for i in range(meta.num_row_groups):
            rg = meta.row_group(i)
            s0 = rg.column(names.index("t_start_ns")).statistics
            s1 = rg.column(names.index("t_end_ns")).statistics
            if s0 is None or s1 is None or not s0.has_min_max or not s1.has_min_max:
                raise LookupError
            lo = s0.min if lo is None else min(lo, s0.min)
            hi = s1.max if hi is None else max(hi, s1.max)
    except LookupError:
        lo, hi = None, None
        for rb in f.iter_batches(batch_size=BATCH_ROWS, columns=["t_start_ns", "t_end_ns"]):
            if rb.num_rows:
                a, b = rb.column(0).to_numpy(), rb.column(1).to_numpy()
                lo = int(a.min()) if lo is None else min(lo, int(a.min()))
                hi = int(b.max()) if hi is None else max(hi, int(b.max()))
    return (int(lo), int(hi)) if lo is not None else (0, 0)


_PHASES = ("init", "forward", "backward", "optimizer")


def _phase_order(name: str):
    return (_PHASES.index(name) if name in _PHASES else len(_PHASES), name)


def merge_intervals(start: np.ndarray, end: np.ndarray, min_gap_ns: int | None = None) -> list[tuple[int, int]]:
    """Union of intervals ``[start, end)``; gaps shorter than ``min_gap_ns`` (default 0.2 % of
    the whole span) are bridged so that figures show phases, not every message."""
    if len(start) == 0:
        return []
    o = np.argsort(start, kind="stable")
    s, e = start[o].astype(np.int64), end[o].astype(np.int64)
    if min_gap_ns is None:
        min_gap_ns = max(1, int((e.max() - s.min()) * 0.002))
    run_end = np.maximum.accumulate(e)
    brk = np.flatnonzero(s[1:] > run_end[:-1] + min_gap_ns) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [len(s)]]) - 1
    return [(int(s[a]), int(run_end[b])) for a, b in zip(starts, ends)]


# --------------------------------------------------------------------------------------------
# Captures
# --------------------------------------------------------------------------------------------


def _open_capture(path: Path, plan, rate) -> Input:
    from ..io.capture import open_capture

    with open_capture(path) as cap:   # fails early, with one line, when it is not a capture
        fmt = cap.format
    topo, amap = _address_map(plan)
    eps = Endpoints()
    info = {"format": fmt, "frames": 0, "roce_frames": 0, "skipped": {}}

    def label_of(key: bytes) -> tuple[str, int]:
        if key[16] == 1:                     # native IB without GRH: the LID
            lid = int.from_bytes(key[14:16], "big")
            return f"lid {lid}", amap.get(("lid", lid), -1)
        v6 = ipaddress.IPv6Address(key[:16])
        label = str(v6.ipv4_mapped) if v6.ipv4_mapped is not None else str(v6)
        if v6.ipv4_mapped is not None:
            return label, amap.get(("ip", key[12:16]), -1)
        return label, amap.get(("ip", key[:16]), -1)

    def endpoint_ids(keys: np.ndarray) -> np.ndarray:
        """Endpoint id of each ``(n, 17)`` address key (16 address bytes + 1 if a LID)."""
        flat = np.ascontiguousarray(keys).view(f"V{keys.shape[1]}").ravel()
        uk, inv = np.unique(flat, return_inverse=True)
        ids = np.empty(len(uk), dtype=np.int64)
        for j, k in enumerate(uk):
            kb = bytes(k)
            label, nic = label_of(kb)
            node = int(topo.nic_node[nic]) if nic >= 0 else -1
            ids[j] = eps.get(kb, label, nic, node)
        return ids[inv.ravel()]

    def batches() -> Iterator[dict]:
        from ..transport.parse import ParseStats, parse_frames

        stats = ParseStats()
        with open_capture(path) as cap:
            for fb in cap.batches(max_frames=CAPTURE_BATCH_FRAMES):
                cols = parse_frames(fb)
                stats.add(len(fb), cols)
                info["frames"] = stats.frames
                info["roce_frames"] = stats.roce
                if stats.non_roce:
                    info["skipped"]["not RoCEv2/InfiniBand"] = stats.non_roce
                b = _capture_batch(cols, endpoint_ids)
                if b is not None:
                    yield b
            if cap.truncated is not None:
                # the file ends inside a record (a capture still being written, or cut by a copy):
                # what came before it is summarized
                info["cut_off_after_frames"] = cap.truncated.frame - 1
        info["truncated_frames"] = stats.truncated

    return Input("capture", path, eps, {}, rate, batches, None, None, info)


def _address_keys(cols: dict, side: str) -> np.ndarray:
    """``(n, 17)`` uint8 keys naming the sending or receiving port of each parsed frame."""
    from ..transport.parse import KIND_IB

    addr = cols[f"{side}_addr"]
    keys = np.zeros((len(addr), 17), dtype=np.uint8)
    keys[:, :16] = addr
    lid_only = cols["kind"] == KIND_IB
    if lid_only.any():
        lid = cols["slid" if side == "src" else "dlid"][lid_only].astype(np.int64)
        keys[lid_only, :16] = 0
        keys[lid_only, 14] = (lid >> 8) & 0xFF
        keys[lid_only, 15] = lid & 0xFF
        keys[lid_only, 16] = 1
    return keys


def _capture_batch(cols: dict, endpoint_ids) -> dict | None:
    """Packet batch (see ``summary.BATCH_COLUMNS``) from parsed capture columns."""
    from ..transport.parse import KIND_IB, KIND_IB_GRH

    n = len(cols["ts_ns"])
    if n == 0:
        return None
    both = endpoint_ids(np.concatenate([_address_keys(cols, "src"), _address_keys(cols, "dst")]))
    flen = cols["frame_len"].astype(np.int64)
    flen = np.where(flen > 0, flen, cols["origlen"].astype(np.int64))
    ib = np.isin(cols["kind"], (KIND_IB, KIND_IB_GRH))
    return {
        "ts_ns": cols["ts_ns"].astype(np.int64), "src": both[:n], "dst": both[n:],
        "udp_sport": cols["udp_sport"].astype(np.int32), "dest_qp": cols["dest_qp"].astype(np.int32),
        "opcode": cols["opcode"].astype(np.uint8),
        "payload_len": np.maximum(cols["payload_len"].astype(np.int64), 0),
        "frame_len": flen, "wire_len": flen + np.where(ib, 0, ETHERNET_L1_OVERHEAD_BYTES),
        "ecn": cols["ecn"].astype(np.uint8), "dscp": cols["dscp"].astype(np.uint8),
        "aeth_syndrome": cols["aeth_syndrome"].astype(np.int16),
    }
