"""Messages -> packets: segmentation at the path MTU, PSNs, ACKs, RDMA READ, ECN marks and CNPs.

Every rule below is applied to whole columns (``np.repeat``/``cumsum`` over messages and packets),
never in a Python loop per packet or per message.

* **Segmentation** (IBTA vol. 1 9.7.7): a message of ``B`` bytes becomes ``max(1, ceil(B / MTU))``
  packets; FIRST and MIDDLE carry exactly the path MTU, LAST the rest, ONLY 0..MTU; the payload is
  padded to 4 bytes (BTH PadCnt). The bytes carried are the message's ``wire_bytes`` (its payload
  with the NCCL protocol's overhead).
* **Verbs**: ``write_imm`` RDMA WRITE FIRST (RETH) / MIDDLE / LAST WITH IMMEDIATE (ImmDt), or
  WRITE ONLY WITH IMMEDIATE (RETH + ImmDt); ``write`` likewise without immediate; ``send`` and
  ``send_imm`` the SEND forms; ``read`` an RDMA READ REQUEST (RETH, from the data receiver) that
  consumes as many PSNs as it has responses, then READ RESPONSE FIRST (AETH) / MIDDLE / LAST (AETH)
  or ONLY (AETH) from the data sender. The RETH DMA length is the message length; ImmDt carries
  the message size in bytes (low 32 bits), as NCCL's IB transport posts it for a single request
  (``ncclIbMultiSend``, ``src/transport/net_ib.cc``: ``imm_data = reqs[0]->send.size``).
* **PSN** per requester QP, 24 bits, wrapping, contiguous over the QP's messages in posting order
  (``t_start_ns``, then ``msg_id``), from ``transport.initial_psn``.
* **ACKs** (RC ACKNOWLEDGE, AETH): ``transport.ack`` ``"message"`` (default): one per message, sent
  by the receiver when the message has arrived (``t_end_ns``), acknowledging its last PSN with the
  message's MSN, AckReq set on the last packet; ``{"every_packets": N}``: AckReq and an ACK on every
  N-th packet of the QP and on each message's last packet; ``{"window": "2us"}``: at most one ACK
  per QP per window, when the window closes, for the last message completed in it. The AETH
  syndrome is an ACK with credit count code :data:`CREDIT_CODE` (IBTA 9.7.5.1.4: 256 receive WQEs,
  NCCL's ``MAX_REQUESTS``). READ responses acknowledge reads; no separate ACK.
* **Times**: a message's packets leave its NIC back to back from ``t_start_ns``; each starts at
  ``t_start_ns + (t_end_ns - latency - t_start_ns) * (wire bytes before it) / (wire bytes of the
  message)``, wire bytes counting Ethernet's preamble, FCS and inter-frame gap, so that the last
  bit leaves at ``t_end_ns - latency`` as the timing stage computed (never faster than the line
  rate).
* **Links**: every frame a NIC sends (data, ACK, CNP, READ request and response) goes through
  that NIC's link, first come first served: a frame starts no earlier than the previous frame
  from the same NIC has left (its bytes plus preamble+SFD, FCS and inter-frame gap at the NIC
  rate, IEEE 802.3 clause 4.4.2), so an ACK waits behind a data packet its NIC is sending. An
  ACK leaves no earlier than the packet it acknowledges has arrived, a READ response no earlier
  than its request has. Times on the link are kept in picoseconds; ``ts_ns`` rounds the start
  up to the nanosecond.
* **ECN / CNP** (``transport.ecn_marking``, RoCEv2 only): a seeded ``fraction`` of ECN-capable data
  packets, or those arriving at the receiver's switch port while its queue (drained at the NIC
  rate) holds more than ``queue_bytes``, are marked CE; the receiver answers with a CNP (opcode
  0x81, BECN, DSCP 48, ECT(0), UDP source port 0, PSN 0, 16 reserved bytes: what ConnectX sends,
  see ``../shared/real/roce_packets``) to the sending QP; consecutive CNPs to one QP are at least
  ``cnp_interval`` apart (default 4 us, ConnectX's ``min_time_between_cnps``, a minimum gap per
  QP measured from the previous CNP, not a time slot).

Output is a stream of chunks of the packets table, each sorted by ``ts_ns``, chunks in time order;
a packet is emitted only once no later message can produce an earlier one, so memory stays
bounded by the packets in flight, not by the trace; each NIC's 'busy until' carries over from one
chunk to the next, and the output does not depend on the chunk size.

How the work is laid out (the packets are the same either way): while frames are scheduled they
carry only what the orders and the links read, plus their message (``_mi``); the other columns
follow from message, kind, opcode and PSN and a :class:`PacketChunk` computes them when first
read (a capture writer reads few of them for most frames). Runs without ECN marking keep each
expansion step's frames in one pool and move index arrays until the emitted frames are taken
once (:func:`_packetize_unmarked`); runs with marking, whose CNPs join the links as they are
made, take the general loop in :func:`packetize`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

import numpy as np

from ..errors import WiretraceError
from ..plan import Plan, parse_duration_ns, parse_size
from ..topology import Topology
from . import headers as H
from . import layout
from .qp import (PSN_MOD, VERB_CODE, assign_qps, connection_qps, initial_psn, splitmix64, _str_col)

CREDIT_TABLE = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
"""AETH credit count codes 0..30 -> receive WQEs (IBTA vol. 1 9.7.5.1.4); 31 means 'invalid'."""
RQ_DEPTH = 256
"""Receive WQEs an NCCL receiver keeps posted (``MAX_REQUESTS``, net_ib.cc)."""
CREDIT_CODE = max(i for i, c in enumerate(CREDIT_TABLE) if c <= RQ_DEPTH)
ACK_SYNDROME = CREDIT_CODE  # bits 7..5 = 000 (ACK), 4..0 = credit code
CNP_DSCP = 48
MAX_MESSAGE_BYTES = 1 << 31
"""Largest RDMA message (IBTA vol. 1 9.4.1: 2^31 bytes)."""
CNP_ECN = 2
DEFAULT_CNP_INTERVAL_NS = 4000

# opcode by verb and position (FIRST, MIDDLE, LAST, ONLY)
_POS_FIRST, _POS_MIDDLE, _POS_LAST, _POS_ONLY = 0, 1, 2, 3
_OPS = {
    "write_imm": ("RDMA_WRITE_FIRST", "RDMA_WRITE_MIDDLE", "RDMA_WRITE_LAST_WITH_IMMEDIATE",
                  "RDMA_WRITE_ONLY_WITH_IMMEDIATE"),
    "write": ("RDMA_WRITE_FIRST", "RDMA_WRITE_MIDDLE", "RDMA_WRITE_LAST", "RDMA_WRITE_ONLY"),
    "send": ("SEND_FIRST", "SEND_MIDDLE", "SEND_LAST", "SEND_ONLY"),
    "send_imm": ("SEND_FIRST", "SEND_MIDDLE", "SEND_LAST_WITH_IMMEDIATE", "SEND_ONLY_WITH_IMMEDIATE"),
    "read": ("RDMA_READ_RESPONSE_FIRST", "RDMA_READ_RESPONSE_MIDDLE", "RDMA_READ_RESPONSE_LAST",
             "RDMA_READ_RESPONSE_ONLY"),
}
OPCODE_TABLE = np.zeros((len(VERB_CODE), 4), dtype=np.uint8)
for _v, _names in _OPS.items():
    OPCODE_TABLE[VERB_CODE[_v]] = [H.opcode("RC_" + n) for n in _names]
OP_ACK = H.opcode("RC_ACKNOWLEDGE")
OP_READ_RESPONSE_FIRST = H.opcode("RC_RDMA_READ_RESPONSE_FIRST")
OP_READ_REQUEST = H.opcode("RC_RDMA_READ_REQUEST")
OP_CNP = H.CNP_OPCODE

_HAS_RETH = np.zeros(256, dtype=bool)
_HAS_AETH = np.zeros(256, dtype=bool)
_HAS_IMM = np.zeros(256, dtype=bool)
for _c, _o in H.OPCODES.items():
    _HAS_RETH[_c] = "reth" in _o.ext
    _HAS_AETH[_c] = "aeth" in _o.ext
    _HAS_IMM[_c] = "immdt" in _o.ext
HAS_RETH, HAS_AETH, HAS_IMM = _HAS_RETH, _HAS_AETH, _HAS_IMM

# internal frame kinds
K_DATA, K_ACK, K_READ_REQ, K_CNP = 0, 1, 2, 3

PACKET_COLUMNS = ("ts_ns", "msg_id", "src_nic", "dst_nic", "udp_sport", "dest_qp", "psn", "opcode",
                  "ack_req", "payload_len", "pad", "frame_len", "dscp", "ecn", "dma_len", "msn", "imm")
_DTYPES = {"ts_ns": np.int64, "msg_id": np.int64, "src_nic": np.int32, "dst_nic": np.int32,
           "udp_sport": np.int32, "dest_qp": np.int32, "psn": np.int32, "opcode": np.uint8,
           "ack_req": np.bool_, "payload_len": np.int32, "pad": np.uint8, "frame_len": np.int32,
           "dscp": np.uint8, "ecn": np.uint8, "dma_len": np.int64, "msn": np.int32, "imm": np.int64,
           # internal: frame kind, the row this frame answers (a READ response its request, an
           # ACK the data packet it acknowledges; -1 none) and the time the frame was ready
           # before its NIC's link serialized it
           "_kind": np.uint8, "_dep": np.int64, "_ots": np.int64,
           # also yielded: see TEMPLATE_COLUMN
           "_tmpl": np.int32,
           # the frame's message (row of _Messages), from which the columns in DERIVED follow
           "_mi": np.int32}
DERIVED = ("msg_id", "dst_nic", "udp_sport", "dest_qp", "dma_len", "msn", "imm")
"""Columns a frame does not carry while it is scheduled: they follow from its message, kind,
opcode and PSN (:func:`_derive`)."""
TEMPLATE_COLUMN = "_tmpl"
"""Column of every yielded chunk besides :data:`PACKET_COLUMNS`: rows with the same value >= 0 are
MIDDLE data packets of one message whose ECN was not changed (not CE-marked), so their frames are
the same but for the PSN, AckReq, IPv4 identification and checksum and the time; -1 for every
other row. The renderer copies such frames from one rendered frame per value instead of
comparing their columns (:func:`wiretrace.transport.render.render_slots`). Tables from elsewhere
do not carry it; the Parquet packets table does not store it."""


YIELDED_COLUMNS = PACKET_COLUMNS + (TEMPLATE_COLUMN,)


def _empty() -> dict[str, np.ndarray]:
    return {k: np.zeros(0, dtype=t) for k, t in _DTYPES.items()}


def _concat(parts: list[dict]) -> dict[str, np.ndarray]:
    parts = [p for p in parts if len(p["ts_ns"])]
    if not parts:
        return _empty()
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _take(cols: dict, sel, keys=None) -> dict:
    """Rows ``sel`` of the columns ``keys`` (default: all) of ``cols``."""
    return {k: cols[k][sel] for k in (cols if keys is None else keys)}


def _ack_policy(plan: Plan) -> tuple[str, int]:
    a = plan.transport.ack
    if a in (None, "message"):
        return "message", 0
    if isinstance(a, dict):
        if "every_packets" in a:
            return "every", int(a["every_packets"])
        if "window" in a:
            return "window", max(1, parse_duration_ns(a["window"], "plan $.transport.ack.window"))
    raise WiretraceError(f"plan $.transport.ack: expected \"message\", {{\"every_packets\": N}} or "
                         f"{{\"window\": \"2us\"}}, got {a!r}")


class _Messages:
    """Per-message quantities computed once over the whole (sorted) network messages table."""

    def __init__(self, m: dict, topo: Topology, plan: Plan):
        t = plan.transport
        self.n = n = len(m["msg_id"])
        self.msg_id = np.asarray(m["msg_id"], dtype=np.int64)
        self.src = np.asarray(m["src_nic"], dtype=np.int64)
        self.dst = np.asarray(m["dst_nic"], dtype=np.int64)
        self.t_start = np.asarray(m["t_start_ns"], dtype=np.int64)
        self.t_end = np.asarray(m["t_end_ns"], dtype=np.int64)
        self.bytes = np.asarray(m["wire_bytes"], dtype=np.int64)
        if (self.bytes < 0).any():
            raise WiretraceError(f"messages: negative wire_bytes in msg_id {int(self.msg_id[np.argmax(self.bytes < 0)])}")
        if (self.bytes > MAX_MESSAGE_BYTES).any():
            i = int(np.argmax(self.bytes > MAX_MESSAGE_BYTES))
            raise WiretraceError(f"messages: msg_id {int(self.msg_id[i])} has {int(self.bytes[i]):,} bytes, more than "
                                 f"the 2 GiB an RDMA message can carry (IBTA: 2^31 bytes, RETH DMA length)")
        verbs = _str_col(m["verb"])
        unknown = sorted(set(np.unique(verbs).tolist()) - set(VERB_CODE))
        if unknown:
            raise WiretraceError(f"messages: unknown verb(s) {unknown}; expected one of {', '.join(VERB_CODE)}")
        self.verb = np.zeros(n, dtype=np.int64)
        for v, c in VERB_CODE.items():
            self.verb[verbs == v] = c
        self.is_read = self.verb == VERB_CODE["read"]
        self.udp_sport = np.asarray(m["udp_sport"], dtype=np.int32)
        self.mtu = t.path_mtu
        self.npk = np.maximum(1, -(-self.bytes // self.mtu))
        self.last_pay = self.bytes - (self.npk - 1) * self.mtu     # payload of the last packet

        qps = connection_qps(m, plan)
        qp_on_dst = np.asarray(m["qpn"], dtype=np.int64)
        is_cts = _str_col(m["kind"]) == "cts"
        qp_on_src = np.where(is_cts, qps["receiver_qpn"], qps["sender_qpn"])
        self.qp_src, self.qp_dst = qp_on_src, qp_on_dst
        self.src32, self.dst32 = self.src.astype(np.int32), self.dst.astype(np.int32)
        self.qp_src32, self.qp_dst32 = qp_on_src.astype(np.int32), qp_on_dst.astype(np.int32)
        req_nic = np.where(self.is_read, self.dst, self.src)
        req_qpn = np.where(self.is_read, qp_on_dst, qp_on_src)

        # PSN and MSN per requester QP, in posting order: rows are sorted by t_start, but a READ
        # is posted when its request leaves the data receiver, one hop before the data flows
        stream = req_nic * (1 << 24) + req_qpn
        posted = self.t_start.copy()
        if self.is_read.any():
            req_len = (layout.base_header_len(plan) + layout.trailer_len(plan) + H.RETH.length
                       + layout.wire_extra(plan))
            req_ns = np.int64(np.ceil(req_len * 8 / topo.nic_rate_bps * 1e9))
            posted[self.is_read] -= np.int64(topo.latency_ns) + req_ns
        order = np.lexsort((posted, stream))
        s_sorted = stream[order]
        first = np.r_[True, s_sorted[1:] != s_sorted[:-1]] if n else np.zeros(0, bool)
        grp_start = np.maximum.accumulate(np.where(first, np.arange(n), 0)) if n else np.zeros(0, np.int64)
        cum = np.cumsum(self.npk[order]) - self.npk[order]
        psn_off = np.empty(n, dtype=np.int64)
        psn_off[order] = cum - cum[grp_start]
        ordinal = np.empty(n, dtype=np.int64)
        ordinal[order] = np.arange(n) - grp_start
        self.stream = stream
        self.psn_off = psn_off                       # packets of the QP before this message
        self.psn0 = (initial_psn(req_nic, req_qpn, plan) + psn_off) % PSN_MOD
        self.msn = (ordinal + 1) % PSN_MOD           # responder's MSN once this message completes

        self.latency = np.int64(topo.latency_ns)
        self.rate = topo.nic_rate_bps
        self.base = layout.base_header_len(plan) + layout.trailer_len(plan)
        self.wire_extra = layout.wire_extra(plan)
        self.grh = layout.has_grh(self.src, self.dst, topo, plan)
        self.grh_len = self.grh.astype(np.int64) * H.GRH.length

        # ACKs decided per message (reads are acknowledged by their responses)
        self.policy, self.policy_arg = _ack_policy(plan)
        self.ack_msg = ~self.is_read
        self.ack_ts = self.t_end.copy()
        if self.policy == "window" and n:
            w = self.policy_arg
            bucket = self.t_end // w
            o = np.lexsort((self.t_end, bucket, stream))
            last = np.r_[(stream[o][1:] != stream[o][:-1]) | (bucket[o][1:] != bucket[o][:-1]), True]
            keep = np.zeros(n, dtype=bool)
            keep[o[last]] = True
            self.ack_msg &= keep
            self.ack_ts = (bucket + 1) * w
        elif self.policy == "every":
            self.ack_msg[:] = False          # ACKs come from packets, see _expand

        # earliest packet a message can produce, relative to its t_start (read requests go first)
        self.lookback = np.int64(0)
        if self.is_read.any():
            req_bytes = self.base + H.RETH.length + self.wire_extra + H.GRH.length
            self.lookback = self.latency + np.int64(np.ceil(req_bytes * 8 / self.rate * 1e9)) + 1

        # transport constants of the frames
        self.kind_ib = t.kind == "ib"
        self.dscp = 0 if self.kind_ib else t.dscp
        self.ecn = 0 if self.kind_ib else t.ecn_bits

    def wire_ns(self, frame_len: np.ndarray) -> np.ndarray:
        return np.ceil((frame_len.astype(np.int64) + self.wire_extra) * 8 / self.rate * 1e9).astype(np.int64)


def _expand(M: _Messages, lo: int, hi: int, carry: dict | None = None,
            cols: tuple = ()) -> dict[str, np.ndarray]:
    """Packets (data, read requests, ACKs) of messages ``lo:hi``, unsorted, as one column dict
    whose ``_dep`` points at rows of the same dict; ``ts_ns`` is when each frame is ready to go
    (before its NIC's link serializes it, see :class:`_Links`). The rows of ``carry`` (frames
    with the same columns, ``_dep`` pointing into ``carry``) come first. Only the columns
    ``cols`` (default all but ``dscp`` and ``ecn``, see :func:`_dscp_ecn`) are kept."""
    sl = slice(lo, hi)
    npk = M.npk[sl]
    total = int(npk.sum())
    starts = np.cumsum(npk) - npk                           # first packet of each message
    ends = starts + npk - 1                                 # last packet of each message

    def rep(a):
        return np.repeat(a[sl], npk)

    k = np.arange(total, dtype=np.int64) - np.repeat(starts, npk)
    last = np.zeros(total, dtype=bool)
    last[ends] = True
    mtu = M.mtu
    b = M.bytes[sl]
    last_pay = b - (npk - 1) * mtu
    if not cols or "payload_len" in cols:
        payload = np.full(total, mtu, dtype=np.int32)
        payload[ends] = last_pay
        pad = np.zeros(total, dtype=np.uint8)
        pad[ends] = (-last_pay) & 3
    else:                                       # computed when read (PacketChunk)
        payload = pad = np.zeros(0, dtype=np.uint8)
    verb = M.verb[sl]
    one = npk == 1
    opcode = np.repeat(OPCODE_TABLE[verb, _POS_MIDDLE], npk)
    opcode[ends] = OPCODE_TABLE[verb, _POS_LAST]
    opcode[starts] = np.where(one, OPCODE_TABLE[verb, _POS_ONLY], OPCODE_TABLE[verb, _POS_FIRST])
    ext = H.EXT_LEN.astype(np.int64)
    fixed = M.base + M.grh_len[sl]                          # headers and trailer without ext
    f_first = fixed + ext[opcode[starts]] + np.where(one, last_pay + ((-last_pay) & 3), mtu)
    f_mid = fixed + ext[OPCODE_TABLE[verb, _POS_MIDDLE]] + mtu
    f_last = fixed + ext[opcode[ends]] + last_pay + ((-last_pay) & 3)
    flen = np.repeat(f_mid.astype(np.int32), npk)
    flen[ends] = f_last
    flen[starts] = f_first

    # times: spread over [t_start, t_end - latency] in proportion to wire bytes; the wire bytes
    # before packet k are k middle packets, corrected for the first one
    x = M.wire_extra
    w_first, w_mid = f_first + x, f_mid + x
    msg_total = np.where(one, w_first, w_first + (npk - 2) * w_mid + f_last + x)
    span = M.t_end[sl] - M.latency - M.t_start[sl]
    own = np.ceil(msg_total * 8 / M.rate * 1e9).astype(np.int64)
    span = np.maximum(span, own)                            # never faster than the line rate
    before = k * _per_packet(w_mid, npk)
    before += _per_packet(w_first - w_mid, npk)
    before[starts] = 0
    # span * before / total without overflowing int64: (span // total) * before + the remainder
    total_b = np.maximum(msg_total, 1)
    whole, rest = np.divmod(span, total_b)
    ts = _per_packet(rest, npk) * before
    ts //= _per_packet(total_b, npk)
    ts += rep(M.t_start)
    if whole.any():                                          # slower than the line rate
        ts += _per_packet(whole, npk) * before

    psn = (rep(M.psn0) + k) & (PSN_MOD - 1)
    is_read = M.is_read[sl]
    if M.policy == "every":
        N = M.policy_arg
        ack_req = (((rep(M.psn_off) + k + 1) % N) == 0) | last
    else:
        ack_req = last.copy()
    if is_read.any():
        ack_req &= ~np.repeat(is_read, npk)
    mi = np.repeat(np.arange(lo, hi, dtype=np.int32), npk)
    tmpl = mi.copy()
    tmpl[starts] = -1
    tmpl[ends] = -1
    data = {
        "ts_ns": ts, "src_nic": rep(M.src32), "psn": psn.astype(np.int32),
        "opcode": opcode, "ack_req": ack_req, "payload_len": payload, "pad": pad, "frame_len": flen,
        "_kind": np.zeros(total, np.uint8), "_dep": np.full(total, -1, np.int64), "_tmpl": tmpl, "_mi": mi,
    }
    parts = [data]

    # RDMA READ requests: from the data receiver to the data sender, before the responses
    rr = np.nonzero(M.is_read[sl])[0]
    if len(rr):
        # each response packet answers its request (rows after the data rows)
        req_row = np.full(hi - lo, -1, np.int64)
        req_row[rr] = total + np.arange(len(rr))
        data["_dep"] = np.repeat(req_row, npk)
        gr = lo + rr
        fl = (M.base + H.RETH.length + M.grh_len[gr]).astype(np.int64)
        wns = M.wire_ns(fl)
        parts.append({
            "ts_ns": np.maximum(0, M.t_start[gr] - M.latency - wns),
            "src_nic": M.dst[gr].astype(np.int32),
            "psn": M.psn0[gr].astype(np.int32), "opcode": np.full(len(gr), OP_READ_REQUEST, np.uint8),
            "ack_req": np.zeros(len(gr), bool), "payload_len": np.zeros(len(gr), np.int32),
            "pad": np.zeros(len(gr), np.uint8), "frame_len": fl.astype(np.int32),
            "_kind": np.full(len(gr), K_READ_REQ, np.uint8),
            "_dep": np.full(len(gr), -1, np.int64), "_tmpl": np.full(len(gr), -1, np.int32),
            "_mi": gr.astype(np.int32),
        })

    # ACKs
    if M.policy == "every":
        a = np.nonzero(ack_req)[0]
        a_ts = ts[a] + M.wire_ns(flen[a]) + M.latency
        a_g = lo + np.searchsorted(starts, a, side="right") - 1
        a_psn = psn[a]
        a_dep = a
    else:
        am = np.nonzero(M.ack_msg[sl])[0]
        a_g = lo + am
        a_ts = M.ack_ts[a_g]
        a_psn = (M.psn0[a_g] + M.npk[a_g] - 1) % PSN_MOD
        a_dep = ends[am]
    if len(a_g):
        na = len(a_g)
        fl = (M.base + H.AETH.length + M.grh_len[a_g]).astype(np.int64)
        parts.append({
            "ts_ns": a_ts.astype(np.int64),
            "src_nic": M.dst[a_g].astype(np.int32),
            "psn": a_psn.astype(np.int32), "opcode": np.full(na, OP_ACK, np.uint8),
            "ack_req": np.zeros(na, bool), "payload_len": np.zeros(na, np.int32),
            "pad": np.zeros(na, np.uint8), "frame_len": fl.astype(np.int32),
            "_kind": np.full(na, K_ACK, np.uint8),
            "_dep": a_dep.astype(np.int64), "_tmpl": np.full(na, -1, np.int32),
            "_mi": np.asarray(a_g, dtype=np.int32),
        })
    n0 = len(carry["ts_ns"]) if carry is not None else 0
    for q in parts:
        q["_ots"] = q["ts_ns"]
        if n0 and not (q is data and not len(rr)):          # data rows answer only READs
            q["_dep"] = np.where(q["_dep"] >= 0, q["_dep"] + n0, -1)
    if n0:
        parts.insert(0, carry)
    return {k: np.concatenate([q[k] for q in parts]) if len(parts) > 1 else parts[0][k].copy()
            for k in (cols or parts[-1])}


def _per_packet(v: np.ndarray, npk: np.ndarray):
    """``v`` (one value per message) repeated for each message's packets, or the one value
    when all messages share it (a scalar broadcasts at no cost)."""
    if len(v) and (v == v[0]).all():
        return v[0]
    return np.repeat(v, npk)


class _Marker:
    """ECN CE marking and CNP generation over packets emitted in time order (state across chunks)."""

    def __init__(self, plan: Plan, topo: Topology, M: _Messages):
        spec = dict(plan.transport.ecn_marking or {})
        self.on = bool(spec) and ("fraction" in spec or "queue_bytes" in spec)
        if self.on and plan.transport.kind != "rocev2":
            raise WiretraceError("plan $.transport.ecn_marking: ECN marks and CNPs are RoCEv2 features; "
                                 "kind is \"ib\"")
        if self.on and plan.transport.ecn_bits == 0:
            raise WiretraceError("plan $.transport.ecn_marking: data packets are Not-ECT (transport.ecn); "
                                 "switches only mark ECN-capable packets")
        self.fraction = float(spec.get("fraction", 0.0))
        self.queue = parse_size(spec["queue_bytes"], "plan $.transport.ecn_marking.queue_bytes") if "queue_bytes" in spec else None
        self.interval = (parse_duration_ns(spec["cnp_interval"], "plan $.transport.ecn_marking.cnp_interval")
                         if "cnp_interval" in spec else DEFAULT_CNP_INTERVAL_NS)
        self.seed = np.uint64(plan.seed & 0xFFFFFFFFFFFFFFFF)
        self.rate_Bpns = topo.nic_rate_bps / 8e9
        self.latency = topo.latency_ns
        self.base = M.base
        self.wire_ns = M.wire_ns
        self.qp_src = M.qp_src32
        self.q_state: dict[int, tuple[int, float]] = {}   # dst NIC -> (last arrival ns, backlog incl.)
        # last CNP per QP: keys (NIC << 24 | QPN) sorted, and the time of that QP's last CNP
        self.cnp_keys = np.zeros(0, dtype=np.int64)
        self.cnp_last = np.zeros(0, dtype=np.int64)

    def mark(self, p: dict) -> dict | None:
        """Mark CE in place on the data packets of ``p`` (sorted by ts); return the CNPs."""
        data = np.nonzero((p["_kind"] == K_DATA) & (p["ecn"] != 0))[0]
        if not len(data):
            return None
        ce = np.zeros(len(data), dtype=bool)
        if self.fraction > 0:
            key = (p["msg_id"][data].astype(np.uint64) << np.uint64(24)) ^ p["psn"][data].astype(np.uint64)
            with np.errstate(over="ignore"):
                h = splitmix64(key ^ splitmix64(np.full(len(data), self.seed, np.uint64)))
            u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
            ce |= u < self.fraction
        if self.queue is not None:
            ce |= self._queue_marks(p, data)
        rows = data[ce]
        if not len(rows):
            return None
        p["ecn"][rows] = 3
        p[TEMPLATE_COLUMN][rows] = -1
        return self._cnps(p, rows)

    def _queue_marks(self, p: dict, data: np.ndarray) -> np.ndarray:
        # Lindley recursion per destination port in closed form:
        # backlog_n = Y_n - min_{k<=n} Y_k, Y_n = bytes arrived before n - C * arrival_n
        dst = p["dst_nic"][data].astype(np.int64)
        arr = p["ts_ns"][data] + self.latency
        size = p["frame_len"][data].astype(np.float64)
        order = np.lexsort((arr, dst))
        d, a, s = dst[order], arr[order], size[order]
        out = np.zeros(len(data), dtype=bool)
        bounds = np.flatnonzero(np.r_[True, d[1:] != d[:-1], True])
        C = self.rate_Bpns
        for i in range(len(bounds) - 1):          # one iteration per destination NIC in the chunk
            lo, hi = bounds[i], bounds[i + 1]
            nic = int(d[lo])
            t0, q0 = self.q_state.get(nic, (int(a[lo]), 0.0))
            aa = np.r_[t0, a[lo:hi]].astype(np.float64) - t0
            ss = np.r_[q0, s[lo:hi]]
            Y = (np.cumsum(ss) - ss) - C * aa
            backlog = Y - np.minimum.accumulate(Y)
            out[order[lo:hi]] = backlog[1:] > self.queue
            self.q_state[nic] = (int(a[hi - 1]), float(backlog[-1] + ss[-1]))
        return out

    def _space(self, key: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """Indices of the CE-marked packets (QP ``key``, arrival ``ts``) that get a CNP: per QP, the
        first arrival at least ``interval`` after that QP's previous CNP, then greedily each next
        one at least ``interval`` after the last CNP sent (ConnectX ``min_time_between_cnps`` is
        a minimum gap per QP, not a time slot). Vectorized: each pass follows one step of every
        QP's chain of 'next arrival an interval later'; the passes are as many as CNPs per QP in
        the batch."""
        o = np.lexsort((ts, key))
        k, t = key[o], ts[o]
        # the QP's previous CNP (earlier batches)
        pos = np.searchsorted(self.cnp_keys, k)
        pos_c = np.minimum(pos, max(len(self.cnp_keys) - 1, 0))
        known = (pos < len(self.cnp_keys)) & (self.cnp_keys[pos_c] == k) if len(self.cnp_keys) else np.zeros(len(k), bool)
        ok = ~known | (t >= (self.cnp_last[pos_c] if len(self.cnp_keys) else 0) + self.interval)
        o, k, t = o[ok], k[ok], t[ok]
        if not len(o):
            return o
        # next candidate of the same QP at least one interval later (n = none)
        n = len(o)
        qp_rank = np.cumsum(np.r_[True, k[1:] != k[:-1]]) - 1
        width = int(t.max()) - int(t.min()) + self.interval + 1
        flat = qp_rank * np.int64(width) + (t - t.min())
        nxt = np.maximum(np.searchsorted(flat, flat + self.interval, side="left"), np.arange(1, n + 1))
        nxt = np.where((nxt < n) & (qp_rank[np.minimum(nxt, n - 1)] == qp_rank), nxt, n)
        chosen = np.zeros(n + 1, dtype=bool)
        frontier = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        while len(frontier):
            chosen[frontier] = True
            frontier = nxt[frontier]
            frontier = frontier[frontier < n]
        chosen = chosen[:n]
        # remember each QP's last CNP
        ck, ct = k[chosen], t[chosen]
        last = np.r_[ck[1:] != ck[:-1], True]
        keys = np.r_[self.cnp_keys, ck[last]]
        times = np.r_[self.cnp_last, ct[last]]
        u, first_from_end = np.unique(keys[::-1], return_index=True)
        self.cnp_keys, self.cnp_last = u, times[::-1][first_from_end]
        return np.sort(o[chosen])

    def _cnps(self, p: dict, rows: np.ndarray) -> dict | None:
        ts = p["ts_ns"][rows] + self.wire_ns(p["frame_len"][rows]) + self.latency
        nic = p["dst_nic"][rows].astype(np.int64)
        qpn = self.qp_src[p["_mi"][rows]].astype(np.int64)     # the data sender's QP
        sel = self._space(nic * (1 << 24) + qpn, ts)
        if not len(sel):
            return None
        r = rows[sel]
        n = len(r)
        fl = np.full(n, self.base + H.CNP.length, dtype=np.int64)
        return {
            "ts_ns": ts[sel], "src_nic": p["dst_nic"][r], "psn": np.zeros(n, np.int32),
            "opcode": np.full(n, OP_CNP, np.uint8), "ack_req": np.zeros(n, bool),
            "payload_len": np.zeros(n, np.int32), "pad": np.zeros(n, np.uint8),
            "frame_len": fl.astype(np.int32), "_kind": np.full(n, K_CNP, np.uint8),
            "_dep": np.full(n, -1, np.int64), "_ots": ts[sel],
            "_tmpl": np.full(n, -1, np.int32), "_mi": p["_mi"][r],
        }


_KIND_RANK = np.array([1, 0, 2, 3], dtype=np.int64)
_RANK_BOUNDS = (0, 4)
_PSN_BOUNDS = (0, PSN_MOD)
"""Tie order at one timestamp: an ACK leaves before data of the same instant (a responder
acknowledges what it received before it answers a later READ on that QP), then data, READ
requests, CNPs."""


def _pack(keys: tuple, spans: list, los: list) -> np.ndarray:
    """``keys`` (last primary) as one int64 that sorts like them: mixed radix ``spans``."""
    packed = None
    for k, span, lo in zip(reversed(keys), reversed(spans), reversed(los)):
        if packed is None:
            packed = k.astype(np.int64)                  # a copy: modified in place below
            if lo:
                packed -= lo
            continue
        packed *= np.int64(span)
        packed += k
        if lo:
            packed -= lo
    return packed


def _lexsort(keys: tuple, runs: bool = True, bounds: tuple | None = None) -> np.ndarray:
    """``np.lexsort(keys)`` (last key primary, ties in row order), faster when the keys' value
    ranges are small. ``runs``: the rows are mostly in order already, and one stable argsort
    (a merge sort, quick on sorted runs) of the keys packed into one int64 is used. Otherwise
    the keys and the row index are packed into one int64 and sorted by value (much faster than
    a stable argsort of shuffled rows); when all keys and the index do not fit in 63 bits, the
    keys but the first are packed with the index, and rows tied on them are sorted again by
    (first key, index). Every path gives ``np.lexsort``'s order. ``bounds``: per key, None or
    ``(low, span)`` known to hold all its values (saves a pass for its minimum and maximum)."""
    n = len(keys[0])
    if n < 2:
        return np.lexsort(keys)
    los, spans = [], []
    for i, k in enumerate(keys):
        b = bounds[i] if bounds is not None else None
        if b is None:
            lo = int(k.min())
            b = (lo, int(k.max()) - lo + 1)
        los.append(b[0])
        spans.append(b[1])
    if runs:
        total = 1
        for span in spans:
            total *= span
        if total <= 1 << 63:
            return np.argsort(_pack(keys, spans, los), kind="stable")
        if bounds is not None:                  # the known bounds are too wide: measure them
            return _lexsort(keys, runs)
        return np.lexsort(keys)
    ib = (n - 1).bit_length()                  # bits of the row index
    index = np.arange(n, dtype=np.int64)
    mask = np.int64((1 << ib) - 1)
    room = 1 << (63 - ib)
    major = 1
    for span in spans[1:]:
        major *= span
    if major * spans[0] <= room:                # every key and the index: one sort
        s = np.sort((_pack(keys, spans, los) << ib) | index)
        return s & mask
    if major <= room and (n * spans[0]) <= room:
        # the keys but the first with the index, then ties on them by (first key, index)
        s = np.sort((_pack(keys[1:], spans[1:], los[1:]) << ib) | index)
        o = s & mask
        key = s >> ib
        same = key[1:] == key[:-1]
        if not same.any():
            return o
        follows = np.r_[False, same]           # row has the same keys as the one before
        pos = np.flatnonzero(follows | np.r_[same, False])
        grp = np.cumsum(~follows[pos]) - 1
        minor = keys[0][o[pos]].astype(np.int64) - los[0]
        s2 = np.sort(((grp * np.int64(spans[0]) + minor) << ib) | o[pos])
        o[pos] = s2 & mask
        return o
    if major * spans[0] <= 1 << 63:
        return np.argsort(_pack(keys, spans, los), kind="stable")
    return np.lexsort(keys)


def _order(p: dict) -> np.ndarray:
    """Row order by time, ties broken by (kind rank, sender NIC, PSN) so that the output does not
    depend on how messages were cut into expansion steps."""
    return _lexsort((p["psn"], p["src_nic"], _KIND_RANK[p["_kind"]], p["ts_ns"]))


def _sorted(p: dict) -> dict:
    return _take(p, _order(p))


WINDOW_HOPS = 4
"""Frames are placed on the links in windows of this many hop latencies of first-ready time;
the result does not depend on it (answers inside a window are settled by repeated passes), the
run time does: 4 measured fastest on the sample plans."""


_WINDOW_COLS = ("ts_ns", "_ots", "_dep", "src_nic", "psn", "_kind", "frame_len")
"""The columns :meth:`_Links.schedule_windows` reads."""

WHOLE_RETRY = 16
"""Batches placed by the windowed method after the whole-batch method failed to settle, before
it is tried again (:meth:`_Links.try_whole`)."""

SEGMENT_LOOP = 64
SEGMENT_ROWS = 1024
"""Up to :data:`SEGMENT_LOOP` NICs in a batch of at least :data:`SEGMENT_ROWS` rows per NIC,
:meth:`_Links._run` takes each NIC's running maximum on its own (one call per NIC beats three
extra passes over the rows; not so for the small batches of the windowed method)."""


class _Links:
    """Each NIC's transmit link: frames from one NIC never overlap on the wire.

    A frame starts no earlier than it is ready (``ts_ns``) and than the previous frame from the
    same NIC has ended, that frame's duration being its on-wire size at the NIC rate (the frame
    plus preamble+SFD, FCS and inter-frame gap, IEEE 802.3 clause 4.4.2; IB start/end
    delimiters). Each NIC sends its frames first come, first served, in the order they were
    first ready (``_ots``; ties: ACKs first, then data, READ requests, CNPs; then PSN). A frame
    that answers another (``_dep``: an ACK its data packet, a READ response its request) starts no
    earlier than the other has arrived (its end + latency). Link time is kept in picoseconds so
    that back-to-back frames run at the line rate exactly; a frame's ``ts_ns`` is its start
    rounded up to the nanosecond. ``busy`` carries, per NIC, when its link is free again (ps)
    from one chunk to the next.
    """

    def __init__(self, n_nics: int, M: _Messages):
        self.busy = np.full(max(1, n_nics), np.iinfo(np.int64).min // 4, dtype=np.int64)
        self.wire_ns = M.wire_ns
        self.rate = M.rate
        self.wire_extra = M.wire_extra
        self.latency = np.int64(M.latency)
        self.skip_whole = 0             # batches left to send straight to the windowed method

    def wire_ps(self, frame_len: np.ndarray) -> np.ndarray:
        bits = (frame_len.astype(np.int64) + self.wire_extra) * 8
        return np.ceil(bits * (1e12 / self.rate)).astype(np.int64)

    def arrival_ns(self, ts_ns: np.ndarray, frame_len: np.ndarray) -> np.ndarray:
        """When a frame sent at ``ts_ns`` has arrived at its peer (last bit, then the latency)."""
        return ts_ns + self.wire_ns(frame_len) + self.latency

    def _run(self, nic: np.ndarray, ready: np.ndarray, dur: np.ndarray) -> np.ndarray:
        """Start times (ps) of frames sorted by NIC, then in the order each NIC serves them,
        ready at ``ready`` (ps), behind the links' current state. Closed form of the queue
        recursion ``start_i = max(ready_i, start_{i-1} + dur_{i-1})`` per NIC:
        ``start_i = C_i + max_{j<=i}(ready_j - C_j)`` with ``C`` the durations before ``i``."""
        first = np.empty(len(nic), dtype=bool)
        first[:1] = True
        np.not_equal(nic[1:], nic[:-1], out=first[1:])
        heads = np.flatnonzero(first)
        c = np.cumsum(dur)
        c -= dur                       # C over all rows: within a NIC's rows only differences count
        v = self._run_segments(ready - c, heads, self.busy[nic[heads]] - c[heads])
        v += c
        return v

    def _schedule_whole(self, p: dict, max_passes: int = 8, served: bool = False) -> bool:
        """Fast path of :meth:`schedule`: place the whole chunk at once and raise the ready time
        of every answer that would leave before what it answers has arrived, until none does.
        Ready times only grow, so this reaches the same least solution as the windowed method
        whenever it settles within ``max_passes`` passes; returns False (links untouched) when it
        does not. ``served``: the rows are already in serving order (:func:`_by_ready`), so
        grouping them by NIC is a stable radix sort of 16-bit NIC numbers."""
        n = len(p["ts_ns"])
        nic = p["src_nic"]
        if served and len(self.busy) <= 1 << 16:
            o = np.argsort(nic.astype(np.uint16), kind="stable")
        else:
            o = _lexsort((p["psn"], _KIND_RANK[p["_kind"]], p["_ots"], nic), runs=False)
        nic_s = nic[o]
        fl_s = p["frame_len"][o]
        r = p["ts_ns"][o].astype(np.int64, copy=False)
        at = np.empty(n, dtype=np.int64)
        at[o] = np.arange(n)
        dep_o = p["_dep"][o]
        has = np.flatnonzero(dep_o >= 0)
        st = self.settle(nic_s, fl_s, r, has, at[dep_o[has]], max_passes)
        if st is None:
            return False
        ts = np.empty(n, dtype=np.int64)
        ts[o] = -(-st // 1000)
        p["ts_ns"] = ts
        return True

    def settle(self, nic_s: np.ndarray, fl_s: np.ndarray, ready: np.ndarray, has: np.ndarray,
               d: np.ndarray, max_passes: int = 8) -> np.ndarray | None:
        """Start times (ps) of frames grouped by NIC in serving order (``nic_s``, frame lengths
        ``fl_s``, ready times ``ready`` in ns, raised in place), where frame ``has[i]`` answers
        frame ``d[i]`` and starts no earlier than its arrival: passes repeat until no answer is
        early. Marks the links busy until the last frame of each NIC has left; None (links
        untouched) when ``max_passes`` passes do not settle."""
        dur_s = self.wire_ps(fl_s)
        for _ in range(max_passes):
            st = self._run(nic_s, ready * 1000, dur_s)
            if not len(has):
                break
            arrive = self.arrival_ns(-(-st[d] // 1000), fl_s[d])
            late = arrive * 1000 > st[has]           # an answer starts at or after the arrival (ps)
            if not late.any():
                break
            ready[has[late]] = np.maximum(ready[has[late]], arrive[late])
        else:
            return None
        # each NIC's frames end in order: its last frame's end is when its link is free
        last = np.flatnonzero(np.r_[nic_s[1:] != nic_s[:-1], True])
        self.busy[nic_s[last]] = np.maximum(self.busy[nic_s[last]], st[last] + dur_s[last])
        return st

    def schedule(self, p: dict, served: bool = False) -> None:
        """Place the frames ``p`` (rows' ``_dep`` index ``p``) on their links, setting
        ``p["ts_ns"]`` to their start.

        A frame that answers another can only be placed once that one is. Frames are taken in
        windows of one hop latency by the time they were first ready: what a frame answers was
        first ready at least a hop earlier, so it lies in an earlier window and is final (within
        a window, passes repeat until every answer comes after its arrival). The result is the
        least solution of the queue equations, whatever the chunks and windows."""
        n = len(p["ts_ns"])
        if not n:
            return
        if self.try_whole():
            if self._schedule_whole(p, served=served):
                return
            self.skip_whole = WHOLE_RETRY
        self.schedule_windows(p, served=served)

    def try_whole(self) -> bool:
        """Whether to try the whole batch at once: not for the :data:`WHOLE_RETRY` batches after
        it failed to settle (a workload whose answers form long chains, e.g. a ring of ACK
        dependencies, fails batch after batch; both methods give the same starts)."""
        if self.skip_whole:
            self.skip_whole -= 1
            return False
        return True

    def schedule_windows(self, p: dict, served: bool = False) -> None:
        """:meth:`schedule` window by window (its general method, without first trying the
        whole chunk at once); ``served`` as for :meth:`_schedule_whole`. Everything that does not depend on an earlier window's starts (the
        serving order, each window's NIC runs, the duration prefix sums, which answers reach into
        an earlier window) is computed once for the whole chunk; the loop over windows only runs
        the queue recursion and the passes over its answers."""
        n = len(p["ts_ns"])
        if not n:
            return
        nic = p["src_nic"].astype(np.int64)
        ots = p["_ots"]
        dep = p["_dep"]
        if (dep >= 0).any():
            win = (ots - ots.min()) // (WINDOW_HOPS * max(int(self.latency), 1000))
        else:
            win = np.zeros(n, dtype=np.int64)
        nn = len(self.busy)
        if served and int(win[-1] - win[0] + 1) * nn <= 1 << 16:
            # rows in serving order already and windows follow the first-ready time: a stable
            # radix sort by (window, NIC) gives the same order as sorting all five keys
            o = np.argsort(((win - win[0]) * nn + nic).astype(np.uint16), kind="stable")
        else:
            o = np.lexsort((p["psn"], _KIND_RANK[p["_kind"]], ots, nic, win))
        nic_s, win_s = nic[o], win[o]
        fl_s = p["frame_len"][o]
        dur_s = self.wire_ps(fl_s)
        arr_s = self.wire_ns(fl_s) + self.latency          # arrival after the start, ns
        ready_s = p["ts_ns"][o].astype(np.int64)
        at = np.empty(n, dtype=np.int64)
        at[o] = np.arange(n)
        dep_o = dep[o]
        dep_s = np.where(dep_o >= 0, at[np.maximum(dep_o, 0)], -1)
        # runs of one NIC within one window (the queue recursion's segments), their last rows
        new_win = np.r_[True, win_s[1:] != win_s[:-1]]
        first = new_win | np.r_[True, nic_s[1:] != nic_s[:-1]]
        heads = np.flatnonzero(first)
        tails = np.r_[heads[1:], n] - 1
        seg = np.cumsum(first) - 1
        c = np.cumsum(dur_s)
        c -= dur_s                                          # durations before each row (ps)
        bounds = np.r_[np.flatnonzero(new_win), n]
        hb = np.searchsorted(heads, bounds)
        # answers, by where what they answer lies: in an earlier window (final) or in their own
        has = dep_s >= 0
        same = np.zeros(n, dtype=bool)
        same[has] = win_s[dep_s[has]] == win_s[has]
        early = np.flatnonzero(has & ~same)
        inside = np.flatnonzero(same)
        eb = np.searchsorted(early, bounds)
        ib = np.searchsorted(inside, bounds)
        start_s = np.zeros(n, dtype=np.int64)
        busy = self.busy
        for w in range(len(bounds) - 1):                # one pass per window
            lo, hi = int(bounds[w]), int(bounds[w + 1])
            e = early[eb[w]:eb[w + 1]]
            if len(e):
                d = dep_s[e]
                ready_s[e] = np.maximum(ready_s[e], -(-start_s[d] // 1000) + arr_s[d])
            h = heads[hb[w]:hb[w + 1]]
            t = tails[hb[w]:hb[w + 1]]
            hn = nic_s[h]
            ins = inside[ib[w]:ib[w + 1]]
            d_in = dep_s[ins] - lo
            cw = c[lo:hi]
            while True:
                st = self._run_segments(ready_s[lo:hi] * 1000 - cw, h - lo, busy[hn] - c[h], seg[lo:hi])
                st += cw
                if not len(ins):
                    break
                arrive = -(-st[d_in] // 1000) + arr_s[d_in + lo]
                late = arrive * 1000 > st[ins - lo]
                if not late.any():
                    break
                li = ins[late]
                ready_s[li] = np.maximum(ready_s[li], arrive[late])
            start_s[lo:hi] = st
            busy[hn] = np.maximum(busy[hn], st[t - lo] + dur_s[t])
        ts = np.empty(n, dtype=np.int64)
        ts[o] = -(-start_s // 1000)
        p["ts_ns"] = ts

    @staticmethod
    def _run_segments(v: np.ndarray, h: np.ndarray, head_floor: np.ndarray,
                      seg: np.ndarray | None = None) -> np.ndarray:
        """Running maximum of ``v`` (modified and returned) within each segment (rows ``h[i]``
        to before ``h[i + 1]``, ``h[0] == 0``), each segment's first value first raised to
        ``head_floor``: :meth:`_run`'s ``max_{j<=i}(ready_j - C_j)`` behind the links' state.
        ``seg``: the rows' segment numbers (consecutive), when the caller has them."""
        v[h] = np.maximum(v[h], head_floor)
        if len(h) == 1:
            return np.maximum.accumulate(v, out=v)
        # segment by segment when they are few and long, else in one pass with each segment's
        # rows lifted above the previous segment's
        if len(h) <= SEGMENT_LOOP and len(v) >= SEGMENT_ROWS * len(h):
            lift = None
        else:
            lift = int(v.max()) - int(v.min()) + 1
        if lift is not None and lift * len(h) < (1 << 62):
            if seg is None:
                first = np.zeros(len(v), dtype=np.int64)
                first[h[1:]] = 1
                off = np.cumsum(first)
            else:
                off = seg - seg[0]
            off *= np.int64(lift)
            v += off
            np.maximum.accumulate(v, out=v)
            v -= off
            return v
        for lo, hi in zip(h.tolist(), h[1:].tolist() + [len(v)]):
            np.maximum.accumulate(v[lo:hi], out=v[lo:hi])
        return v

SINGLE_POOL = True
"""Runs without ECN marking use :func:`_packetize_unmarked` (the same packets as the general
loop below, which serves runs with marking, with fewer copies of the columns; measured 15 %
faster); False sends every run through the general loop."""

FIRST_STEP = 4096
"""Packets of the first expansion step (then doubling up to ``chunk_packets``)."""


def packetize(messages: dict, topo: Topology, plan: Plan, chunk_packets: int = 1 << 16
              ) -> Iterator[dict[str, np.ndarray]]:
    """Packets of the network messages, as time-ordered chunks of the packets table.

    Parameters
    ----------
    messages : messages-table columns (any order; nvlink rows are ignored). Timed
        (``t_start_ns``/``t_end_ns``); ``verb``/``qpn``/``udp_sport`` are assigned with
        :func:`~wiretrace.transport.assign_qps` when missing (``qpn`` < 0).
    topo : cluster (NIC rate for serialization, latency, addresses).
    plan : ``transport`` (kind, path MTU, verb, ACK policy, DSCP/ECN, ECN marking, initial PSN),
        ``collectives.qps_per_connection``, ``seed``.
    chunk_packets : about how many packets each expansion step produces: memory bound, and
        64 Ki keeps a step's columns in the CPU caches (17 % faster than 128 Ki, measured). The
        first steps are smaller (:data:`FIRST_STEP`, doubling) so that a writer downstream
        starts early; the packets do not depend on the step sizes.

    Yields
    ------
    :class:`PacketChunk`, a mapping of column -> ``(n,)`` array with the columns of
    ``schemas/packets.schema.json`` and :data:`TEMPLATE_COLUMN` (a hint for the renderer), some
    computed when first read; each chunk
    sorted by ``ts_ns`` and every chunk's first ``ts_ns`` >= the previous chunk's last.

    Raises
    ------
    WiretraceError : unknown verb, negative sizes, inconsistent ACK policy or ECN settings.
    """
    link = _str_col(messages["link"])
    net = np.nonzero(link == "network")[0]
    m = {k: np.asarray(v)[net] for k, v in messages.items()}
    if len(net) and (np.asarray(m["qpn"]) < 0).any():
        m = assign_qps(m, topo, plan)
    order = np.lexsort((m["msg_id"], m["t_start_ns"])) if len(net) else np.zeros(0, np.int64)
    m = {k: np.asarray(v)[order] for k, v in m.items()}
    M = _Messages(m, topo, plan)
    marker = _Marker(plan, topo, M)
    if M.n == 0:
        return

    links = _Links(topo.num_nics, M)
    # columns a frame carries until it is emitted (DSCP and ECN follow from its kind, see
    # _dscp_ecn; the sending QP is only read by marking), and once it is placed
    pool_cols = tuple(k for k in _DTYPES if k not in ("dscp", "ecn") + DERIVED)
    placed_cols = tuple(k for k in pool_cols if k not in ("_dep", "_ots"))
    # With ECN marking, CNPs join the links as they are made: frames are put on the links up to
    # cuts on a fixed grid of one hop latency, so a CNP (ready a hop after the packet it answers)
    # is never ready before a frame already placed, whatever the chunk size.
    grid = max(int(M.latency), 1000) if marker.on else None
    csum = np.cumsum(M.npk + 2)
    if grid is None and SINGLE_POOL:
        yield from _packetize_unmarked(M, links, csum, chunk_packets,
                                       tuple(k for k in pool_cols if k not in PAYLOAD),
                                       tuple(k for k in placed_cols if k not in PAYLOAD))
        return
    pending = _empty()      # frames not yet on their link, by the time they are first ready
    cnps = _empty()         # CNPs not yet on their link
    placed = _empty()       # frames placed on their link but not yet emitted
    ready_out: list[dict] = []  # emitted frames waiting to be yielded together
    n_ready = 0
    lo = 0
    step = min(chunk_packets, FIRST_STEP)
    while lo < M.n or len(pending["ts_ns"]) or len(cnps["ts_ns"]) or len(placed["ts_ns"]):
        boundary = None
        if lo < M.n:
            hi = _steps(M, csum, lo, step)
            pending = _by_ready(_expand(M, lo, hi, carry=pending, cols=pool_cols))
            # no later message makes a frame ready before the boundary; links only delay frames
            boundary = (M.t_start[hi] - M.lookback) if hi < M.n else None
            lo = hi
        while True:
            if grid is None:
                cut = boundary
            else:
                first = [int(x[k][0] if k == "_ots" else x[k].min()) for x, k in
                         ((pending, "_ots"), (cnps, "_ots"), (placed, "ts_ns")) if len(x["ts_ns"])]
                if not first:
                    break
                cut = (min(first) // grid + 1) * grid
                if boundary is not None and cut > boundary:
                    break
            # frames first ready before the cut: no frame made later can be served before them
            k = len(pending["ts_ns"]) if cut is None else int(np.searchsorted(pending["_ots"], cut, side="left"))
            c = len(cnps["ts_ns"]) if cut is None else int(np.searchsorted(cnps["_ots"], cut, side="left"))
            done, pending = _place(links, pending, k, _slice(cnps, 0, c))
            cnps = _slice(cnps, c, None)
            placed = _concat([placed, _take(done, slice(None), placed_cols)])
            # frames placed before the cut are final and no later frame can come before them
            o = _order(placed)
            n_out = len(o) if cut is None else int(np.searchsorted(placed["ts_ns"][o], cut, side="left"))
            out, placed = _take(placed, o[:n_out], placed_cols), _take(placed, o[n_out:])
            if len(out["ts_ns"]):
                out["dscp"], out["ecn"] = _dscp_ecn(M, out["_kind"])
                _derive(M, out)
                cnp = marker.mark(out) if marker.on else None
                if cnp is not None:
                    # CNPs answer packets of this batch; they queue on the receiver's link
                    cnp["ts_ns"] = np.maximum(cnp["ts_ns"], cut)
                    cnp["_ots"] = cnp["ts_ns"].copy()
                    cnps = _by_ready(_concat([cnps, cnp]))
                ready_out.append({k: out[k] for k in YIELDED_COLUMNS})
                n_ready += len(out["ts_ns"])
                if n_ready >= step:                 # yield chunks of a useful size
                    yield _join_chunks(ready_out, M)
                    ready_out, n_ready = [], 0
                    step = min(chunk_packets, 2 * step)
            if grid is None:
                break
    if ready_out:
        yield _join_chunks(ready_out, M)


def _steps(M: _Messages, csum: np.ndarray, lo: int, step: int) -> int:
    """End of the expansion step that starts at message ``lo`` and holds about ``step``
    packets; messages starting at the same ns go together, so that the step's boundary (the
    next message's start) is strict."""
    base = csum[lo - 1] if lo else 0
    hi = max(int(np.searchsorted(csum, base + step, side="right")), lo + 1)
    if hi < M.n:
        hi = int(np.searchsorted(M.t_start, M.t_start[hi - 1], side="right"))
    return hi


def _packetize_unmarked(M: _Messages, links: _Links, csum: np.ndarray, chunk_packets: int,
                        pool_cols: tuple, placed_cols: tuple) -> Iterator[dict]:
    """:func:`packetize` without ECN marking: each step's frames stay in one pool (frames
    carried from earlier steps first, then the step's, see :func:`_expand`) and only index
    arrays and the few columns the orders read move until the emitted frames are taken once.

    A step places the frames first ready before its boundary (no later message makes one
    ready earlier) on their links, in each NIC's serving order (:func:`_by_ready`'s), and
    emits the placed frames that start before the boundary, in time order (:func:`_order`'s);
    placed frames that start later and frames not yet placed carry over, in those orders."""
    carry = _empty()
    n_on = 0                    # carry's first n_on rows are on their links already
    nic_bounds = (0, max(1, len(links.busy)))
    ready_out: list[dict] = []
    n_ready = 0
    lo = 0
    step = min(chunk_packets, FIRST_STEP)
    while lo < M.n or len(carry["ts_ns"]):
        cut = None
        if lo < M.n:
            hi = _steps(M, csum, lo, step)
            pool = _expand(M, lo, hi, carry=carry, cols=pool_cols)
            # no later message makes a frame ready before the boundary; links only delay frames
            cut = (M.t_start[hi] - M.lookback) if hi < M.n else None
            lo = hi
        else:
            pool = carry
        n = len(pool["ts_ns"])
        # frames not on a link, in the order they were first ready (ties: kind rank, PSN, row)
        o1 = n_on + _lexsort((pool["psn"][n_on:], _KIND_RANK[pool["_kind"][n_on:]], pool["_ots"][n_on:]),
                             bounds=(_PSN_BOUNDS, _RANK_BOUNDS, None))
        k = len(o1) if cut is None else int(np.searchsorted(pool["_ots"][o1], cut, side="left"))
        now, wait = o1[:k], o1[k:]
        at = np.empty(n, dtype=np.int64)                   # placed pool row -> place in serving order
        on_link = np.zeros(n, dtype=bool)                  # pool row placed in this step
        if k:
            nic = pool["src_nic"][now]
            if len(links.busy) <= 1 << 16:
                srv = now[np.argsort(nic.astype(np.uint16), kind="stable")]
            else:
                srv = now[np.argsort(nic, kind="stable")]
            at[srv] = np.arange(k)
            on_link[srv] = True
            dep = pool["_dep"][srv]
            has = np.flatnonzero(dep >= 0)
            tried = links.try_whole()
            st = links.settle(pool["src_nic"][srv], pool["frame_len"][srv],
                              pool["ts_ns"][srv].astype(np.int64), has, at[dep[has]]) if tried else None
            if st is not None:
                pool["ts_ns"][srv] = -(-st // 1000)
            else:                                          # the windowed method
                if tried:
                    links.skip_whole = WHOLE_RETRY
                rank = np.full(n, -1, dtype=np.int64)
                rank[now] = np.arange(k)
                sub = _take(pool, now, _WINDOW_COLS)
                sub["_dep"] = np.where(sub["_dep"] >= 0, rank[np.maximum(sub["_dep"], 0)], -1)
                links.schedule_windows(sub, served=True)
                pool["ts_ns"][now] = sub["ts_ns"]
            # frames that stay and answer a placed frame leave no earlier than its arrival
            dw = pool["_dep"][wait]
            on = np.flatnonzero(dw >= 0)
            on = on[on_link[dw[on]]]
            if len(on):
                d = dw[on]
                arrive = links.arrival_ns(pool["ts_ns"][d], pool["frame_len"][d])
                pool["ts_ns"][wait[on]] = np.maximum(pool["ts_ns"][wait[on]], arrive)
        # frames on their links, in time order; those starting before the cut are final
        cand = np.concatenate([np.arange(n_on), now])
        o3 = cand[_lexsort((pool["psn"][cand], pool["src_nic"][cand], _KIND_RANK[pool["_kind"][cand]],
                            pool["ts_ns"][cand]), bounds=(_PSN_BOUNDS, nic_bounds, _RANK_BOUNDS, None))]
        n_out = len(o3) if cut is None else int(np.searchsorted(pool["ts_ns"][o3], cut, side="left"))
        if n_out:
            ready_out.append(_take(pool, o3[:n_out], placed_cols))
            n_ready += n_out
            if n_ready >= step:                 # yield chunks of a useful size
                yield _join_chunks(ready_out, M)
                ready_out, n_ready = [], 0
                step = min(chunk_packets, 2 * step)
        # carry: placed frames not emitted (time order), then frames not placed (ready order)
        keep = np.concatenate([o3[n_out:], wait])
        carry = _take(pool, keep)
        n_on = len(o3) - n_out
        dep = carry["_dep"]
        dep_ok = dep >= 0
        dep_ok[:n_on] = False
        dep_ok[dep_ok] &= ~on_link[dep[dep_ok]]             # answered frame not placed: it stays
        if dep_ok.any():
            pos = np.empty(n, dtype=np.int64)               # read only at rows that stay
            pos[keep] = np.arange(len(keep))
            carry["_dep"] = np.where(dep_ok, pos[np.maximum(dep, 0)], -1)
        else:
            carry["_dep"][:] = -1
    if ready_out:
        yield _join_chunks(ready_out, M)


def _dscp_ecn(M: _Messages, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DSCP and ECN columns of frames of kind ``kind``: the transport's for data, ACKs and READ
    requests, :data:`CNP_DSCP`/:data:`CNP_ECN` for CNPs (before any CE mark)."""
    cnp = kind == K_CNP
    dscp = np.full(len(kind), M.dscp, dtype=np.uint8)
    ecn = np.full(len(kind), M.ecn, dtype=np.uint8)
    if cnp.any():
        dscp[cnp], ecn[cnp] = CNP_DSCP, CNP_ECN
    return dscp, ecn


def _derive(M: _Messages, p: dict) -> None:
    """Add the :data:`DERIVED` columns to frames ``p`` from their message (``_mi``), kind, opcode
    and PSN: data packets go from the message's source NIC to its destination's QP; ACKs, READ
    requests and CNPs the other way, to the sending QP (CNPs from UDP source port 0); the RETH
    DMA length and ImmDt are the message's bytes; the AETH MSN is the message's, one less in a
    READ RESPONSE FIRST and in an ACK of a packet before the message's last."""
    mi = p["_mi"]
    kind = p["_kind"]
    op = p["opcode"]
    p["msg_id"] = M.msg_id[mi]
    p["dst_nic"] = M.dst32[mi]
    p["dest_qp"] = M.qp_dst32[mi]
    p["udp_sport"] = M.udp_sport[mi]
    back = np.flatnonzero(kind != K_DATA)
    if len(back):
        mb = mi[back]
        p["dst_nic"][back] = M.src32[mb]
        p["dest_qp"][back] = M.qp_src32[mb]
        p["udp_sport"][back] = np.where(kind[back] == K_CNP, 0, M.udp_sport[mb])
    n = len(mi)
    dma = np.full(n, -1, dtype=np.int64)
    r = np.flatnonzero(HAS_RETH[op])
    dma[r] = M.bytes[mi[r]]
    p["dma_len"] = dma
    imm = np.full(n, -1, dtype=np.int64)
    r = np.flatnonzero(HAS_IMM[op])
    imm[r] = M.bytes[mi[r]] & 0xFFFFFFFF
    p["imm"] = imm
    msn = np.full(n, -1, dtype=np.int32)
    r = np.flatnonzero(HAS_AETH[op])
    if len(r):
        mr = mi[r]
        last_psn = (M.psn0[mr] + M.npk[mr] - 1) % PSN_MOD
        before = (op[r] == OP_READ_RESPONSE_FIRST) | ((op[r] == OP_ACK) & (p["psn"][r] != last_psn))
        msn[r] = (M.msn[mr] - before) % PSN_MOD
    p["msn"] = msn


PAYLOAD = ("payload_len", "pad")
"""Columns the runs without ECN marking do not carry either (:func:`_payload_pad`)."""
LAZY = DERIVED + ("dscp", "ecn") + PAYLOAD
"""Columns a :class:`PacketChunk` computes when first read (each group when one of it is)."""

_POS_OF = np.full(256, 255, dtype=np.uint8)
for _v in range(OPCODE_TABLE.shape[0]):
    for _p in range(4):
        _POS_OF[OPCODE_TABLE[_v, _p]] = _p
"""Position in its message (FIRST, MIDDLE, LAST, ONLY) of each data opcode; 255 for others."""


def _payload_pad(M: _Messages, p: dict) -> None:
    """``payload_len`` and ``pad`` of frames ``p`` from their message and opcode: FIRST and
    MIDDLE packets carry the path MTU, LAST and ONLY the rest, padded to 4 bytes; ACKs, READ
    requests and CNPs none."""
    pos = _POS_OF[p["opcode"]]
    n = len(pos)
    payload = np.where(pos < 2, np.int32(M.mtu), np.int32(0))
    pad = np.zeros(n, dtype=np.uint8)
    r = np.flatnonzero((pos == _POS_LAST) | (pos == _POS_ONLY))
    if len(r):
        lp = M.last_pay[p["_mi"][r]]
        payload[r] = lp
        pad[r] = (-lp) & 3
    p["payload_len"], p["pad"] = payload, pad


class PacketChunk(Mapping):
    """One chunk of the packets table (:data:`YIELDED_COLUMNS`) as packetize yields it: the
    columns in :data:`LAZY` are computed from the frames' messages when first read, so that a
    capture writer, which reads few of them for most rows, does not pay for them.

    A read-only mapping of column name -> ``(n,)`` array (``dict(chunk)`` or ``chunk.items()``
    give every column); :meth:`take_rows` selects rows without computing what is not read."""

    __slots__ = ("_cols", "_M")

    def __init__(self, cols: dict, M: _Messages):
        self._cols = cols
        self._M = M

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in YIELDED_COLUMNS:
            raise KeyError(name)
        if name not in self._cols:
            self._fill(name)
        return self._cols[name]

    def __iter__(self):
        return iter(YIELDED_COLUMNS)

    def __len__(self) -> int:
        return len(YIELDED_COLUMNS)

    def __contains__(self, name) -> bool:
        return name in YIELDED_COLUMNS

    def _fill(self, name: str) -> None:
        c = self._cols
        if name in PAYLOAD:
            _payload_pad(self._M, c)
        elif name in ("dscp", "ecn"):
            c["dscp"], c["ecn"] = _dscp_ecn(self._M, c["_kind"])
        else:
            _derive(self._M, c)

    def take_rows(self, rows) -> "PacketChunk":
        """The rows ``rows`` (indices, a mask or a slice) as a chunk of their own."""
        return PacketChunk({k: v[rows] for k, v in self._cols.items()}, self._M)


def _join_chunks(parts: list[dict], M: _Messages) -> PacketChunk:
    return PacketChunk(_join(parts), M)


def _join(parts: list[dict]) -> dict:
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([q[k] for q in parts]) for k in parts[0]}


def _slice(cols: dict, lo: int, hi: int | None) -> dict:
    return {k: v[lo:hi] for k, v in cols.items()}


def _by_ready(pool: dict) -> dict:
    """``pool`` sorted by the time each frame was first ready (``_ots``), ties by kind rank and
    PSN (:data:`_KIND_RANK`, the order a NIC serves them in), ``_dep`` renumbered. A frame
    answers one first ready earlier, so it comes after it."""
    o = _lexsort((pool["psn"], _KIND_RANK[pool["_kind"]], pool["_ots"]))
    out = _take(pool, o)
    at = np.empty(len(o), dtype=np.int64)
    at[o] = np.arange(len(o))
    dep = out["_dep"]
    out["_dep"] = np.where(dep >= 0, at[np.maximum(dep, 0)], -1)
    return out


def _place(links: _Links, pool: dict, k: int, extra: dict) -> tuple[dict, dict]:
    """Put the first ``k`` frames of ``pool`` (sorted by :func:`_by_ready`) and the frames
    ``extra`` (answering none) on their links; the frames that stay and answer a placed frame
    get its arrival as their earliest time. Returns (placed frames, frames that stay)."""
    sub = _concat([_slice(pool, 0, k), extra])
    links.schedule(sub, served=len(extra["ts_ns"]) == 0)
    stay = _slice(pool, k, None)
    dep = stay["_dep"]
    on_link = np.flatnonzero((dep >= 0) & (dep < k))
    if len(on_link):
        d = dep[on_link]
        arrive = links.arrival_ns(sub["ts_ns"][d], sub["frame_len"][d])
        stay["ts_ns"] = stay["ts_ns"].copy()
        stay["ts_ns"][on_link] = np.maximum(stay["ts_ns"][on_link], arrive)
    stay["_dep"] = np.where(dep >= k, dep - k, -1)
    return sub, stay


__all__ = ["packetize", "PacketChunk", "PACKET_COLUMNS", "OPCODE_TABLE", "CREDIT_CODE", "ACK_SYNDROME"]
