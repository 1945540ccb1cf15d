"""One streaming pass over packets: totals, flows, sizes, burstiness, utilization, matrix, opcodes.

:class:`Summary` consumes *packet batches* (see :data:`BATCH_COLUMNS`) in time order, whatever
their source (a capture decoded by :mod:`wiretrace.transport.parse`, or ``packets.parquet``), and
keeps only per-flow, per-NIC and per-window state: memory depends on the number of flows and
NICs, never on the number of packets. :meth:`Summary.result` returns a JSON-ready ``dict``
whose keys are stable (``totals.packets``, ``totals.bytes``, ``flows[]``, ``burstiness[]``,
``opcodes``...); the CLI prints it as tables or as JSON.

Conventions
-----------
* ``bytes`` are frame bytes as the capture's original length counts them: Ethernet header (or
  LRH) through ICRC (and VCRC), without FCS. This is ``packets.frame_len``.
* Utilization adds the Ethernet preamble, SFD, FCS and minimum inter-frame gap (24 bytes per
  frame, IEEE 802.3) to what the line carries, and divides by the line rate times the observed
  span (first to last packet of the whole input).
* A flow is (source address, destination address, UDP source port, BTH DestQP): one RoCEv2 QP
  connection in one direction (ACKs of a connection form the reverse flow).
* A NIC's *tx* series holds the frames it sent, its *rx* series the frames sent to it, at the
  capture's timestamps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..transport.headers import CNP_OPCODE, OPCODES
from .burstiness import DEFAULT_IDLE_GAP_NS, DEFAULT_TIMESCALES_NS, Burstiness
from .stats import Distribution

BATCH_COLUMNS = {
    "ts_ns": "int64, ns: first bit of the frame",
    "src": "int64: endpoint id of the sender (index into Endpoints)",
    "dst": "int64: endpoint id of the receiver",
    "udp_sport": "int32: UDP source port (-1 native InfiniBand)",
    "dest_qp": "int32: BTH DestQP",
    "opcode": "uint8: BTH opcode",
    "payload_len": "int32, bytes: IB payload",
    "frame_len": "int32, bytes: frame length on the wire (original length)",
    "wire_len": "int32, bytes: frame_len plus L1 overhead (Ethernet: +24)",
    "ecn": "uint8: IP ECN codepoint",
    "dscp": "uint8: IP DSCP",
    # optional
    "parallelism": "int8 code into Summary.labels['parallelism'] (-1 unknown)",
    "phase": "int8 code into Summary.labels['phase'] (-1 unknown)",
    "aeth_syndrome": "int16: AETH syndrome of ACK packets (-1 absent); captures only",
}
"""Columns of a packet batch (dict of equal-length NumPy arrays)."""

ECN_NAMES = {0: "not_ect", 1: "ect1", 2: "ect0", 3: "ce"}
GROUP_KEYS = ("nic", "node", "parallelism", "phase")

_ACK_OPS = ("ACKNOWLEDGE", "ATOMIC_ACKNOWLEDGE")
MESSAGE_END = np.zeros(256, dtype=bool)
"""Opcodes that end a message (LAST / ONLY of SEND, RDMA WRITE, RDMA READ response)."""
DATA_OPCODE = np.zeros(256, dtype=bool)
"""Opcodes that carry part of a message (FIRST / MIDDLE / LAST / ONLY)."""
IS_ACK = np.zeros(256, dtype=bool)
for _c, _o in OPCODES.items():
    if _o.operation.startswith(("SEND_", "RDMA_WRITE_", "RDMA_READ_RESPONSE_")):
        DATA_OPCODE[_c] = True
        if "_LAST" in _o.operation or "_ONLY" in _o.operation:
            MESSAGE_END[_c] = True
    if _o.operation in _ACK_OPS:
        IS_ACK[_c] = True


def opcode_name(code: int) -> str:
    """IBTA name of a BTH opcode (``RC_RDMA_WRITE_ONLY``), or ``0xNN`` when unknown."""
    o = OPCODES.get(int(code))
    return o.name if o else f"0x{int(code):02x}"


@dataclass
class Endpoints:
    """Addresses seen in the input, numbered in order of appearance.

    ``label`` is what people read (an IP address, ``lid 5``, or ``nic3`` when only the NIC index
    is known); ``nic`` the wiretrace global NIC index when known (else -1); ``node`` the node
    (else -1: the matrix then falls back to one row per address).
    """

    label: list[str] = field(default_factory=list)
    nic: list[int] = field(default_factory=list)
    node: list[int] = field(default_factory=list)
    _index: dict = field(default_factory=dict, repr=False)

    def get(self, key, label: str, nic: int = -1, node: int = -1) -> int:
        """Id of endpoint ``key`` (any hashable), registering it on first sight."""
        i = self._index.get(key)
        if i is None:
            i = len(self.label)
            self._index[key] = i
            self.label.append(label)
            self.nic.append(int(nic))
            self.node.append(int(node))
        return i

    def __len__(self) -> int:
        return len(self.label)


class _Flows:
    """Flow table: (src, dst, udp_sport, dest_qp) -> counters, as growing columns."""

    COLS = {"src": np.int64, "dst": np.int64, "udp_sport": np.int32, "dest_qp": np.int32,
            "packets": np.int64, "bytes": np.int64, "payload_bytes": np.int64,
            "first_ns": np.int64, "last_ns": np.int64, "carry": np.int64}

    def __init__(self):
        self.index: dict[tuple, int] = {}
        self.n = 0
        self.cap = 0
        for k, dt in self.COLS.items():
            setattr(self, k, np.zeros(0, dtype=dt))

    def _grow(self, n: int) -> None:
        if n <= self.cap:
            return
        new = max(n, 2 * self.cap, 64)
        for k, dt in self.COLS.items():
            old = getattr(self, k)
            fill = np.iinfo(np.int64).max if k == "first_ns" else (np.iinfo(np.int64).min if k == "last_ns" else 0)
            arr = np.full(new, fill, dtype=dt)
            arr[: len(old)] = old
            setattr(self, k, arr)
        self.cap = new

    def ids(self, src, dst, sport, dqp) -> np.ndarray:
        """Flow id of every packet (registering new flows)."""
        cols = (np.asarray(src, np.int64), np.asarray(dst, np.int64), np.asarray(sport, np.int64),
                np.asarray(dqp, np.int64))
        order = np.lexsort(cols[::-1])
        change = np.zeros(len(order), dtype=bool)
        change[0] = True
        for c in cols:
            cs = c[order]
            change[1:] |= cs[1:] != cs[:-1]
        first = order[change]                       # one packet per distinct flow key
        inv = np.empty(len(order), dtype=np.int64)
        inv[order] = np.cumsum(change) - 1
        ids = np.empty(len(first), dtype=np.int64)
        new = []
        for j, k in enumerate(zip(*(c[first].tolist() for c in cols))):
            fid = self.index.get(k)
            if fid is None:
                fid = self.n + len(new)
                self.index[k] = fid
                new.append(k)
            ids[j] = fid
        if new:
            self._grow(self.n + len(new))
            sl = slice(self.n, self.n + len(new))
            arr = np.array(new, dtype=np.int64)
            self.src[sl], self.dst[sl], self.udp_sport[sl], self.dest_qp[sl] = arr.T
            self.n += len(new)
        return ids[inv]


class _Timeline:
    """Bytes per time bin for many series, with a bin width that doubles to stay within
    ``max_bins`` (for figures; exact sums, coarsening resolution as the span grows). With many
    series the number of bins shrinks (down to 64) so that at most ``max_cells`` are kept."""

    def __init__(self, max_bins: int = 2048, width_ns: int = 1000, max_cells: int = 1 << 22):
        self.max_bins = max_bins
        self.max_cells = max_cells
        self.width = width_ns
        self.origin = None
        self.bins = np.zeros((0, max_bins))

    def _fold(self) -> None:
        """Merge neighbouring bins pairwise: half the bins, twice the width."""
        self.bins = self.bins.reshape(self.bins.shape[0], -1, 2).sum(axis=2)
        self.width *= 2

    def add(self, ts, key, nbytes) -> None:
        if len(ts) == 0:
            return
        if self.origin is None:
            self.origin = int(ts.min())
        rel = np.maximum(ts - self.origin, 0)
        nk = int(key.max()) + 1
        if nk > self.bins.shape[0]:
            self.bins = np.vstack([self.bins, np.zeros((nk - self.bins.shape[0], self.bins.shape[1]))])
            while self.bins.size > self.max_cells and self.bins.shape[1] > 64:
                self._fold()                       # fewer, wider bins; the span still fits
        nb = self.bins.shape[1]
        while int(rel.max()) // self.width >= nb:
            self._fold()
            self.bins = np.concatenate([self.bins, np.zeros_like(self.bins)], axis=1)
        np.add.at(self.bins, (key, rel // self.width), nbytes)


class Summary:
    """Streaming summary of packet batches.

    Parameters
    ----------
    endpoints : :class:`Endpoints` the batches' ``src``/``dst`` ids refer to (filled as the
        source reads; read at :meth:`result` time).
    line_rate_bps : line rate in bits/s for utilization and packet durations; None if unknown.
    timescales_ns, idle_gap_ns : see :class:`~wiretrace.analysis.burstiness.Burstiness`.
    labels : names of the ``parallelism`` and ``phase`` codes when the batches carry them.
    window_ns : optional ``(start, end)`` observation window in ns (default: first to last packet).
    """

    def __init__(self, endpoints: Endpoints, line_rate_bps: float | None = None,
                 timescales_ns=DEFAULT_TIMESCALES_NS, idle_gap_ns: int = DEFAULT_IDLE_GAP_NS,
                 labels: dict[str, list[str]] | None = None, window_ns: tuple[int, int] | None = None):
        self.endpoints = endpoints
        self.line_rate_bps = line_rate_bps
        self.labels = labels or {}
        self.window_ns = window_ns
        self.burst = Burstiness(timescales_ns, idle_gap_ns, line_rate_bps,
                                origin_ns=window_ns[0] if window_ns else None)
        self.flows = _Flows()
        self.packets = 0
        self.bytes = 0
        self.payload_bytes = 0
        self.wire_bytes = 0
        self.first_ns = None
        self.last_ns = None
        self.opcodes = np.zeros(256, dtype=np.int64)
        self.ecn = np.zeros(4, dtype=np.int64)
        self.dscp = np.zeros(64, dtype=np.int64)
        self.ep = {k: np.zeros(0, dtype=np.int64) for k in ("tx_packets", "tx_bytes", "tx_wire", "rx_packets", "rx_bytes", "rx_wire")}
        self.groups = {g: {"packets": np.zeros(len(self.labels.get(g, ())) + 1, dtype=np.int64),
                           "bytes": np.zeros(len(self.labels.get(g, ())) + 1, dtype=np.int64)}
                       for g in ("parallelism", "phase") if g in self.labels}
        self.message_sizes = Distribution()
        self.message_source = None
        self.timeline = _Timeline()
        self.out_of_order = 0
        self.naks = None          # AETH syndromes of ACK packets, when the input has them

    # -- input -------------------------------------------------------------------------------

    def add(self, batch: dict) -> None:
        """Add one packet batch (columns of :data:`BATCH_COLUMNS`)."""
        ts = np.asarray(batch["ts_ns"], dtype=np.int64)
        n = len(ts)
        if n == 0:
            return
        src = np.asarray(batch["src"], dtype=np.int64)
        dst = np.asarray(batch["dst"], dtype=np.int64)
        flen = np.asarray(batch["frame_len"], dtype=np.int64)
        wlen = np.asarray(batch.get("wire_len", flen), dtype=np.int64)
        plen = np.asarray(batch["payload_len"], dtype=np.int64)
        op = np.asarray(batch["opcode"], dtype=np.uint8)
        # packets stamped earlier than one before them in the input (merged or reordered captures)
        running = np.maximum.accumulate(ts)
        if self.last_ns is not None:
            running = np.maximum(running, self.last_ns)
        self.out_of_order += int((ts[1:] < running[:-1]).sum()) + int(self.last_ns is not None and ts[0] < self.last_ns)
        self.packets += n
        self.bytes += int(flen.sum())
        self.wire_bytes += int(wlen.sum())
        self.payload_bytes += int(plen.sum())
        self.first_ns = int(ts.min()) if self.first_ns is None else min(self.first_ns, int(ts.min()))
        self.last_ns = int(ts.max()) if self.last_ns is None else max(self.last_ns, int(ts.max()))
        self.opcodes += np.bincount(op, minlength=256)
        self.ecn += np.bincount(np.asarray(batch["ecn"], dtype=np.int64) & 3, minlength=4)
        self.dscp += np.bincount(np.asarray(batch["dscp"], dtype=np.int64) & 63, minlength=64)

        # per NIC and direction
        nep = int(max(src.max(), dst.max())) + 1
        for k, v in self.ep.items():
            if len(v) < nep:
                self.ep[k] = np.concatenate([v, np.zeros(nep - len(v), dtype=np.int64)])
        self.ep["tx_packets"][:nep] += np.bincount(src, minlength=nep)
        self.ep["tx_bytes"][:nep] += np.bincount(src, weights=flen, minlength=nep).astype(np.int64)
        self.ep["tx_wire"][:nep] += np.bincount(src, weights=wlen, minlength=nep).astype(np.int64)
        self.ep["rx_packets"][:nep] += np.bincount(dst, minlength=nep)
        self.ep["rx_bytes"][:nep] += np.bincount(dst, weights=flen, minlength=nep).astype(np.int64)
        self.ep["rx_wire"][:nep] += np.bincount(dst, weights=wlen, minlength=nep).astype(np.int64)

        # burstiness and timeline: key = 2*endpoint + direction
        keys = np.concatenate([2 * src, 2 * dst + 1])
        ts2 = np.concatenate([ts, ts])
        self.burst.add(ts2, keys, np.concatenate([flen, flen]), np.concatenate([wlen, wlen]))
        self.timeline.add(ts2, keys, np.concatenate([flen, flen]))

        # parallelism / phase of each byte
        for g, acc in self.groups.items():
            code = np.asarray(batch[g], dtype=np.int64)
            code = np.where(code < 0, len(acc["packets"]) - 1, code)   # last slot: unknown
            acc["packets"] += np.bincount(code, minlength=len(acc["packets"]))
            acc["bytes"] += np.bincount(code, weights=flen, minlength=len(acc["bytes"])).astype(np.int64)

        # negative acknowledgements: AETH syndrome bits 6-5 (IBTA vol. 1 9.3.5, table 44):
        # 0 ACK, 1 RNR NAK, 3 NAK (low bits: 0 PSN sequence error, 1 invalid request,
        # 2 remote access error, 3 remote operational error, 4 invalid RD request)
        if "aeth_syndrome" in batch:
            syn = np.asarray(batch["aeth_syndrome"], dtype=np.int64)
            syn = syn[IS_ACK[op] & (syn >= 0)]
            if self.naks is None:
                self.naks = {"rnr_nak": 0, "nak_psn_sequence_error": 0, "nak_other": 0}
            kind = syn >> 5
            self.naks["rnr_nak"] += int((kind == 1).sum())
            self.naks["nak_psn_sequence_error"] += int(((kind == 3) & ((syn & 0x1F) == 0)).sum())
            self.naks["nak_other"] += int(((kind == 3) & ((syn & 0x1F) != 0)).sum())

        # flows and messages
        fid = self.flows.ids(src, dst, np.asarray(batch["udp_sport"]), np.asarray(batch["dest_qp"]))
        f = self.flows
        np.add.at(f.packets, fid, 1)
        np.add.at(f.bytes, fid, flen)
        np.add.at(f.payload_bytes, fid, plen)
        np.minimum.at(f.first_ns, fid, ts)
        np.maximum.at(f.last_ns, fid, ts)
        if self.message_source != "messages.parquet":
            self.message_source = "capture"
            self._reassemble(fid, ts, op, plen)

    def _reassemble(self, fid, ts, op, plen) -> None:
        """Message sizes from the opcode sequence of each flow (FIRST ... LAST, or ONLY)."""
        data = DATA_OPCODE[op]
        if not data.any():
            return
        fid, ts, plen, end = fid[data], ts[data], plen[data], MESSAGE_END[op[data]]
        order = np.lexsort((ts, fid))
        fid, plen, end = fid[order], plen[order], end[order]
        n = len(fid)
        c = np.cumsum(plen)
        ffirst = np.ones(n, dtype=bool)
        ffirst[1:] = fid[1:] != fid[:-1]
        starts = np.flatnonzero(ffirst)
        lens = np.diff(np.append(starts, n))
        base = np.repeat(c[starts] - plen[starts], lens)
        local = c - base                             # cumulative payload within the flow's run
        e = np.flatnonzero(end)
        if len(e):
            ef = fid[e]
            first_end = np.ones(len(e), dtype=bool)
            first_end[1:] = ef[1:] != ef[:-1]
            prev = np.empty(len(e), dtype=np.int64)
            prev[1:] = local[e[:-1]]
            prev[first_end] = -self.flows.carry[ef[first_end]]
            self.message_sizes.add(local[e] - prev)
        # payload after each flow's last message end carries over to the next batch
        last = np.append(starts[1:], n) - 1
        lf = fid[last]
        ends_before = np.full(len(last), -1, dtype=np.int64)
        if len(e):
            # index of the last end at or before each flow's last packet
            pos = np.searchsorted(e, last, side="right") - 1
            ok = pos >= 0
            ok[ok] &= fid[e[pos[ok]]] == lf[ok]
            ends_before[ok] = e[pos[ok]]
        had_end = ends_before >= 0
        tail = local[last] - np.where(had_end, local[np.maximum(ends_before, 0)], 0)
        self.flows.carry[lf] = np.where(had_end, tail, self.flows.carry[lf] + tail)

    def add_message_sizes(self, sizes) -> None:
        """Use message sizes from a messages table (bytes on the wire per message; an array or a
        :class:`Distribution`) instead of reassembling them from opcodes."""
        self.message_source = "messages.parquet"
        if isinstance(sizes, Distribution):
            self.message_sizes.merge(sizes)
        else:
            self.message_sizes.add(sizes)

    # -- results -----------------------------------------------------------------------------

    def _span_ns(self) -> int | None:
        if self.window_ns:
            return self.window_ns[1] - self.window_ns[0]
        if self.first_ns is None or self.last_ns == self.first_ns:
            return None
        return self.last_ns - self.first_ns

    def _util(self, wire_bytes) -> float | None:
        span = self._span_ns()
        if not self.line_rate_bps or not span:
            return None
        return float(wire_bytes) * 8e9 / span / self.line_rate_bps

    def _ep_sort(self, e: int) -> tuple:
        """Sort key of an endpoint: NIC index when known, else its address (numerically)."""
        ep = self.endpoints
        label = ep.label[e]
        try:
            import ipaddress

            addr = (0, int(ipaddress.ip_address(label)))
        except ValueError:
            addr = (1, label)
        return (ep.nic[e] if ep.nic[e] >= 0 else 1 << 40, addr)

    def nic_rows(self) -> list[dict]:
        """Per NIC (ordered by NIC index, else address): packets and bytes sent and received,
        utilization of each direction."""
        ep = self.endpoints
        rows = []
        for i in sorted(range(len(self.ep["tx_packets"])), key=self._ep_sort):
            rows.append({
                "nic": ep.label[i], "nic_index": ep.nic[i] if ep.nic[i] >= 0 else None,
                "node": ep.node[i] if ep.node[i] >= 0 else None,
                "tx_packets": int(self.ep["tx_packets"][i]), "tx_bytes": int(self.ep["tx_bytes"][i]),
                "rx_packets": int(self.ep["rx_packets"][i]), "rx_bytes": int(self.ep["rx_bytes"][i]),
                "tx_utilization": self._util(self.ep["tx_wire"][i]),
                "rx_utilization": self._util(self.ep["rx_wire"][i]),
            })
        return rows

    def flow_rows(self) -> list[dict]:
        f, ep = self.flows, self.endpoints
        n = f.n
        # largest first; ties in a fixed order (addresses, ports), whatever the input's order
        order = sorted(range(n), key=lambda i: (-int(f.bytes[i]), self._ep_sort(int(f.src[i])),
                                                self._ep_sort(int(f.dst[i])), int(f.udp_sport[i]),
                                                int(f.dest_qp[i])))
        rows = []
        for i in order:
            dur = int(f.last_ns[i] - f.first_ns[i])
            rows.append({
                "src": ep.label[f.src[i]], "dst": ep.label[f.dst[i]],
                "udp_sport": int(f.udp_sport[i]), "dest_qp": int(f.dest_qp[i]),
                "packets": int(f.packets[i]), "bytes": int(f.bytes[i]),
                "payload_bytes": int(f.payload_bytes[i]),
                "first_ns": int(f.first_ns[i]), "last_ns": int(f.last_ns[i]), "duration_ns": dur,
                "mean_rate_bps": (f.bytes[i] * 8e9 / dur) if dur > 0 else None,
            })
        return rows

    def _node_of(self, e: int):
        node = self.endpoints.node[e]
        return f"node{node}" if node >= 0 else self.endpoints.label[e]

    def matrix(self) -> dict:
        """Node x node bytes (rows: sender, columns: receiver); addresses when nodes are unknown."""
        f = self.flows
        names = []
        idx = {}
        for e in sorted(range(len(self.endpoints)), key=lambda e: (self.endpoints.node[e] if self.endpoints.node[e] >= 0
                                                                    else 1 << 40, self._ep_sort(e))):
            nm = self._node_of(e)
            if nm not in idx:
                idx[nm] = len(names)
                names.append(nm)
        m = np.zeros((len(names), len(names)), dtype=np.int64)
        if f.n:
            node_idx = np.array([idx[self._node_of(e)] for e in range(len(self.endpoints))])
            np.add.at(m, (node_idx[f.src[: f.n]], node_idx[f.dst[: f.n]]), f.bytes[: f.n])
        return {"nodes": names, "bytes": m.tolist(),
                "unit": "bytes", "by": "node" if all(x >= 0 for x in self.endpoints.node) else "address"}

    def by_rows(self, by: str) -> list[dict]:
        """Bytes and packets per NIC, node, parallelism or phase (shares of all bytes)."""
        total = self.bytes or 1
        if by == "nic":
            return [dict(r, share=r["tx_bytes"] / total) for r in self.nic_rows()]
        if by == "node":
            acc: dict[str, dict] = {}
            for e in sorted(range(len(self.ep["tx_packets"])), key=self._ep_sort):
                r = {k: int(self.ep[k][e]) for k in ("tx_packets", "tx_bytes", "rx_packets", "rx_bytes")}
                nm = self._node_of(e)
                a = acc.setdefault(nm, {"node": nm, "tx_packets": 0, "tx_bytes": 0, "rx_packets": 0,
                                        "rx_bytes": 0, "tx_wire": 0, "rx_wire": 0})
                for k in ("tx_packets", "tx_bytes", "rx_packets", "rx_bytes"):
                    a[k] += r[k]
                a["tx_wire"] += int(self.ep["tx_wire"][e])
                a["rx_wire"] += int(self.ep["rx_wire"][e])
            out = []
            for a in acc.values():
                a["share"] = a["tx_bytes"] / total
                a.pop("tx_wire"), a.pop("rx_wire")
                out.append(a)
            return out
        if by in ("parallelism", "phase"):
            if by not in self.groups:
                return []
            acc = self.groups[by]
            names = list(self.labels[by]) + ["unknown"]
            return [{by: nm, "packets": int(p), "bytes": int(b), "share": int(b) / total}
                    for nm, p, b in zip(names, acc["packets"], acc["bytes"]) if p]
        raise ValueError(f"--by must be one of {', '.join(GROUP_KEYS)}")

    def burst_rows(self) -> tuple[list[dict], list[dict]]:
        end = self.window_ns[1] if self.window_ns else None
        rows, onoff = [], []
        for key in sorted(self.burst.keys(), key=lambda k: (self._ep_sort(int(k) // 2), int(k) % 2)):
            e, d = int(key) // 2, ("tx", "rx")[int(key) % 2]
            head = {"nic": self.endpoints.label[e], "direction": d}
            for r in self.burst.window_stats(int(key), end):
                rows.append({**head, **r})
            onoff.append({**head, **self.burst.onoff(int(key))})
        return rows, onoff

    def result(self, by: str = "nic") -> dict:
        """The whole summary as a JSON-ready dict (stable keys; see the module docstring)."""
        flows = self.flow_rows()
        flow_sizes = Distribution()
        flow_sizes.add([r["bytes"] for r in flows])
        span = self._span_ns()
        burst, onoff = self.burst_rows()
        acks = int(self.opcodes[IS_ACK].sum())
        return {
            "totals": {
                "packets": self.packets, "bytes": self.bytes, "payload_bytes": self.payload_bytes,
                "wire_bytes": self.wire_bytes, "flows": len(flows), "nics": len(self.endpoints),
                "first_ns": self.first_ns, "last_ns": self.last_ns, "duration_ns": span,
                "mean_rate_bps": (self.bytes * 8e9 / span) if span else None,
                "out_of_order_packets": self.out_of_order,
            },
            "line_rate_bps": self.line_rate_bps,
            "flows": flows,
            "flow_sizes": flow_sizes.to_dict(),
            "message_sizes": dict(self.message_sizes.to_dict(), source=self.message_source),
            "nics": self.nic_rows(),
            "burstiness": burst,
            "onoff": onoff,
            "idle_gap_ns": self.burst.idle_gap_ns,
            "matrix": self.matrix(),
            "opcodes": {opcode_name(c): int(n) for c, n in enumerate(self.opcodes) if n},
            "acks": acks,
            "naks": dict(self.naks) if self.naks is not None else None,
            "cnps": int(self.opcodes[CNP_OPCODE]),
            "ecn": {ECN_NAMES[i]: int(n) for i, n in enumerate(self.ecn)},
            "dscp": {str(i): int(n) for i, n in enumerate(self.dscp) if n},
            "by": {"key": by, "rows": self.by_rows(by)},
            "parallelism": self.by_rows("parallelism") if "parallelism" in self.groups else None,
            "phase": self.by_rows("phase") if "phase" in self.groups else None,
        }
