"""Check a RoCEv2 / InfiniBand capture frame by frame and QP by QP.

:func:`validate_capture` streams any pcap, pcapng or ERF capture (ours or a real one) and checks:

==================  ==============================================================================
check               what is verified
==================  ==============================================================================
``capture``         the file ends on a record boundary (a cut last record is reported here);
                    something was checked: a capture without RoCE/IB frames, or whose frames
                    were all cut before the BTH, gets a "nothing checked" violation (frame 0)
``ipv4_checksum``   IPv4 header checksum (RFC 791 / RFC 1071)
``icrc``            invariant CRC with RoCEv2 or native-IB masking (IBTA vol. 1 7.8.1, A17.4.1;
                    with a GRH the whole LRH counts as ones, as in RoCEv2)
``vcrc``            variant CRC-16 of native IB frames (IBTA vol. 1 7.8.2)
``length``          IP, UDP and LRH lengths agree with each other and with the frame length;
                    opcodes without payload carry none; FIRST/MIDDLE payloads are one path MTU
                    (256..4096, IBTA 9.7.4.1.1) and equal within a QP
``pad``             PadCnt makes payload + pad a multiple of 4; 0 on FIRST/MIDDLE packets and on
                    packets without payload; the RETH DMA length implies the pad of the last
                    packet (IBTA 9.2.4, 9.7.4.1.1)
``opcode``          the opcode exists (IBTA table 38, RoCEv2 CNP 0x81)
``psn``             per QP and direction, each request PSN is the previous PSN plus the PSNs the
                    previous packet consumed, modulo 2^24; an RDMA READ request consumes one PSN
                    per response packet (IBTA 9.7.1, 9.7.4.1.4); responses never go backwards
                    and READ responses of one request are consecutive
``opcode_sequence`` per QP: FIRST -> MIDDLE* -> LAST of one operation, or ONLY (IBTA 9.8.3)
``reth_length``     the RETH DMA length equals the payload bytes of the WRITE message it opens
                    and of the READ responses it asks for (IBTA 9.3.3)
``ack_msn``         AETH syndrome is ACK, RNR NAK or a defined NAK; the MSN never goes back and
                    does not advance by more messages than PSNs; an ACK's MSN advances by the
                    number of request messages completed up to its PSN, when the requests it
                    answers can be told apart (same addresses swapped and UDP source port, or
                    the only QP between two IB ports) (IBTA 9.3.5, 9.7.5.1)
==================  ==============================================================================

Frames cut by the capture's snap length are checked as far as their bytes go (headers present
are read, ICRC/VCRC need the whole frame) and counted; frames cut before their BTH whose
captured headers say RoCE (UDP port 4791 as far as captured, an LRH) are counted apart
(``cut_before_bth``), neither checked nor counted as other traffic. Streams (a QP in one direction) are keyed
by source and destination address (LIDs for IB without GRH), destination QP and whether the
packets are requests or responses, so a capture's ACKs and READ responses are checked against
the requester's PSN space. UD packets and CNPs have no PSN sequence to check.

The hot parts (header parsing, checksums, ICRC/VCRC, per-QP pairwise comparisons) are column
operations over a batch; streams carry their last packet's state from one batch to the next, so
memory stays bounded for captures of any size.
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import WiretraceError
from ..io.capture import DEFAULT_MAX_FRAMES, Capture, FrameBatch
from . import headers as H
from . import icrc as C
from .parse import (KIND_IB, KIND_IB_GRH, KIND_ROCE_V4, KIND_ROCE_V6, ParseStats, format_address,
                    parse_frames)

CHECKS = ("capture", "ipv4_checksum", "icrc", "vcrc", "length", "pad", "opcode", "psn",
          "opcode_sequence", "reth_length", "ack_msn")
"""Names of the checks, in report order (stable keys of the JSON report)."""

PSN_MOD = 1 << 24
PSN_HALF = 1 << 23

# Position of an opcode in a message and its operation family, derived from headers.OPCODES.
POS_NONE, POS_FIRST, POS_MIDDLE, POS_LAST, POS_ONLY = 0, 1, 2, 3, 4
FAM_NONE, FAM_SEND, FAM_WRITE, FAM_READ_REQ, FAM_READ_RESP, FAM_ATOMIC, FAM_ACK = range(7)
_FAMILY_NAMES = {FAM_SEND: "SEND", FAM_WRITE: "RDMA WRITE", FAM_READ_REQ: "RDMA READ request",
                 FAM_READ_RESP: "RDMA READ response", FAM_ATOMIC: "atomic", FAM_ACK: "ACK"}
_POS_NAMES = {POS_FIRST: "FIRST", POS_MIDDLE: "MIDDLE", POS_LAST: "LAST", POS_ONLY: "ONLY"}


def _opcode_tables():
    pos = np.zeros(256, dtype=np.int8)
    fam = np.zeros(256, dtype=np.int8)
    response = np.zeros(256, dtype=bool)
    sequenced = np.zeros(256, dtype=bool)  # PSN sequence defined per connection (RC, UC, RD)
    for code, op in H.OPCODES.items():
        o = op.operation
        if op.transport == "CNP":
            continue
        sequenced[code] = op.transport in ("RC", "UC", "RD")
        if o.startswith("SEND"):
            fam[code] = FAM_SEND
        elif o.startswith("RDMA_WRITE"):
            fam[code] = FAM_WRITE
        elif o == "RDMA_READ_REQUEST":
            fam[code] = FAM_READ_REQ
        elif o.startswith("RDMA_READ_RESPONSE"):
            fam[code] = FAM_READ_RESP
        elif o in ("COMPARE_SWAP", "FETCH_ADD"):
            fam[code] = FAM_ATOMIC
        elif o in ("ACKNOWLEDGE", "ATOMIC_ACKNOWLEDGE"):
            fam[code] = FAM_ACK
        response[code] = fam[code] in (FAM_READ_RESP, FAM_ACK)
        for word, p in (("FIRST", POS_FIRST), ("MIDDLE", POS_MIDDLE), ("LAST", POS_LAST),
                        ("ONLY", POS_ONLY)):
            if word in o.split("_"):
                pos[code] = p
        if fam[code] in (FAM_READ_REQ, FAM_ATOMIC, FAM_ACK):
            pos[code] = POS_ONLY
    return pos, fam, response, sequenced


OP_POS, OP_FAMILY, OP_RESPONSE, OP_SEQUENCED = _opcode_tables()


_ACK_OPCODES = np.array([c for c, o in H.OPCODES.items() if o.operation == "ACKNOWLEDGE"])
_MAX_PENDING_ENDS = 1 << 16  # message ends kept per request stream while waiting for an ACK


def _opname(code: int) -> str:
    op = H.OPCODES.get(int(code))
    return op.name if op else f"opcode {int(code):#04x}"


@dataclass
class Violation:
    """One finding: 1-based ``frame`` number, destination ``qp`` (None when not per QP), the
    ``check`` name (see :data:`CHECKS`) and a one-line ``message``."""

    frame: int
    qp: int | None
    check: str
    message: str

    def as_dict(self) -> dict:
        return {"frame": self.frame, "qp": self.qp, "check": self.check, "message": self.message}


@dataclass
class Report:
    """Result of :func:`validate_capture`.

    Attributes
    ----------
    path : the capture.
    format : container format (``pcap``, ``pcap-ns``, ``pcapng``, ``erf``).
    frames, roce_frames, non_roce_frames : frame counts.
    cut_before_bth : frames the snap length cut before their BTH whose captured headers say
        RoCEv2 / IB (UDP port 4791 as far as captured, or an LRH): not checked, not "other".
    cut_before_link_header : frames the snap length cut inside their link-layer header
        (Ethernet, cooked, LRH): what they carry cannot be told; not checked, not "other".
    truncated : RoCE frames (or frames that may be) captured shorter than their wire length
        (snap length), including ``cut_before_bth`` and ``cut_before_link_header``.
    counts : violations per check (every check present, 0 when clean).
    checked : frames (or messages) each check examined.
    violations : the findings in frame order, at most ``max_violations`` of them (``counts``
        has the full numbers).
    streams : QP streams (QP and direction) seen.
    """

    path: str
    format: str = ""
    frames: int = 0
    roce_frames: int = 0
    non_roce_frames: int = 0
    cut_before_bth: int = 0
    cut_before_link_header: int = 0
    truncated: int = 0
    streams: int = 0
    counts: dict = field(default_factory=lambda: {c: 0 for c in CHECKS})
    checked: dict = field(default_factory=lambda: {c: 0 for c in CHECKS})
    violations: list = field(default_factory=list)
    max_violations: int = 1000

    @property
    def ok(self) -> bool:
        return not any(self.counts.values())

    @property
    def total_violations(self) -> int:
        return sum(self.counts.values())

    @property
    def nothing_checked(self) -> bool:
        """No RoCE/IB frame reached its BTH: there is none, or the snap length cut every one
        before it. The headers such cut frames keep (an IPv4 header, UDP, an LRH) are still
        checked as far as they go, but nothing of the transport is, so the capture is not clean
        (whether the link layer is Ethernet, IPv4 or IPv6, or native IB)."""
        return self.roce_frames == 0

    def add(self, frames, qps, check: str, messages) -> None:
        """Record violations of ``check`` for the given frames (arrays or lists, same length);
        ``messages`` may be a generator: only the messages kept are formatted."""
        frames = list(frames)
        self.counts[check] += len(frames)
        room = max(self.max_violations - len(self.violations), 0)
        for f, q, m in itertools.islice(zip(frames, qps, messages), room):
            self.violations.append(Violation(int(f), None if q is None or q < 0 else int(q),
                                             check, m))

    def as_dict(self) -> dict:
        """The report under stable keys (the ``--json`` output)."""
        return {
            "file": self.path,
            "format": self.format,
            "frames": self.frames,
            "roce_frames": self.roce_frames,
            "non_roce_frames": self.non_roce_frames,
            "cut_before_bth": self.cut_before_bth,
            "cut_before_link_header": self.cut_before_link_header,
            "truncated": self.truncated,
            "streams": self.streams,
            "ok": self.ok,
            "nothing_checked": self.nothing_checked,
            "counts": dict(self.counts),
            "checked": dict(self.checked),
            "violations_total": self.total_violations,
            "violations_truncated": len(self.violations) < self.total_violations,
            "violations": [v.as_dict() for v in sorted(self.violations,
                                                       key=lambda v: (v.frame, v.check))],
        }


# ----------------------------------------------------------------------------------------------
# Frame-level checks (vectorized over a batch)
# ----------------------------------------------------------------------------------------------

def _gather(batch: FrameBatch, rows: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``(len(rows), max(length))`` uint8: bytes ``start..start+length`` of each frame, zero-padded."""
    width = int(length.max()) if len(length) else 0
    cols = np.arange(width, dtype=np.int64)
    idx = batch.offsets[rows][:, None] + start[:, None] + cols[None, :]
    inside = cols[None, :] < length[:, None]
    np.minimum(idx, max(len(batch.data) - 1, 0), out=idx)
    return np.where(inside, batch.data[idx], 0).astype(np.uint8)


def _chunks(lengths: np.ndarray, budget: int = 8 << 20):
    """Index chunks of rows of similar length (within 1/8 of each other) whose padded 2-D
    gather (rows x widest row) stays within ``budget`` bytes."""
    if not len(lengths):
        return
    order = np.argsort(lengths, kind="stable")
    srt = lengths[order]
    i = 0
    while i < len(order):
        limit = int(srt[i]) + int(srt[i]) // 8 + 64
        j = int(np.searchsorted(srt, limit, side="right"))
        j = min(j, i + max(1, budget // max(int(srt[j - 1]), 1)))
        yield order[i:j]
        i = j


def _frame_windows(data_padded: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``(len(starts), width)`` uint8 copies of ``data_padded[start:start + width]``.

    ``data_padded`` must extend at least ``width`` bytes past the last start; bytes past a
    frame's end belong to the next frame (callers pass lengths to the CRC functions).
    """
    view = np.lib.stride_tricks.sliding_window_view(data_padded, width)
    return view[starts]


def _check_ipv4(batch, cols, rep: Report) -> None:
    sel = np.nonzero((cols["kind"] == KIND_ROCE_V4)
                     & (cols["caplen"] >= cols["l3_offset"] + 20))[0]
    if not len(sel):
        return
    hlen = (cols["bth_offset"][sel] - H.UDP.length - cols["l3_offset"][sel]).astype(np.int64)
    got = cols["caplen"][sel] >= cols["l3_offset"][sel] + hlen
    sel, hlen = sel[got], hlen[got]
    rows = _gather(batch, cols["row"][sel], cols["l3_offset"][sel].astype(np.int64), hlen)
    if rows.shape[1] % 2:
        rows = np.pad(rows, ((0, 0), (0, 1)))
    words = rows.view(">u2").astype(np.uint32)
    s = words.sum(axis=1)
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    bad = s != 0xFFFF
    rep.checked["ipv4_checksum"] += len(sel)
    if bad.any():
        b = sel[bad]
        hdr20 = rows[bad][:, :20]
        want = H.ipv4_checksum(hdr20) if hlen[bad].max() == 20 else None
        msgs = []
        for i, j in enumerate(b):
            stored = int(cols["ip_checksum"][j])
            if want is not None:
                msgs.append(f"IPv4 header checksum {stored:#06x}, expected {int(want[i]):#06x}")
            else:
                msgs.append(f"IPv4 header checksum {stored:#06x} is wrong")
        rep.add(cols["frame"][b], cols["dest_qp"][b], "ipv4_checksum", msgs)


def _check_crcs(batch, cols, rep: Report) -> None:
    complete = cols["complete"] & cols["has_bth"]
    if not complete.any():
        return
    longest = int((cols["ip_len"][complete].astype(np.int64) + H.VCRC_LEN).max())
    data = np.concatenate([batch.data, np.zeros(longest + 1, dtype=np.uint8)])
    for kind in (KIND_ROCE_V4, KIND_ROCE_V6, KIND_IB, KIND_IB_GRH):
        sel = complete & (cols["kind"] == kind)
        if kind == KIND_ROCE_V4:  # RoCEv2 carries no IP options; the ICRC mask assumes none
            sel &= cols["bth_offset"] - cols["l3_offset"] == H.IPV4.length + H.UDP.length
        sel = np.nonzero(sel)[0]
        if not len(sel):
            continue
        start = batch.offsets[cols["row"][sel]] + cols["l3_offset"][sel].astype(np.int64)
        covered = cols["ip_len"][sel].astype(np.int64) - H.ICRC_LEN  # through the pad
        ib = kind in (KIND_IB, KIND_IB_GRH)
        tail = H.ICRC_LEN + (H.VCRC_LEN if ib else 0)
        rep.checked["icrc"] += len(sel)
        if ib:
            rep.checked["vcrc"] += len(sel)
        for chunk in _chunks(covered + tail):
            s = sel[chunk]
            cov = covered[chunk]
            rows = _frame_windows(data, start[chunk], int(cov.max()) + tail)
            r = np.arange(len(s))[:, None]
            stored = rows[r, cov[:, None] + np.arange(4)].astype(np.uint32)
            stored = stored[:, 0] | stored[:, 1] << 8 | stored[:, 2] << 16 | stored[:, 3] << 24
            if ib:  # with a GRH, the whole LRH counts as ones (icrc.mask_ib)
                want = C.icrc_ib(rows, kind == KIND_IB_GRH, cov)
            else:
                want = C.icrc_rocev2(rows, 4 if kind == KIND_ROCE_V4 else 6, cov)
            bad = stored != want
            if bad.any():
                b = s[bad]
                rep.add(cols["frame"][b], cols["dest_qp"][b], "icrc",
                        (f"ICRC {int(g):#010x} (wire bytes {int(g).to_bytes(4, 'little').hex(' ')}), "
                         f"expected {int(w):#010x} (wire bytes {int(w).to_bytes(4, 'little').hex(' ')})"
                         for g, w in zip(stored[bad], want[bad])))
            if ib:
                vend = cov + H.ICRC_LEN
                vb = rows[r, vend[:, None] + np.arange(2)]
                vstored = np.ascontiguousarray(vb).view(C.VCRC_BYTE_ORDER + "u2").reshape(-1)
                vwant = C.vcrc(rows, vend)
                bad = vstored != vwant
                if bad.any():
                    b = s[bad]
                    rep.add(cols["frame"][b], cols["dest_qp"][b], "vcrc",
                            (f"VCRC {int(g):#06x}, expected {int(w):#06x}"
                             for g, w in zip(vstored[bad], vwant[bad])))


def _check_lengths(batch, cols, rep: Report) -> None:
    kind = cols["kind"]
    roce = kind <= KIND_ROCE_V6
    has = cols["has_bth"]
    frame, qp = cols["frame"], cols["dest_qp"]
    rep.checked["length"] += len(frame)
    problems: list[tuple[np.ndarray, list[str]]] = []

    # UDP length against the IP length
    ip_hdr = np.where(kind == KIND_ROCE_V4,
                      cols["bth_offset"] - H.UDP.length - cols["l3_offset"], H.IPV6.length)
    bad = np.nonzero(roce & (cols["udp_len"] >= 0) & (cols["ip_len"] - ip_hdr != cols["udp_len"]))[0]
    problems.append((bad, (f"UDP length {int(cols['udp_len'][i])} but the IP header leaves "
                           f"{int(cols['ip_len'][i] - ip_hdr[i])} bytes" for i in bad)))
    # frame length on the wire against the headers (Ethernet may add an FCS or minimum padding)
    lt_eth = np.asarray(batch.linktype)[cols["row"]] == 1
    flen, orig = cols["frame_len"].astype(np.int64), cols["origlen"].astype(np.int64)
    ok_eth = (orig == flen) | (orig == flen + 4) | ((flen < 60) & ((orig == 60) | (orig == 64)))
    ok = np.where(roce, ~lt_eth | ok_eth, orig == flen)
    bad = np.nonzero(~ok & (flen >= 0))[0]
    problems.append((bad, (f"frame is {int(orig[i])} bytes on the wire, its headers say "
                           f"{int(flen[i])}" for i in bad)))
    # IB: the GRH PayLen counts the bytes after the GRH through the ICRC (IBTA 8.3.3)
    grh = kind == KIND_IB_GRH
    want = cols["lrh_pktlen"].astype(np.int64) * 4 - H.LRH.length - H.GRH.length
    bad = np.nonzero(grh & (cols["grh_paylen"] != want))[0]
    problems.append((bad, (f"GRH PayLen {int(cols['grh_paylen'][i])} but the LRH PktLen leaves "
                           f"{int(want[i])} bytes after the GRH" for i in bad)))
    op = cols["opcode"].astype(np.int64)
    pl = cols["payload_len"].astype(np.int64)
    bad = np.nonzero(has & (pl < 0))[0]
    problems.append((bad, (f"{_opname(op[i])}: lengths leave {int(pl[i])} bytes of payload"
                           for i in bad)))
    no_payload = has & H.KNOWN_OPCODE[op] & ~H.HAS_PAYLOAD[op] & (pl > 0)
    bad = np.nonzero(no_payload)[0]
    problems.append((bad, (f"{_opname(op[i])} carries {int(pl[i])} payload bytes, expected none"
                           for i in bad)))
    # FIRST/MIDDLE carry exactly one path MTU
    fm = has & np.isin(OP_POS[op], (POS_FIRST, POS_MIDDLE)) & H.KNOWN_OPCODE[op] & (pl >= 0)
    bad = np.nonzero(fm & ~np.isin(pl, H.PMTU_VALUES))[0]
    problems.append((bad, (f"{_opname(op[i])} carries {int(pl[i])} bytes; FIRST and MIDDLE "
                           f"packets carry one path MTU ({'/'.join(map(str, H.PMTU_VALUES))})"
                           for i in bad)))
    for bad, msgs in problems:
        if len(bad):
            rep.add(frame[bad], qp[bad], "length", msgs)


def _check_pad_opcode(cols, rep: Report) -> None:
    has = cols["has_bth"]
    op = cols["opcode"].astype(np.int64)
    pad = cols["pad"].astype(np.int64)
    pl = cols["payload_len"].astype(np.int64)
    frame, qp = cols["frame"], cols["dest_qp"]
    rep.checked["opcode"] += int(has.sum())
    bad = np.nonzero(has & ~H.KNOWN_OPCODE[op])[0]
    if len(bad):
        rep.add(frame[bad], qp[bad], "opcode",
                [f"unknown BTH opcode {int(op[i]):#04x}" for i in bad])
    known = has & H.KNOWN_OPCODE[op] & (pl >= 0)
    rep.checked["pad"] += int(known.sum())
    msgs, rows = [], []
    for i in np.nonzero(known & ((pl + pad) % 4 != 0))[0]:
        rows.append(i)
        msgs.append(f"pad count {int(pad[i])} leaves {int(pl[i] + pad[i])} bytes of payload and "
                    "pad, not a multiple of 4")
    for i in np.nonzero(known & (pad != 0) & (np.isin(OP_POS[op], (POS_FIRST, POS_MIDDLE))
                                               | ~H.HAS_PAYLOAD[op]))[0]:
        rows.append(i)
        msgs.append(f"pad count {int(pad[i])} on {_opname(op[i])}, expected 0")
    if rows:
        rows = np.array(rows)
        rep.add(frame[rows], qp[rows], "pad", msgs)


# ----------------------------------------------------------------------------------------------
# Stream-level checks (per QP and direction, state carried across batches)
# ----------------------------------------------------------------------------------------------

@dataclass
class _Stream:
    """State of one QP stream after its last packet."""

    qp: int
    next_psn: int = -1           # expected PSN of the next request (-1 unknown)
    next_psn_hi: int = -1        # READ with unknown path MTU: last acceptable next PSN
    pos: int = POS_NONE          # position of the last packet in its message
    fam: int = FAM_NONE
    msg_sum: int = 0             # payload bytes of the open message so far
    msg_dma: int = -1            # RETH DMA length of the open message (-1 none)
    msg_psn: int = -1            # PSN of the open message's first packet
    msg_frame: int = -1          # frame number of the open message's first packet (its RETH)
    last_psn: int = -1           # last PSN of a packet that is not an ACK
    last_frame: int = -1         # frame number of the stream's last packet
    n_pkts: int = 0              # packets of the stream seen so far
    last_msn: int = -1           # responses: last MSN
    last_ack_psn: int = -1
    # exact MSN accounting (see _StreamChecker._count_messages)
    src_ep: bytes = b""          # source address + LID
    dst_ep: bytes = b""
    sport: int = -1              # UDP source port (-1 for native IB)
    ends: list = field(default_factory=list)  # requests: unwrapped end PSNs not yet ACKed
    end_unw: int = -1            # requests: unwrapped PSN of the last message end
    acked: int = 0               # requests: messages counted by ACKs so far
    ends_lost: bool = False      # requests: ``ends`` overflowed, the count restarts
    partner: int = -1            # responses: request stream they acknowledge (-1 unknown)
    msn_alt: int = -1            # responses: MSN offset of the last ACK that disagreed
    msn_offset: int = -1         # responses: MSN minus messages counted (-1 not yet known)


class _StreamChecker:
    """PSN, opcode-sequence, RETH and MSN checks with per-stream state."""

    def __init__(self, rep: Report):
        self.rep = rep
        self.ids: dict[bytes, int] = {}
        self.streams: list[_Stream] = []
        self.pmtu = 0                         # path MTU seen (largest FIRST/MIDDLE payload)
        # READ requests awaiting their responses: (requester, responder, psn) -> [(sport, dma, frame)]
        self.reads: dict[tuple, list] = {}
        self.n_reads = 0
        # request streams by (source, destination, UDP source port): pairs ACK streams with the
        # requests they acknowledge (RoCEv2 NICs use one UDP source port for both directions
        # of a connection, hashed from the two QPNs as Linux rdma_calc_flow_label does)
        self.requests_by_pair: dict[tuple, list] = {}
        self.flagged: set = set()  # frames of this batch with an MSN already reported

    def feed(self, cols) -> None:
        has = cols["has_bth"] & (cols["payload_len"] >= 0)
        op = cols["opcode"].astype(np.int64)
        use = np.nonzero(has & OP_SEQUENCED[op])[0]
        if not len(use):
            return
        op = op[use]
        pl = cols["payload_len"][use].astype(np.int64)
        fm = np.isin(OP_POS[op], (POS_FIRST, POS_MIDDLE))
        if fm.any():
            self.pmtu = max(self.pmtu, int(pl[fm].max()))
        resp = OP_RESPONSE[op]
        n = len(use)
        key = np.empty((n, 45), dtype=np.uint8)
        key[:, :16] = cols["src_addr"][use]
        key[:, 16:32] = cols["dst_addr"][use]
        key[:, 32:36] = cols["slid"][use].astype("<i4").view(np.uint8).reshape(-1, 4)
        key[:, 36:40] = cols["dlid"][use].astype("<i4").view(np.uint8).reshape(-1, 4)
        key[:, 40:44] = cols["dest_qp"][use].astype("<i4").view(np.uint8).reshape(-1, 4)
        key[:, 44] = resp
        void = np.ascontiguousarray(key).view(np.dtype((np.void, 45))).reshape(-1)
        uniq, first_at, inv = np.unique(void, return_index=True, return_inverse=True)
        gid_of_u = np.empty(len(uniq), dtype=np.int64)
        for u, kb in enumerate(uniq):
            kb = kb.tobytes()
            g = self.ids.get(kb)
            if g is None:
                g = self.ids[kb] = len(self.streams)
                row = use[first_at[u]]
                st = _Stream(qp=int(cols["dest_qp"][row]), sport=int(cols["udp_sport"][row]),
                             src_ep=key[first_at[u], :16].tobytes() + key[first_at[u], 32:36].tobytes(),
                             dst_ep=key[first_at[u], 16:32].tobytes() + key[first_at[u], 36:40].tobytes())
                self.streams.append(st)
                if not key[first_at[u], 44]:
                    self.requests_by_pair.setdefault((st.src_ep, st.dst_ep, st.sport), []).append(g)
            gid_of_u[u] = g
        gid = gid_of_u[inv.reshape(-1)]
        self.rep.streams = len(self.streams)
        # Requests go through the state machine per stream; responses likewise. The per-packet
        # comparisons are pairwise (previous packet of the same stream), so they run as column
        # operations over the stream-sorted batch; only the boundary state is kept per stream.
        order = np.lexsort((np.arange(n), gid))
        self._run(cols, use[order], gid[order], op[order], pl[order])

    def _run(self, cols, rows, gid, op, pl) -> None:
        rep = self.rep
        n = len(rows)
        psn = cols["psn"][rows].astype(np.int64)
        pad = cols["pad"][rows].astype(np.int64)
        dma = cols["dma_len"][rows].astype(np.int64)
        msn = cols["msn"][rows].astype(np.int64)
        syn = cols["aeth_syndrome"][rows].astype(np.int64)
        frame = cols["frame"][rows]
        qp = cols["dest_qp"][rows].astype(np.int64)
        pos = OP_POS[op].astype(np.int64)
        fam = OP_FAMILY[op].astype(np.int64)
        resp = OP_RESPONSE[op]
        first = np.ones(n, dtype=bool)
        first[1:] = gid[1:] != gid[:-1]
        last = np.ones(n, dtype=bool)
        last[:-1] = gid[1:] != gid[:-1]

        # previous packet of the same stream: the row before, or the carried state
        def prev(values, carried_attr):
            out = np.empty(n, dtype=np.int64)
            out[1:] = values[:-1]
            fi = np.nonzero(first)[0]
            out[fi] = [getattr(self.streams[g], carried_attr) for g in gid[fi]]
            return out

        # previous packet of the same stream among the rows of ``mask`` (others get ``fill``)
        def prev_among(mask, values, carried_attr, fill):
            out = np.full(n, fill, dtype=np.int64)
            sub = np.nonzero(mask)[0]
            if len(sub):
                g = gid[sub]
                head = np.ones(len(sub), dtype=bool)
                head[1:] = g[1:] != g[:-1]
                v = np.empty(len(sub), dtype=np.int64)
                v[1:] = values[sub][:-1]
                v[head] = [getattr(self.streams[x], carried_attr) for x in g[head]]
                out[sub] = v
            return out

        # PSNs consumed by each request packet: 1, or one per response for a READ request
        consumed_lo = np.ones(n, dtype=np.int64)
        consumed_hi = np.ones(n, dtype=np.int64)
        rd = (fam == FAM_READ_REQ) & (dma >= 0)
        if rd.any():
            if self.pmtu:
                c = np.maximum(1, -(-dma[rd] // self.pmtu))
                consumed_lo[rd] = consumed_hi[rd] = c
            else:
                consumed_lo[rd] = np.maximum(1, -(-dma[rd] // 4096))
                consumed_hi[rd] = np.maximum(1, -(-dma[rd] // 256))
        nxt = (psn + consumed_lo) % PSN_MOD
        nxt_hi = (psn + consumed_hi) % PSN_MOD
        # a READ request cut before its DMA length: how many PSNs it consumed is unknown, so the
        # request after it on the stream is not checked
        unknown = (fam == FAM_READ_REQ) & (dma < 0)
        nxt[unknown] = -1
        nxt_hi[unknown] = -1
        exp_lo = prev(nxt, "next_psn")
        exp_hi = prev(nxt_hi, "next_psn_hi")
        req = ~resp

        # -- PSN continuity of requests --------------------------------------------------------
        # packets of the stream before each row (the one after the stream's first packet may
        # be blamed for a wrong PSN of that first packet: the message says so)
        idx = np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0))
        grp = np.cumsum(first) - 1
        before = np.array([self.streams[g].n_pkts for g in gid[first]], dtype=np.int64)[grp] + idx
        prev_frame = prev(frame.astype(np.int64), "last_frame")
        known = req & (exp_lo >= 0)
        rep.checked["psn"] += int(req.sum())
        span = (exp_hi - exp_lo) % PSN_MOD
        off = (psn - exp_lo) % PSN_MOD
        bad = np.nonzero(known & (off > span))[0]
        if len(bad):
            def psn_messages():
                for i in bad:
                    e = int(exp_lo[i])
                    d = (int(psn[i]) - e) % PSN_MOD
                    if d >= PSN_HALF:
                        text = (f"PSN {int(psn[i])} goes back {PSN_MOD - d} from expected {e} "
                                "(retransmission or reordering)")
                    else:
                        text = (f"PSN gap: expected {e}" + (f"..{int(exp_hi[i])}" if span[i] else "")
                                + f", got {int(psn[i])} ({d} PSN(s) missing)")
                    if before[i] == 1:
                        text += (f"; or frame {int(prev_frame[i])}, the first packet of this QP in the "
                                 "capture, carries a wrong PSN")
                    yield text
            rep.add(frame[bad], qp[bad], "psn", psn_messages())

        # -- opcode sequences (requests and READ responses) -------------------------------------
        # an ACK takes no part in the message structure: look through ACKs for the previous
        # packet of a READ response
        ack = fam == FAM_ACK
        ppos = prev_among(~ack, pos, "pos", POS_NONE)
        pfam = prev_among(~ack, fam, "fam", FAM_NONE)
        seq = pos > 0
        rep.checked["opcode_sequence"] += int(seq.sum())
        open_before = np.isin(ppos, (POS_FIRST, POS_MIDDLE))
        continues = np.isin(pos, (POS_MIDDLE, POS_LAST))
        bad_start = seq & ~ack & ~continues & open_before
        bad_cont = seq & continues & (ppos != POS_NONE) & ~open_before
        bad_mix = seq & continues & open_before & (pfam != fam)
        msgs, rows_bad = [], []
        for i in np.nonzero(bad_start)[0]:
            rows_bad.append(i)
            msgs.append(f"{_opname(op[i])} while a {_FAMILY_NAMES.get(int(pfam[i]), '?')} "
                        f"message is open (expected MIDDLE or LAST)")
        for i in np.nonzero(bad_cont)[0]:
            rows_bad.append(i)
            msgs.append(f"{_opname(op[i])} without a FIRST (previous packet was "
                        f"{_POS_NAMES.get(int(ppos[i]), '?')})")
        for i in np.nonzero(bad_mix)[0]:
            rows_bad.append(i)
            msgs.append(f"{_opname(op[i])} continues a {_FAMILY_NAMES.get(int(pfam[i]), '?')} "
                        "message")
        if rows_bad:
            rb = np.array(rows_bad)
            rep.add(frame[rb], qp[rb], "opcode_sequence", msgs)

        # -- message sums: RETH DMA length of WRITEs, READ responses -----------------------------
        starts = np.isin(pos, (POS_FIRST, POS_ONLY)) & ~ack
        # a MIDDLE/LAST without its FIRST (reported above) opens a segment of its own, of
        # unknown DMA length: its bytes are not added to the message that ended before it
        seg_start = starts | first | bad_cont
        seg = np.cumsum(seg_start) - 1
        cs = np.cumsum(pl * ~ack)
        seg_first = np.nonzero(seg_start)[0]
        base = cs[seg_first] - (pl * ~ack)[seg_first]
        upto = cs - base[seg]
        # segments continuing a message carried from the previous batch
        carried_sum = np.zeros(len(seg_first), dtype=np.int64)
        carried_dma = np.full(len(seg_first), -1, dtype=np.int64)
        carried_psn = np.full(len(seg_first), -1, dtype=np.int64)
        carried_frame = np.full(len(seg_first), -1, dtype=np.int64)
        for k in np.nonzero(~starts[seg_first] & ~bad_cont[seg_first])[0]:  # a stream's first rows
            st = self.streams[gid[seg_first[k]]]
            carried_sum[k], carried_dma[k], carried_psn[k] = st.msg_sum, st.msg_dma, st.msg_psn
            carried_frame[k] = st.msg_frame
        upto = upto + carried_sum[seg]
        seg_dma = np.where(starts[seg_first], dma[seg_first], carried_dma)[seg]
        seg_psn = np.where(starts[seg_first], psn[seg_first], carried_psn)[seg]
        seg_frame = np.where(starts[seg_first], frame[seg_first], carried_frame)[seg]
        ends = np.isin(pos, (POS_LAST, POS_ONLY)) & ~ack

        # endpoints (address + LID) of each packet, to pair READ responses with their request
        ep_src = np.concatenate([cols["src_addr"][rows],
                                 cols["slid"][rows].astype("<i4").view(np.uint8).reshape(-1, 4)], 1)
        ep_dst = np.concatenate([cols["dst_addr"][rows],
                                 cols["dlid"][rows].astype("<i4").view(np.uint8).reshape(-1, 4)], 1)

        # WRITE messages: payload bytes against the RETH of their FIRST/ONLY packet
        w = np.nonzero(ends & (fam == FAM_WRITE) & (seg_dma >= 0))[0]
        rep.checked["reth_length"] += len(w)
        self._compare_dma(w, upto, seg_dma, pad, frame, qp, "RDMA WRITE", seg_frame)

        # READ responses of one request: consecutive PSNs, bytes against the request's RETH
        # (requests are registered first: in a batch they precede their responses)
        # (see :meth:`_pop_read`: two QPs of one connection may both have a request at one PSN)
        for i in np.nonzero((fam == FAM_READ_REQ) & (dma >= 0))[0]:
            ends3 = (ep_src[i].tobytes(), ep_dst[i].tobytes(), int(psn[i]))
            self.reads.setdefault(ends3, []).append((self.streams[gid[i]].sport, int(dma[i]), int(frame[i])))
            self.n_reads += 1
        rr = fam == FAM_READ_RESP
        if rr.any():
            pr_psn = prev_among(~ack, psn, "last_psn", -1)
            cont = rr & np.isin(pos, (POS_MIDDLE, POS_LAST)) & (pr_psn >= 0) & open_before
            rep.checked["psn"] += int(cont.sum())
            bad = np.nonzero(cont & ((psn - pr_psn) % PSN_MOD != 1))[0]
            if len(bad):
                rep.add(frame[bad], qp[bad], "psn",
                        [f"READ response PSN {int(psn[i])} does not follow {int(pr_psn[i])}"
                         for i in bad])
            for i in np.nonzero(ends & rr)[0]:
                hit = self._pop_read((ep_dst[i].tobytes(), ep_src[i].tobytes(), int(seg_psn[i])),
                                     self.streams[gid[i]].sport, int(upto[i]))
                if hit is None:
                    continue
                rep.checked["reth_length"] += 1
                self._compare_dma(np.array([i]), upto, np.full(n, hit[1]), pad, frame, qp,
                                  "RDMA READ", np.full(n, hit[2]))
        if self.n_reads > 1_000_000:  # unanswered READs of a huge capture: keep the newest
            for k in list(self.reads)[:len(self.reads) // 2]:
                self.n_reads -= len(self.reads.pop(k))

        # -- ACK / MSN ---------------------------------------------------------------------------
        aeth = resp & (msn >= 0)
        rep.checked["ack_msn"] += int(aeth.sum())
        if aeth.any():
            code = syn >> 5
            low = syn & 0x1F
            bad_syn = aeth & ((code == 2) | ((code == 3) & (low > 4)))
            bad = np.nonzero(bad_syn)[0]
            if len(bad):
                rep.add(frame[bad], qp[bad], "ack_msn",
                        [f"AETH syndrome {int(syn[i]):#04x} is reserved" for i in bad])
            ai = np.nonzero(aeth)[0]
            # previous AETH of the same stream (through READ MIDDLE packets, which have none)
            a_gid = gid[ai]
            a_first = np.ones(len(ai), dtype=bool)
            a_first[1:] = a_gid[1:] != a_gid[:-1]
            pm = np.empty(len(ai), dtype=np.int64)
            pp = np.empty(len(ai), dtype=np.int64)
            pm[1:], pp[1:] = msn[ai][:-1], psn[ai][:-1]
            for k in np.nonzero(a_first)[0]:
                st = self.streams[a_gid[k]]
                pm[k], pp[k] = st.last_msn, st.last_ack_psn
            has_prev = pm >= 0
            dm = (msn[ai] - pm) % PSN_MOD
            dp = (psn[ai] - pp) % PSN_MOD
            back = has_prev & (dm >= PSN_HALF)
            psn_back = has_prev & ~back & (dp >= PSN_HALF)
            too_far = has_prev & ~back & ~psn_back & (dm > dp)
            msgs, rb = [], []
            for k in np.nonzero(back)[0]:
                rb.append(ai[k])
                msgs.append(f"MSN {int(msn[ai[k]])} goes back from {int(pm[k])}")
            for k in np.nonzero(psn_back)[0]:
                rb.append(ai[k])
                msgs.append(f"acknowledged PSN {int(psn[ai[k]])} goes back from {int(pp[k])}")
            for k in np.nonzero(too_far)[0]:
                rb.append(ai[k])
                msgs.append(f"MSN advances by {int(dm[k])} messages over {int(dp[k])} PSNs "
                            f"(from MSN {int(pm[k])} at PSN {int(pp[k])})")
            if rb:
                rb = np.array(rb)
                rep.add(frame[rb], qp[rb], "ack_msn", msgs)
                self.flagged = set(frame[rb].tolist())
            for k in np.nonzero(np.append(a_first[1:], True))[0]:
                st = self.streams[a_gid[k]]
                st.last_msn, st.last_ack_psn = int(msn[ai[k]]), int(psn[ai[k]])

        self._count_messages(cols, rows, gid, op, psn, pos, fam, req, consumed_lo, msn, syn,
                             frame, qp)
        self.flagged = set()

        # -- carry the state of each stream's last packet ---------------------------------------
        for i in np.nonzero(last)[0]:
            st = self.streams[gid[i]]
            st.last_frame = int(frame[i])
            st.n_pkts = int(before[i]) + 1
        for i in np.nonzero(last & req)[0]:
            st = self.streams[gid[i]]
            st.next_psn, st.next_psn_hi = int(nxt[i]), int(nxt_hi[i])
        # message state from each stream's last packet that takes part in messages (not an ACK)
        mi = np.nonzero(~ack)[0]
        if len(mi):
            m_last = np.ones(len(mi), dtype=bool)
            m_last[:-1] = gid[mi][1:] != gid[mi][:-1]
            for i in mi[m_last]:
                st = self.streams[gid[i]]
                st.pos, st.fam, st.last_psn = int(pos[i]), int(fam[i]), int(psn[i])
                if pos[i] in (POS_FIRST, POS_MIDDLE):
                    st.msg_sum, st.msg_dma, st.msg_psn = (int(upto[i]), int(seg_dma[i]),
                                                          int(seg_psn[i]))
                    st.msg_frame = int(seg_frame[i])
                else:
                    st.msg_sum, st.msg_dma, st.msg_psn, st.msg_frame = 0, -1, -1, -1

    def _pop_read(self, ends3: tuple, sport: int, got: int) -> tuple | None:
        """The READ request ``(sport, dma, frame)`` a response ending at ``ends3`` (requester,
        responder, first PSN) and carrying ``got`` bytes answers, taken off the waiting list:
        the only one at those endpoints and PSN; else the only one sent from the response's UDP
        source port (a RoCEv2 NIC sends a QP's requests and responses from one port); else the
        only one asking for ``got`` bytes (native IB, which has no port: the response then agrees
        with its request). None when none waits, or the candidates cannot be told apart (the
        response is not checked then)."""
        cands = self.reads.get(ends3)
        if not cands:
            return None
        pick = None
        if len(cands) == 1:
            pick = 0
        else:
            same = [k for k, c in enumerate(cands) if c[0] == sport]
            pool = same if same else range(len(cands))
            if len(same) == 1:
                pick = same[0]
            else:
                fits = [k for k in pool if cands[k][1] == got]
                if fits:
                    pick = fits[0]
        if pick is None:
            return None
        hit = cands.pop(pick)
        self.n_reads -= 1
        if not cands:
            del self.reads[ends3]
        return hit

    def _partner(self, g: int) -> _Stream | None:
        """The request stream an ACK stream answers, when exactly one candidate exists."""
        r = self.streams[g]
        if r.partner < 0:
            cands = self.requests_by_pair.get((r.dst_ep, r.src_ep, r.sport), [])
            if len(cands) != 1:
                return None
            r.partner = cands[0]
        return self.streams[r.partner]

    def _count_messages(self, cols, rows, gid, op, psn, pos, fam, req, consumed, msn, syn,
                        frame, qp) -> None:
        """Exact MSN check: an ACK's MSN minus the request messages completed up to its PSN is
        the same for every ACK of a connection (the responder counts each completed message,
        IBTA 9.7.5.1.1). Message ends are registered before the batch's ACKs are examined (an
        ACK follows what it acknowledges); ACK streams whose request stream cannot be told
        apart keep only the monotonic checks above."""
        ends = np.nonzero(req & np.isin(pos, (POS_LAST, POS_ONLY)))[0]
        for i in ends:
            st = self.streams[gid[i]]
            e = int((psn[i] + consumed[i] - 1) % PSN_MOD)
            if st.end_unw < 0:
                st.end_unw = e
            else:
                st.end_unw += (e - st.end_unw + PSN_HALF) % PSN_MOD - PSN_HALF
            st.ends.append(st.end_unw)
            if len(st.ends) > _MAX_PENDING_ENDS:  # nobody acknowledges this stream
                del st.ends[:len(st.ends) // 2]
                st.ends_lost = True
        acks = np.nonzero(~req & np.isin(op, _ACK_OPCODES) & (msn >= 0) & ((syn >> 5) == 0))[0]
        for i in acks:
            r = self.streams[gid[i]]
            s = self._partner(int(gid[i]))
            if s is None or s.end_unw < 0:
                continue
            if s.ends_lost:
                s.ends_lost = False
                r.msn_offset = -1
            p = s.end_unw + (int(psn[i]) - s.end_unw + PSN_HALF) % PSN_MOD - PSN_HALF
            k = bisect.bisect_right(s.ends, p)
            del s.ends[:k]
            s.acked += k
            offset = (int(msn[i]) - s.acked) % PSN_MOD
            if r.msn_offset < 0:
                r.msn_offset = offset
            elif offset == r.msn_offset:
                r.msn_alt = -1
            elif offset == r.msn_alt:
                # two ACKs in a row agree with each other, not with the count so far (which a
                # wrong first ACK, or a message the responder counted twice, set): they are the
                # count from here on, and the fault was reported once, at the first of them
                r.msn_offset, r.msn_alt = offset, -1
            else:
                if int(frame[i]) not in self.flagged:
                    want = (r.msn_offset + s.acked) % PSN_MOD
                    self.rep.add([frame[i]], [qp[i]], "ack_msn",
                                 [f"MSN {int(msn[i])} acknowledging PSN {int(psn[i])}, expected {want}"
                                  f" ({k} request message(s) completed since the previous ACK)"])
                r.msn_alt = offset

    def _compare_dma(self, idx, upto, seg_dma, pad, frame, qp, what: str, reth_frame) -> None:
        """Rows ``idx`` end a message: its bytes (``upto``) against the RETH DMA length
        (``seg_dma``) carried by frame ``reth_frame`` (named when it is another frame)."""
        if not len(idx):
            return
        got, want = upto[idx], seg_dma[idx]
        bad = got != want
        if not bad.any():
            return
        b = idx[bad]
        got, want = got[bad], want[bad]
        padded_same = (got + pad[b]) == (want + (-want & 3))
        pad_rows = b[padded_same]
        if len(pad_rows):
            self.rep.add(frame[pad_rows], qp[pad_rows], "pad",
                         [f"pad count {int(pad[i])} on the last packet of a {what} of "
                          f"{int(w)} bytes, expected {int(-w & 3)}"
                          for i, w in zip(pad_rows, want[padded_same])])
        len_rows = b[~padded_same]
        if len(len_rows):
            self.rep.add(frame[len_rows], qp[len_rows], "reth_length",
                         [f"RETH DMA length {int(w)}"
                          + (f" (frame {int(reth_frame[i])})" if 0 <= reth_frame[i] != frame[i] else "")
                          + f" but the {what} carries {int(g)} bytes"
                          for i, w, g in zip(len_rows, want[~padded_same], got[~padded_same])])


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------

def captures_in(directory: Path) -> list[Path]:
    """The capture files of a directory (``.pcap``, ``.pcapng``, ``.erf``, ``.cap``, and their
    rotations ``.pcap1`` ...), in rotation order: ``iter.pcap``, ``iter.pcap1``, ``iter.pcap2``,
    ..., ``iter.pcap10``.

    Raises
    ------
    WiretraceError : the directory holds no capture.
    """
    def rotation_order(p: Path):
        m = re.fullmatch(r"(.+?)(\d*)", p.name)
        return m.group(1), int(m.group(2) or -1)

    files = sorted((p for p in Path(directory).iterdir()
                    if p.is_file() and re.fullmatch(r".+\.(pcap|pcapng|erf|cap)\d*", p.name)),
                   key=rotation_order)
    if not files:
        raise WiretraceError(f"{directory}: a directory without captures (.pcap, .pcapng, .erf, .cap)")
    return files


def validate_capture(path: str | Path, max_violations: int = 1000,
                     batch_frames: int = DEFAULT_MAX_FRAMES, progress=None) -> Report:
    """Check every RoCEv2 / InfiniBand frame of a capture; see the module docstring.

    Parameters
    ----------
    path : pcap, pcapng or ERF file.
    max_violations : most violations kept with their messages (all are counted).
    batch_frames : frames read and checked per batch (memory bound; results do not depend on it).
    progress : optional callable ``progress(stage, done, total)`` called after each batch with
        the bytes of the file read so far and the file size.

    Returns
    -------
    Report

    Raises
    ------
    InputFormatError
        The file is not a capture, or a record in it is malformed (a cut last record is not an
        error: it becomes a ``capture`` violation).
    """
    rep = Report(path=str(path), max_violations=max_violations)
    stats = ParseStats()
    streams = _StreamChecker(rep)
    with Capture(path) as cap:
        rep.format = cap.format
        for batch in cap.batches(max_frames=batch_frames):
            cut: list[int] = []
            cols = parse_frames(batch, cut)
            stats.add(len(batch), cols, cut[0], batch)
            if len(cols["row"]):
                _check_ipv4(batch, cols, rep)
                _check_crcs(batch, cols, rep)
                _check_lengths(batch, cols, rep)
                _check_pad_opcode(cols, rep)
                streams.feed(cols)
            if progress is not None:
                progress("validate", cap.position, cap.size or None)
        rep.checked["capture"] = 1
        if cap.truncated is not None:
            t = cap.truncated
            rep.add([t.frame], [None], "capture",
                    [f"capture truncated: {t.describe()}"])
    rep.frames = stats.frames
    rep.roce_frames = stats.roce
    rep.non_roce_frames = stats.non_roce
    rep.cut_before_bth = stats.cut_roce
    rep.cut_before_link_header = stats.cut_unknown
    rep.truncated = stats.truncated
    if rep.nothing_checked:
        # a capture in which nothing could be checked is not clean
        whys = []
        if rep.cut_before_bth:
            whys.append(f"{rep.cut_before_bth} frame(s) cut by the snap length before the BTH, RoCE/IB as far "
                        f"as their captured headers go")
        if rep.cut_before_link_header:
            whys.append(f"{rep.cut_before_link_header} frame(s) cut by the snap length inside their "
                        f"link-layer header (cannot tell whether they are RoCEv2 / InfiniBand)")
        why = "; ".join(whys) or "no RoCEv2 / InfiniBand frame in it"
        rep.add([0], [None], "capture", [f"nothing checked: {why} ({rep.frames} frame(s) in the capture)"])
    return rep


__all__ = ["CHECKS", "Violation", "Report", "validate_capture", "print_report", "format_address"]


def print_report(rep: Report, show: int = 50, console=None) -> None:
    """Print a readable report (rich): totals, a table of checks, the first ``show`` violations."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if rep.nothing_checked:
        state = "[red]nothing checked[/red]"
    else:
        state = "[green]clean[/green]" if rep.ok else f"[red]{rep.total_violations} violation(s)[/red]"
    cut = (f"{rep.cut_before_bth} cut before the BTH (RoCE/IB as far as captured; not checked), "
           if rep.cut_before_bth else "")
    if rep.cut_before_link_header:
        cut += f"{rep.cut_before_link_header} cut inside the link-layer header (not checked), "
    console.print(f"[bold]{rep.path}[/bold] ({rep.format}): {rep.frames} frames, "
                  f"{rep.roce_frames} RoCE/IB, {cut}{rep.non_roce_frames} other, "
                  f"{rep.truncated} truncated by the snap length, {rep.streams} QP stream{'' if rep.streams == 1 else 's'}: {state}",
                  soft_wrap=True)
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("check")
    table.add_column("checked", justify="right")
    table.add_column("violations", justify="right")
    for c in CHECKS:
        n = rep.counts[c]
        table.add_row(c, str(rep.checked[c]), f"[red]{n}[/red]" if n else "0")
    console.print(table)
    if rep.violations and show:
        vt = Table(show_edge=False, pad_edge=False, title="violations")
        vt.add_column("frame", justify="right")
        vt.add_column("QP", justify="right")
        vt.add_column("check")
        vt.add_column("message", overflow="fold")
        ordered = sorted(rep.violations, key=lambda v: (v.frame, v.check))
        for v in ordered[:show]:
            vt.add_row(str(v.frame), "" if v.qp is None else f"{v.qp:#08x}", v.check, v.message)
        console.print(vt)
        hidden = rep.total_violations - min(show, len(ordered))
        if hidden > 0:
            console.print(f"... and {hidden} more (use --json for the list)")
