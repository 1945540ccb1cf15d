"""Inputs of the analysis tools, turned into packet batches for :class:`~.summary.Summary`.

Two kinds of input:

* a **wiretrace Parquet directory** (``generate --parquet DIR``) holding ``packets.parquet``,
  ``messages.parquet`` and ``collectives.parquet``. Packets are read in record batches; each
  packet's ``msg_id`` is joined to its message and that message's ``op_id`` to its collective
  call, so every byte gets the parallelism (dp, tp, pp...) and phase (forward, backward...) that
  caused it. The join keeps two small codes per network message in memory (10 bytes each).
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
from .summary import Endpoints

PARQUET_TABLES = ("packets.parquet", "messages.parquet", "collectives.parquet")
BATCH_ROWS = 1 << 18


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
    message_sizes : callable returning an iterator of arrays of message sizes (bytes on the
        wire), or None when messages are reassembled from the packets' opcodes.
    phase_spans : callable returning ``[(phase, start_ns, end_ns), ...]`` (Parquet input only).
    info : counters filled while reading (frames skipped and why).
    """

    kind: str
    path: Path
    endpoints: Endpoints
    labels: dict
    line_rate_bps: float | None
    batches: Callable[[], Iterator[dict]]
    message_sizes: Callable[[], Iterator[np.ndarray]] | None = None
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
    plan : optional :class:`wiretrace.plan.Plan` (addresses -> NICs and nodes, line rate).
    line_rate_bps : line rate in bits/s; overrides the plan's ``cluster.nic_rate``.

    Raises
    ------
    InputFormatError : a directory without the wiretrace tables, or a file that is not a capture.
    FileNotFoundError : ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "no such file", str(path))
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
    try:
        pkt_file = pq.ParquetFile(path / "packets.parquet")
        msgs = pq.read_table(path / "messages.parquet",
                             columns=["msg_id", "op_id", "link", "src_nic", "src_node", "dst_nic",
                                      "dst_node", "wire_bytes", "t_start_ns", "t_end_ns"])
        coll = pq.read_table(path / "collectives.parquet", columns=["op_id", "parallelism", "phase"])
    except (pa.ArrowInvalid, OSError, KeyError) as e:
        raise InputFormatError(f"{path}: unreadable wiretrace table ({e})") from None
    need = {"ts_ns", "msg_id", "src_nic", "dst_nic", "udp_sport", "dest_qp", "opcode",
            "payload_len", "frame_len", "dscp", "ecn"}
    lacking = sorted(need - set(pkt_file.schema_arrow.names))
    if lacking:
        raise InputFormatError(f"{path / 'packets.parquet'}: not a wiretrace packets table (missing {', '.join(lacking)})")

    net = np.asarray(msgs.column("link").cast(pa.string()).to_numpy(zero_copy_only=False)) == "network"
    msg_id = msgs.column("msg_id").to_numpy()[net]
    msg_op = msgs.column("op_id").to_numpy()[net]
    order = np.argsort(msg_id, kind="stable")
    msg_id, msg_op = msg_id[order], msg_op[order]

    labels, op_codes = {}, {}
    coll_op = coll.column("op_id").to_numpy()
    for g in ("parallelism", "phase"):
        vals = np.asarray(coll.column(g).cast(pa.string()).to_numpy(zero_copy_only=False), dtype=object)
        names = sorted(set(vals.tolist()), key=_phase_order if g == "phase" else str)
        code = {n: i for i, n in enumerate(names)}
        labels[g] = names
        op_codes[g] = (coll_op, np.array([code[v] for v in vals], dtype=np.int8))
    # one code per network message, by position in the sorted msg_id array
    msg_codes = {}
    for g, (ops, codes) in op_codes.items():
        o = np.argsort(ops)
        pos = np.searchsorted(ops[o], msg_op)
        pos = np.minimum(pos, len(ops) - 1) if len(ops) else pos
        ok = (len(ops) > 0) & (ops[o][pos] == msg_op) if len(ops) else np.zeros(len(msg_op), bool)
        msg_codes[g] = np.where(ok, codes[o][pos] if len(ops) else -1, -1).astype(np.int8)

    topo, _ = _address_map(plan)
    nic_node = {}
    for a, b in (("src_nic", "src_node"), ("dst_nic", "dst_node")):
        pairs = np.unique(np.stack([msgs.column(a).to_numpy()[net], msgs.column(b).to_numpy()[net]], 1), axis=0)
        nic_node.update({int(n): int(d) for n, d in pairs})
    eps = Endpoints()

    def endpoint_ids(nics: np.ndarray) -> np.ndarray:
        un, inv = np.unique(nics, return_inverse=True)
        ids = np.array([eps.get(int(n), _nic_label(topo, plan, int(n)), int(n),
                                int(topo.nic_node[n]) if topo is not None and 0 <= n < topo.num_nics
                                else nic_node.get(int(n), -1)) for n in un], dtype=np.int64)
        return ids[inv.ravel()]

    def batches() -> Iterator[dict]:
        for rb in pkt_file.iter_batches(batch_size=BATCH_ROWS):
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
            pos = np.searchsorted(msg_id, c["msg_id"])
            pos = np.minimum(pos, max(len(msg_id) - 1, 0))
            known = (len(msg_id) > 0) & (msg_id[pos] == c["msg_id"]) if len(msg_id) else np.zeros(len(pos), bool)
            for g, codes in msg_codes.items():
                b[g] = np.where(known, codes[pos] if len(msg_id) else -1, -1).astype(np.int8)
            yield b

    def message_sizes() -> Iterator[np.ndarray]:
        yield msgs.column("wire_bytes").to_numpy()[net]

    def phase_spans() -> list:
        """Per phase, the merged intervals during which its network messages are in flight."""
        if "phase" not in msg_codes or not len(msg_id):
            return []
        t0 = msgs.column("t_start_ns").to_numpy()[net][order]
        t1 = msgs.column("t_end_ns").to_numpy()[net][order]
        out = []
        for code, name in enumerate(labels["phase"]):
            m = msg_codes["phase"] == code
            if not m.any():
                continue
            out.extend((name, s, e) for s, e in merge_intervals(t0[m], t1[m]))
        return out

    return Input("parquet", path, eps, labels, rate, batches, message_sizes, phase_spans,
                 info={"messages": int(net.sum()), "collectives": coll.num_rows})


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
        from ..transport.parse import ParseStats, iter_packets

        stats = ParseStats()
        for fb, cols in iter_packets(path, stats=stats, on_truncated="warn"):
            info["frames"] = stats.frames
            info["roce_frames"] = stats.roce
            if stats.non_roce:
                info["skipped"]["not RoCEv2/InfiniBand"] = stats.non_roce
            b = _capture_batch(cols, endpoint_ids)
            if b is not None:
                yield b
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
    }
