"""Packets table -> frame bytes: RoCEv2 (Ethernet [802.1Q] IPv4/IPv6 UDP) or native IB (LRH [GRH]).

Frames are written column by column into one ``(n, width)`` uint8 array of *slots* (one row per
frame, wide enough for the longest captured frame, optionally preceded by ``prefix`` bytes for
the capture format's record header), so that a capture writer can fill its record headers in the
same array and hand the rows to the kernel without another copy (:func:`slot_pieces`).

What goes on the wire (sources in brackets):

* Ethernet: the NICs' MACs from the topology; EtherType 0x0800/0x86DD, or 0x8100 and an 802.1Q
  tag with ``transport.pcp`` and ``transport.vlan`` (VLAN ID 0, priority-tagged, when only ``pcp``
  is set) [IEEE 802.1Q].
* IPv4: DSCP/ECN from the packets table, total length, identification = PSN mod 2^16
  (deterministic), DF set, TTL 64, protocol UDP, header checksum [RFC 791, RFC 1071]. IPv6:
  traffic class from DSCP/ECN, flow label 0, hop limit 64 [RFC 8200].
* UDP: source port from the table (one per QP; 0 for CNPs), destination 4791, length, checksum 0
  [IBTA annex A17.4].
* BTH: opcode, SE 0, MigReq 1 (0 in CNPs, as ConnectX sends them), PadCnt, TVer 0, P_Key 0xFFFF,
  BECN in CNPs, DestQP, AckReq, PSN [IBTA 9.2].
* RETH: VA ``0x7F00_0000_0000 + (msg_id mod 2^16) * 2^24``, R_Key ``0x100000 + dst NIC``, DMA
  length; ImmDt: the packets' ``imm`` column (the message size in bytes, as NCCL's
  ``ncclIbMultiSend`` posts it); AETH: ACK syndrome with credit count, MSN; CNP: 16 zero bytes
  [IBTA 9.3, annex A17.9.3].
* Payload: byte ``i`` of every packet's payload is ``i mod 256`` (deterministic, and constant per
  payload length so its CRC contribution is computed once); pad bytes 0; ICRC (and VCRC) over the
  result (:mod:`wiretrace.transport.icrc`).
* Native IB: LRH (VL 0, SL 0, LNH 2 or 3, DLID/SLID from the topology's LIDs, packet length in
  words), GRH when routed (traffic class 0, flow label 0, hop limit 64, GIDs from the topology).

A snap length keeps the first ``snaplen`` bytes of each frame (``caplen``); ``origlen`` stays the
frame length. Bytes past a frame's ``caplen`` are not computed. IPv4 RoCEv2 MIDDLE frames whose
ICRC is not captured are copied from one rendered frame per connection and patched in the four
fields that differ (:func:`_render_roce_templated`); a writer can send the payload from
:data:`PAYLOAD_PATTERN` instead of having it rendered (:func:`payload_spans`).
"""

from __future__ import annotations

import functools

import numpy as np

from ..plan import Plan
from ..topology import Topology
from . import headers as H
from . import icrc as C
from . import layout
from .packetize import ACK_SYNDROME, TEMPLATE_COLUMN

PAYLOAD_PATTERN = (np.arange(1 << 16) & 0xFF).astype(np.uint8)
"""Payload bytes: byte ``i`` of a packet's payload is ``i mod 256``."""
BLOCK_ROWS = 16384
"""Rows rendered per block: a block's columns fit in the CPU's L2 cache."""
RETH_VA_BASE = 0x7F0000000000
RKEY_BASE = 0x100000


def _col(packets, name, dtype=None):
    v = np.asarray(packets[name])
    return v if dtype is None else v.astype(dtype, copy=False)


def _be(v: np.ndarray, k: int) -> np.ndarray:
    return H._big_endian_bytes(v, k)


class _Frames:
    """Column views of the packets table with the quantities every layout needs (``dst``,
    ``payload``, ``pad`` and ``ext_len`` read when first used: a chunk may compute its columns
    on demand)."""

    def __init__(self, packets, topo: Topology, plan: Plan, snaplen: int):
        self.n = len(packets["ts_ns"])
        self._packets = packets
        # the packets table's own dtypes (int32 lengths and NIC indices): views, not copies
        self.opcode = _col(packets, "opcode", np.uint8)
        self.frame_len = _col(packets, "frame_len", np.int32)
        self.src = _col(packets, "src_nic", np.int32)
        self.caplen = self.frame_len if snaplen <= 0 else np.minimum(self.frame_len, np.int32(snaplen))

    @functools.cached_property
    def payload(self) -> np.ndarray:
        return _col(self._packets, "payload_len", np.int32)

    @functools.cached_property
    def pad(self) -> np.ndarray:
        return _col(self._packets, "pad", np.int32)

    @functools.cached_property
    def dst(self) -> np.ndarray:
        return _col(self._packets, "dst_nic", np.int32)

    def payload_pad(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``payload`` and ``pad`` of ``rows`` (``(k,)`` int32 each), without computing them for
        every row of a chunk that computes columns on demand."""
        if "payload" in self.__dict__ or not hasattr(self._packets, "take_rows"):
            return self.payload[rows], self.pad[rows]
        sub = take_rows(self._packets, rows)
        return _col(sub, "payload_len", np.int32), _col(sub, "pad", np.int32)

    @functools.cached_property
    def ext_len(self) -> np.ndarray:
        return H.EXT_LEN[self.opcode]


def take_rows(packets, rows) -> dict:
    """Rows ``rows`` (indices, a mask or a slice) of a packets table; a
    :class:`~wiretrace.transport.packetize.PacketChunk` computes only the columns then read."""
    take = getattr(packets, "take_rows", None)
    if take is not None:
        return take(rows)
    return {k: np.asarray(v)[rows] for k, v in packets.items()}


def render_slots(packets, topo: Topology, plan: Plan, snaplen: int = 128, prefix: int = 0,
                 out: np.ndarray | None = None, suffix: int = 0, payload: bool = True
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Render frames into rows of a slot array.

    Parameters
    ----------
    packets : packets-table columns (``schemas/packets.schema.json``), ``(n,)`` each.
    topo : addresses (MAC, IPv4, IPv6, LID) per NIC.
    plan : ``transport`` (kind, IP version, VLAN/PCP).
    snaplen : bytes kept per frame; 0 keeps whole frames.
    prefix : bytes reserved at the start of every row (left unwritten) for a record header.
    out : optional preallocated uint8 array of at least ``n * width`` bytes to reuse (its first
        ``n * width`` bytes are used).
    suffix : extra bytes per row after the longest captured frame (record trailers, padding).
    payload : False leaves the payload bytes of every row unwritten (headers, pad, ICRC/VCRC are
        written): for a writer that sends :data:`PAYLOAD_PATTERN` in their place, see
        :func:`payload_spans`.

    Returns
    -------
    slots : ``(n, width)`` uint8; row ``i`` holds the record prefix space, then ``caplen[i]``
        frame bytes; bytes after that are unspecified.
    caplen : ``(n,)`` int64 captured bytes per frame.
    origlen : ``(n,)`` int64 frame length on the wire (no FCS).
    """
    F = _Frames(packets, topo, plan, snaplen)
    n = F.n
    width = prefix + (int(F.caplen.max()) if n else 0) + suffix
    if out is not None and out.size >= n * width:
        slots = out.reshape(-1)[: n * width].reshape(n, width)
    else:
        slots = np.empty((n, width), dtype=np.uint8)
    if n == 0:
        return slots, F.caplen, F.frame_len
    v4_roce = plan.transport.kind != "ib" and plan.transport.ip_version == 4
    other = _render_roce_templated(slots, prefix, F, packets, topo, plan, payload) if v4_roce else None
    if other is not None:
        _icrc_v4_captured(slots, prefix, F, plan, among=other)
        return slots, F.caplen, F.frame_len
    if n <= BLOCK_ROWS:
        (_render_ib if plan.transport.kind == "ib" else _render_roce)(slots, prefix, F, packets, topo, plan,
                                                                     payload=payload)
        return slots, F.caplen, F.frame_len
    # Column operations run over blocks of rows that stay in the CPU cache; the few IPv4 ICRCs
    # inside the snap length (ACKs, CNPs, short frames) are computed once for the whole chunk.
    for lo in range(0, n, BLOCK_ROWS):
        hi = min(n, lo + BLOCK_ROWS)
        sub = take_rows(packets, slice(lo, hi))
        Fb = _Frames(sub, topo, plan, snaplen)
        if v4_roce:
            _render_roce(slots[lo:hi], prefix, Fb, sub, topo, plan, crc=False, payload=payload)
        else:
            (_render_ib if plan.transport.kind == "ib" else _render_roce)(slots[lo:hi], prefix, Fb, sub, topo, plan,
                                                                         payload=payload)
    if v4_roce:
        _icrc_v4_captured(slots, prefix, F, plan)
    return slots, F.caplen, F.frame_len


def payload_spans(packets, topo: Topology, plan: Plan, snaplen: int, prefix: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Where each frame's payload sits in its slot row and how much of it is captured.

    Returns ``(at, length)``, ``(n,)`` int64 each: row ``i``'s columns ``at[i]`` to
    ``at[i] + length[i]`` hold ``PAYLOAD_PATTERN[:length[i]]`` (the payload after the headers,
    cut at the snap length; ``length`` 0 for frames without payload or captured only up to
    their headers). A writer may send those bytes from :data:`PAYLOAD_PATTERN` itself and have
    :func:`render_slots` skip them (``payload=False``)."""
    F = _Frames(packets, topo, plan, snaplen)
    headers = layout.base_header_len(plan) + F.ext_len.astype(np.int64)
    if plan.transport.kind == "ib":
        headers = headers + layout.has_grh(F.src, F.dst, topo, plan).astype(np.int64) * H.GRH.length
    length = np.clip(F.caplen.astype(np.int64) - headers, 0, F.payload.astype(np.int64))
    return prefix + headers, length


_MIDDLE = np.zeros(256, dtype=bool)
for _c, _o in H.OPCODES.items():
    if _o.name.endswith("_MIDDLE") and not _o.ext:
        _MIDDLE[_c] = True
"""MIDDLE opcodes without extension headers: frames of one connection that differ only in PSN,
AckReq, IPv4 identification and checksum (and time)."""
TEMPLATE_BITS = 12
TEMPLATE_SLOTS = 1 << TEMPLATE_BITS
"""Hash-table slots for the connections of one block of rows (:func:`_render_roce_templated`)."""


def _render_roce_templated(slots, prefix: int, F: _Frames, packets, topo: Topology, plan: Plan,
                           payload: bool) -> np.ndarray | None:
    """Render a block of IPv4 RoCEv2 frames from per-connection templates; returns the rows not
    copied from a template (the only ones whose ICRC may be captured), or None (nothing
    written) when the block does not suit them.

    Most frames of long messages are MIDDLE packets, and two MIDDLE frames of one connection
    (same NICs, destination QP, opcode, UDP port, DSCP/ECN, length) differ only in four fields:
    IPv4 identification (PSN mod 2^16) and header checksum, BTH AckReq and PSN. Each such
    connection's frame is rendered once by :func:`_render_roce`, copied into its rows (one row
    gather), and those fields are patched as columns; the checksum is the template's one's
    complement sum plus the identification (RFC 1071). Every other row (FIRST/LAST/ONLY, ACKs,
    CNPs, rows whose hash slot another connection took) is rendered by :func:`_render_roce`.
    The groups come from packetize's :data:`~wiretrace.transport.packetize.TEMPLATE_COLUMN` when
    the table carries it (:func:`_template_hint`), otherwise from comparing the columns
    (:func:`_template_groups`). Used when the ICRC of the MIDDLE frames is past the snap length (it covers the PSN) and
    payloads are rendered; the bytes are those of :func:`_render_roce`."""
    n, width = slots.shape
    nics = topo.num_nics
    if not payload or n < 256 or nics > (1 << 15):
        return None
    l2 = H.ETHERNET.length + (H.DOT1Q.length if layout.vlan_tag(plan) is not None else 0)
    ip = prefix + l2
    bth = ip + H.IPV4.length + H.UDP.length
    if width < bth + H.BTH.length:                          # headers cut by the snap length
        return None
    hint = _template_hint(packets, n)
    if hint is not None:
        rep, row_t, ok = hint
    else:
        rep, row_t, ok = _template_groups(F, packets, nics)
    if rep is None:
        return None
    # templates whose ICRC a row would capture are not used (their rows are rendered whole)
    bad = F.frame_len[rep] - H.ICRC_LEN < F.caplen[rep]
    if bad.any():
        ok &= ~bad[row_t]
    if not ok.any():
        return None
    # one _render_roce call for the templates (a representative row each) and the other rows
    reps = rep
    other = np.flatnonzero(~ok)
    rows = np.concatenate([reps, other])
    sub = take_rows(packets, rows)
    Fo = _Frames(sub, topo, plan, 0)
    Fo.caplen = F.caplen[rows]
    block = np.empty((len(rows), width), dtype=np.uint8)
    _render_roce(block, prefix, Fo, sub, topo, plan, crc=False)
    T = block[:len(reps)]
    void = np.dtype((np.void, width))
    np.take(T.view(void).reshape(-1), row_t, out=slots.view(void).reshape(-1), mode="clip")
    # per-row fields
    psn = _col(packets, "psn")
    ident = psn.astype(np.uint16)
    words = T[:, ip:ip + H.IPV4.length].astype(np.uint32)
    wsum = ((words[:, 0::2] << np.uint32(8)) | words[:, 1::2]).sum(axis=1, dtype=np.uint32)
    wsum -= (words[:, 4] << np.uint32(8)) | words[:, 5]         # identification
    wsum -= (words[:, 10] << np.uint32(8)) | words[:, 11]       # checksum
    c = wsum[row_t] + ident
    c = (c & np.uint32(0xFFFF)) + (c >> np.uint32(16))
    c = (c & np.uint32(0xFFFF)) + (c >> np.uint32(16))
    slots[:, ip + 4:ip + 6].view(">u2")[:, 0] = ident
    slots[:, ip + 10:ip + 12].view(">u2")[:, 0] = ~c.astype(np.uint16)
    word = psn.astype(np.uint32) & np.uint32(0xFFFFFF)
    word |= _col(packets, "ack_req", np.bool_).astype(np.uint32) << np.uint32(31)
    slots[:, bth + 8:bth + 12].view(">u4")[:, 0] = word
    if len(other):
        slots[other] = block[len(reps):]
    return other


def _template_hint(packets, n: int):
    """Template groups from packetize's :data:`~wiretrace.transport.packetize.TEMPLATE_COLUMN`
    (rows with one value >= 0 have the same frame but for PSN, AckReq, IPv4 identification and
    checksum): ``(representative row per template, template of each row, row uses a template)``,
    or None when the table does not carry it or its values spread too widely for a direct map."""
    try:
        tm = np.asarray(packets[TEMPLATE_COLUMN])
    except (KeyError, IndexError, TypeError):
        return None
    if len(tm) != n:
        return None
    ok = tm >= 0
    if not ok.any():
        return np.zeros(0, np.intp), np.zeros(n, np.intp), ok
    lo, hi = int(tm[ok].min()), int(tm.max())
    if hi - lo >= 4 * n:
        return None
    # template index per row, other rows in one extra slot at the end
    slot = np.where(ok, tm - np.int32(lo), np.int32(hi - lo + 1))
    first = np.full(hi - lo + 2, -1, dtype=np.intp)
    first[slot] = np.arange(n)                           # one row of each template
    first[-1] = -1
    used = np.flatnonzero(first >= 0)
    fid = np.zeros(hi - lo + 2, dtype=np.intp)
    fid[used] = np.arange(len(used))
    return first[used], fid[slot], ok


def _template_groups(F: _Frames, packets, nics: int):
    """Template groups found by comparing columns: MIDDLE frames with the same (src NIC, dst NIC,
    destination QP, opcode) key, hashed into :data:`TEMPLATE_SLOTS` slots, whose UDP port,
    DSCP/ECN, PadCnt and length equal their slot's representative; same return as
    :func:`_template_hint`, ``(None, None, None)`` when under half the rows are MIDDLE."""
    n = F.n
    mid = _MIDDLE[F.opcode]
    if np.count_nonzero(mid) < n // 2:
        return None, None, None
    # connection key, exact: (src NIC, dst NIC, destination QP, opcode) in 62 bits
    bits = max(1, (nics - 1).bit_length())
    key = F.src.astype(np.int64)
    key <<= bits
    key |= F.dst
    key <<= 24
    key |= _col(packets, "dest_qp").astype(np.int64) & 0xFFFFFF
    key <<= 8
    key |= F.opcode
    # the rest of what a template fixes, as one word: UDP source port, DSCP, ECN, PadCnt, length
    rest = _col(packets, "udp_sport").astype(np.int64) & 0xFFFF
    rest |= (_col(packets, "dscp").astype(np.int64) & 0x3F) << 16
    rest |= (_col(packets, "ecn").astype(np.int64) & 3) << 22
    rest |= F.pad.astype(np.int64) << 24
    rest |= F.frame_len.astype(np.int64) << 32
    h = ((key.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - TEMPLATE_BITS)).astype(np.intp)
    rep = np.full(TEMPLATE_SLOTS, -1, dtype=np.intp)
    mid_rows = np.flatnonzero(mid)
    rep[h[mid_rows]] = mid_rows                              # one MIDDLE row per slot
    used = np.flatnonzero(rep >= 0)
    fid = np.zeros(TEMPLATE_SLOTS, dtype=np.intp)
    fid[used] = np.arange(len(used))
    row_rep = rep[h]
    ok = mid & (row_rep >= 0)
    r = np.maximum(row_rep, 0)
    ok &= (key[r] == key) & (rest[r] == rest)
    return rep[used], fid[h], ok


def _icrc_v4_captured(slots, prefix: int, F: _Frames, plan: Plan, among: np.ndarray | None = None) -> None:
    """ICRC of the IPv4 RoCEv2 frames captured whole, from their bytes in the slots; ``among``:
    only these rows can be (the others are known to be cut before their ICRC)."""
    l2 = H.ETHERNET.length + (H.DOT1Q.length if layout.vlan_tag(plan) is not None else 0)
    hb = l2 + H.IPV4.length + H.UDP.length + H.BTH.length
    cand = np.arange(F.n) if among is None else among
    limit = prefix + F.caplen[cand]
    icrc_pos = prefix + F.frame_len[cand] - H.ICRC_LEN
    keep = np.nonzero(icrc_pos < limit)[0]
    if not len(keep):
        return
    rows = cand[keep]
    vals = _icrc_values(slots[:, prefix + l2:], rows, hb - l2, F, 4)
    _scatter_trailer(slots, rows, icrc_pos[keep], C.icrc_bytes(vals), limit[keep])


def _icrc_values(ip_on: np.ndarray, rows: np.ndarray, headers: int, F: _Frames, ip_version: int) -> np.ndarray:
    """ICRC of frames ``rows`` (uint32): ``ip_on`` holds each frame from its IP header on,
    ``headers`` bytes of IP, UDP and BTH, then the extension headers; the payload and pad are
    folded in from their deterministic pattern (CRC linearity), one group per extension length."""
    vals = np.zeros(len(rows), dtype=np.uint32)
    ext = F.ext_len[rows]
    for el in np.flatnonzero(np.bincount(ext)).tolist():      # distinct extension lengths
        sel = ext == el
        g = rows[sel]
        masked = C.mask_rocev2(ip_on[g, :headers + el], ip_version)
        state = C.CRC32.update(C._STATE_AFTER_PSEUDO_LRH, masked)
        k, tail = _tail(C.CRC32, F, g)
        vals[sel] = (C.CRC32.shift(state, k) ^ tail) ^ np.uint32(0xFFFFFFFF)
    return vals


def _ext_groups(F: _Frames) -> dict[int, np.ndarray]:
    """Rows of each opcode that carries extension headers (few rows: FIRST, LAST, ONLY, ACK)."""
    idx = np.flatnonzero(F.ext_len)
    if not len(idx):
        return {}
    codes = F.opcode[idx]
    order = np.argsort(codes, kind="stable")
    codes, idx = codes[order], idx[order]
    cut = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1], True])
    return {int(codes[cut[i]]): idx[cut[i]:cut[i + 1]] for i in range(len(cut) - 1)}


def _fill_ext_and_payload(slots, off: int, F: _Frames, packets, payload: bool = True) -> None:
    """Extension headers at column ``off`` (after BTH), payload pattern after them (unless
    ``payload`` is False), zero pad."""
    n, width = slots.shape
    span = width - off
    if span <= 0:
        return
    # Most packets (MIDDLE) have no extension header: write the payload pattern for all rows,
    # then rewrite the rows that do carry extension headers.
    if payload:
        slots[:, off:] = PAYLOAD_PATTERN[:span]
    for code, rows in _ext_groups(F).items():
        _put_ext(slots, rows, off, _ext_rows(F, packets, code, rows), span, payload)
    _zero_pad(slots, off, F)


def _put_ext(slots, rows: np.ndarray, off: int, ext: np.ndarray, span: int, payload: bool) -> None:
    """Extension headers ``ext`` of ``rows`` at column ``off`` (``span`` columns to the row's
    end), followed by the payload pattern when ``payload``."""
    if payload:
        slots[rows, off:] = _ext_block(ext, span)
    else:
        k = min(ext.shape[1], span)
        slots[rows, off:off + k] = ext[:, :k]


def _ext_block(ext: np.ndarray, span: int) -> np.ndarray:
    """``span`` bytes per row from the extension headers ``ext`` on: the headers (cut at
    ``span``), then the deterministic payload pattern."""
    el = ext.shape[1]
    block = np.empty((len(ext), span), dtype=np.uint8)
    k = min(el, span)
    block[:, :k] = ext[:, :k]
    if span > el:
        block[:, el:] = PAYLOAD_PATTERN[:span - el]
    return block


def _scatter_trailer(slots, rows: np.ndarray, pos: np.ndarray, data: np.ndarray, limit: np.ndarray) -> None:
    """Write ``data[i]`` (k bytes) at column ``pos[i]`` of row ``rows[i]``, bytes before ``limit``."""
    n, width = slots.shape
    flat = slots.reshape(-1)
    for j in range(data.shape[1]):
        sel = pos + j < limit
        flat[rows[sel] * width + pos[sel] + j] = data[sel, j]


def _tail(crc: C.Crc, F: _Frames, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes after the headers, register contribution) of payload + pad of ``rows``."""
    pay, pad = F.payload_pad(rows)
    return pay + pad, C.tail_register(crc, PAYLOAD_PATTERN, pay, pad)


def _ext_rows(F: _Frames, packets, code: int, rows: np.ndarray) -> np.ndarray:
    """Packed extension headers of opcode ``code`` for ``rows``: ``(len(rows), ext_len)``."""
    parts = []
    for hname in H.OPCODES[code].ext:
        hdr = H.HEADERS[hname]
        vals = {}
        if hname == "reth":
            mid = _col(packets, "msg_id", np.int64)[rows]
            vals = {"va": (RETH_VA_BASE + ((mid & 0xFFFF) << 24)).astype(np.uint64),
                    "rkey": (RKEY_BASE + (F.dst[rows] & 0xFFFFF)).astype(np.uint32),
                    "dmalen": (_col(packets, "dma_len", np.int64)[rows] & 0xFFFFFFFF).astype(np.uint32)}
        elif hname == "immdt":
            vals = {"imm": (_col(packets, "imm", np.int64)[rows] & 0xFFFFFFFF).astype(np.uint32)}
        elif hname == "aeth":
            vals = {"syndrome": ACK_SYNDROME,
                    "msn": (_col(packets, "msn", np.int64)[rows] & 0xFFFFFF).astype(np.uint32)}
        parts.append(hdr.pack(len(rows), vals))
    return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def _pattern_word_sums() -> np.ndarray:
    w = PAYLOAD_PATTERN.reshape(-1, 2).astype(np.uint64)
    return np.r_[0, np.cumsum((w[:, 0] << np.uint64(8)) | w[:, 1])]


_PATTERN_WORDS = _pattern_word_sums()


_MAC64: dict[int, np.ndarray] = {}


def _nic_mac64(topo: Topology) -> np.ndarray:
    """MAC of every NIC as one uint64 (48 significant bits), cached per topology."""
    key = id(topo.nic_mac)
    if key not in _MAC64:
        m = topo.nic_mac.astype(np.uint64)
        v = np.zeros(len(m), dtype=np.uint64)
        for i in range(6):
            v = (v << np.uint64(8)) | m[:, i]
        _MAC64.clear()
        _MAC64[key] = v
    return _MAC64[key]


_IPV4_BASE_SUM = None


def _uniform(col: np.ndarray):
    """``col``'s single value as a Python int when every row holds it, else ``col``."""
    if len(col) and not (col != col[0]).any():
        return int(col[0])
    return col


def _ipv4_checksum(topo: Topology, F: _Frames, dscp, ecn, total, ident) -> np.ndarray:
    """RFC 1071 checksum of the IPv4 headers from their columns: the constant words (version,
    IHL, flags, TTL, protocol) summed once, the varying ones added per row."""
    global _IPV4_BASE_SUM
    if _IPV4_BASE_SUM is None:
        t = H.IPV4.template(dscp=0, ecn=0, total_length=0, id=0, src=0, dst=0, checksum=0)
        _IPV4_BASE_SUM = int(t.view(">u2").astype(np.uint32).sum())
    ip = topo.nic_ipv4.astype(np.uint32)
    words = (ip >> np.uint32(16)) + (ip & np.uint32(0xFFFF))
    tos = (np.asarray(dscp).astype(np.uint32) << np.uint32(2)) | np.asarray(ecn).astype(np.uint32)
    s = np.uint32(_IPV4_BASE_SUM) + tos + total + ident + words[F.src] + words[F.dst]
    s = (s & np.uint32(0xFFFF)) + (s >> np.uint32(16))
    s = (s & np.uint32(0xFFFF)) + (s >> np.uint32(16))
    return (~s & np.uint32(0xFFFF)).astype(np.uint16)


def _render_roce(slots, prefix, F: _Frames, packets, topo: Topology, plan: Plan, crc: bool = True,
                 payload: bool = True) -> None:
    t = plan.transport
    n, width = slots.shape
    vid = layout.vlan_tag(plan)
    vlan = vid is not None
    v4 = t.ip_version == 4
    l2 = H.ETHERNET.length + (H.DOT1Q.length if vlan else 0)
    l3 = H.IPV4.length if v4 else H.IPV6.length
    udp_at = l2 + l3
    hb = udp_at + H.UDP.length + H.BTH.length        # through the BTH
    emax = int(F.ext_len.max())
    limit = prefix + F.caplen                      # per-row end of captured bytes

    # All headers of every frame, whatever the snap length (ICRC and checksums need them): in
    # the slots themselves when they fit, else in a side array copied into the slots.
    ext_off = prefix + hb
    full = width >= ext_off + emax
    if full:
        if width > ext_off and payload:
            slots[:, ext_off:] = PAYLOAD_PATTERN[:width - ext_off]
        hdr = slots[:, prefix:ext_off + emax]
    else:
        hdr = np.empty((n, hb + emax), dtype=np.uint8)
    ip_type = H.ETHERTYPE_IPV4 if v4 else H.ETHERTYPE_IPV6
    mac = _nic_mac64(topo)
    H.ETHERNET.pack(n, {"dst": mac[F.dst], "src": mac[F.src],
                        "type": H.ETHERTYPE_VLAN if vlan else ip_type}, out=hdr[:, :H.ETHERNET.length])
    if vlan:
        H.DOT1Q.pack(n, {"pcp": t.pcp, "vid": vid, "type": ip_type}, out=hdr[:, H.ETHERNET.length:l2])
    dscp = _uniform(_col(packets, "dscp", np.uint8))    # one value for most blocks: a scalar
    ecn = _uniform(_col(packets, "ecn", np.uint8))
    psn = _col(packets, "psn")
    if v4:
        total = (F.frame_len - l2).astype(np.uint16)
        ident = psn.astype(np.uint16)             # PSN mod 2^16
        H.IPV4.pack(n, {"dscp": dscp, "ecn": ecn, "total_length": total, "id": ident,
                        "src": topo.nic_ipv4[F.src], "dst": topo.nic_ipv4[F.dst],
                        "checksum": _ipv4_checksum(topo, F, dscp, ecn, total, ident)},
                    out=hdr[:, l2:udp_at])
    else:
        H.IPV6.pack(n, {"dscp": dscp, "ecn": ecn, "payload_length": (F.frame_len - udp_at).astype(np.uint16),
                        "src": topo.nic_ipv6[F.src], "dst": topo.nic_ipv6[F.dst]}, out=hdr[:, l2:udp_at])
    H.UDP.pack(n, {"sport": _col(packets, "udp_sport").astype(np.uint16),
                   "length": (F.frame_len - udp_at).astype(np.uint16)}, out=hdr[:, udp_at:udp_at + H.UDP.length])
    is_cnp = F.opcode == H.CNP_OPCODE
    bth = {"opcode": F.opcode, "padcnt": _col(packets, "pad", np.uint8),
           "destqp": _col(packets, "dest_qp").astype(np.uint32),
           "ackreq": _col(packets, "ack_req", np.bool_).view(np.uint8), "psn": psn.astype(np.uint32)}
    if is_cnp.any():
        bth.update(migreq=(~is_cnp).astype(np.uint8), becn=is_cnp.astype(np.uint8))
    H.BTH.pack(n, bth, out=hdr[:, udp_at + H.UDP.length:hb])
    if not full:
        _put(slots, prefix, hdr[:, :hb])
        if width > ext_off and payload:
            slots[:, ext_off:] = PAYLOAD_PATTERN[:width - ext_off]
    groups = _ext_groups(F)
    span = width - ext_off
    for code, rows in groups.items():
        ext = _ext_rows(F, packets, code, rows)
        el = ext.shape[1]
        if not full:
            hdr[rows, hb:hb + el] = ext
        if span > 0:
            _put_ext(slots, rows, ext_off, ext, span, payload)
    _zero_pad(slots, ext_off, F)

    # ICRC: where it was captured, and for every IPv6 frame (its UDP checksum covers the ICRC).
    # For IPv4 the caller may do it once for all blocks (crc=False here).
    if v4 and not crc:
        return
    icrc_pos = prefix + F.frame_len - H.ICRC_LEN
    rows = np.arange(n) if not v4 else np.nonzero(icrc_pos < limit)[0]
    if not len(rows):
        return
    crc = C.icrc_bytes(_icrc_values(hdr[:, l2:], rows, hb - l2, F, t.ip_version))
    _scatter_trailer(slots, rows, icrc_pos[rows], crc, limit[rows])
    if not v4:
        csum = _udp6_checksum(hdr, rows, F, l2, udp_at, hb, crc)
        _scatter_trailer(slots, rows, np.full(len(rows), prefix + udp_at + 6), _be(csum, 2), limit[rows])


def _udp6_checksum(hdr, rows, F: _Frames, l2: int, udp_at: int, hb: int, crc: np.ndarray) -> np.ndarray:
    """RFC 8200 section 8.1 UDP checksum of IPv6 RoCEv2 frames (the ICRC masks this field, so it
    does not change the ICRC); one's-complement sums, the payload's taken from a prefix sum of
    the deterministic pattern."""
    udp_len = (F.frame_len[rows] - udp_at).astype(np.uint64)
    s = udp_len + np.uint64(H.IP_PROTO_UDP)                      # pseudo-header length, next header
    for el in np.unique(F.ext_len[rows]).tolist():
        sel = F.ext_len[rows] == el
        # source and destination address, UDP header (checksum still 0), BTH, extension headers:
        # one contiguous run of 16-bit words
        region = np.ascontiguousarray(hdr[rows[sel], l2 + 8:hb + el])
        s[sel] += region.view(">u2").sum(axis=1, dtype=np.uint64)
    pay = F.payload[rows]
    s += _PATTERN_WORDS[pay // 2]
    odd = (pay & 1).astype(bool)
    s[odd] += PAYLOAD_PATTERN[pay[odd] - 1].astype(np.uint64) << np.uint64(8)
    s += np.ascontiguousarray(crc).view(">u2").sum(axis=1, dtype=np.uint64)
    while (s >> np.uint64(16)).any():
        s = (s & np.uint64(0xFFFF)) + (s >> np.uint64(16))
    c = (~s & np.uint64(0xFFFF)).astype(np.uint16)
    c[c == 0] = 0xFFFF
    return c


def _zero_pad(slots, off: int, F: _Frames) -> None:
    """Pad bytes (after the payload, before the ICRC) are zero."""
    n, width = slots.shape
    padded = np.nonzero(F.pad > 0)[0]
    if not len(padded):
        return
    start = off + F.ext_len[padded] + F.payload[padded]
    flat = slots.reshape(-1)
    for j in range(3):
        sel = (j < F.pad[padded]) & (start + j < width)
        flat[padded[sel] * width + start[sel] + j] = 0


def _put(slots, off: int, block: np.ndarray) -> None:
    width = slots.shape[1]
    end = min(off + block.shape[1], width)
    if end > off:
        slots[:, off:end] = block[:, :end - off]


def _render_ib(slots, prefix, F: _Frames, packets, topo: Topology, plan: Plan, payload: bool = True) -> None:
    n, width = slots.shape
    grh = layout.has_grh(F.src, F.dst, topo, plan)
    limit = prefix + F.caplen
    psn = _col(packets, "psn", np.int64)
    lid = topo.nic_lid.astype(np.int64)
    gid = topo.nic_gid(6)
    for with_grh in (False, True):
        rows = np.nonzero(grh == with_grh)[0]
        if not len(rows):
            continue
        sub = _Frames(take_rows(packets, rows), topo, plan, 0)
        sub.caplen = F.caplen[rows]
        m = len(rows)
        block = np.empty((m, width), dtype=np.uint8)
        lrh = H.LRH.pack(m, {"lnh": H.LNH_GRH if with_grh else H.LNH_BTH,
                             "dlid": lid[sub.dst].astype(np.uint16), "slid": lid[sub.src].astype(np.uint16),
                             "pktlen": ((sub.frame_len - H.VCRC_LEN) // 4).astype(np.uint16)})
        _put(block, prefix, lrh)
        off = prefix + H.LRH.length
        if with_grh:
            g = H.GRH.pack(m, {"paylen": (sub.frame_len - H.LRH.length - H.GRH.length - H.VCRC_LEN).astype(np.uint16),
                               "sgid": gid[sub.src], "dgid": gid[sub.dst]})
            _put(block, off, g)
            off += H.GRH.length
        bth = H.BTH.pack(m, {"opcode": sub.opcode, "migreq": 1, "padcnt": sub.pad.astype(np.uint8),
                             "destqp": (_col(packets, "dest_qp", np.int64)[rows] & 0xFFFFFF).astype(np.uint32),
                             "ackreq": _col(packets, "ack_req")[rows].astype(np.uint8),
                             "psn": (psn[rows] & 0xFFFFFF).astype(np.uint32)})
        _put(block, off, bth)
        ext_off = off + H.BTH.length
        sub_packets = take_rows(packets, rows)
        _fill_ext_and_payload(block, ext_off, sub, sub_packets, payload)

        icrc_pos = prefix + sub.frame_len - H.ICRC_LEN - H.VCRC_LEN
        lim = limit[rows]
        need = np.nonzero(icrc_pos < lim)[0]
        if len(need):
            ic = np.zeros(len(need), dtype=np.uint32)
            vc = np.zeros(len(need), dtype=np.uint16)
            for el in np.unique(sub.ext_len[need]).tolist():
                sel = sub.ext_len[need] == el
                gi = need[sel]
                hdr = block[gi, prefix:ext_off + el]
                k, tail32 = _tail(C.CRC32, sub, gi)
                st = C.CRC32.update(C.CRC32.init, C.mask_ib(hdr, with_grh))
                icv = (C.CRC32.shift(st, k) ^ tail32) ^ np.uint32(0xFFFFFFFF)
                ic[sel] = icv
                _, tail16 = _tail(C.CRC16_VCRC, sub, gi)
                s16 = C.CRC16_VCRC.update(C.CRC16_VCRC.init, hdr)
                s16 = C.CRC16_VCRC.shift(s16, k) ^ tail16
                s16 = C.CRC16_VCRC.update(s16, C.icrc_bytes(icv))
                vc[sel] = s16 ^ np.uint16(0xFFFF)
            _scatter_trailer(block, need, icrc_pos[need], C.icrc_bytes(ic), lim[need])
            _scatter_trailer(block, need, icrc_pos[need] + H.ICRC_LEN, C.vcrc_bytes(vc), lim[need])
        slots[rows, prefix:] = block[:, prefix:]


def slot_runs(slots: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``(start, end)`` (int64 offsets into ``slots`` flattened) holding the first
    ``lengths[i]`` bytes of each row, merged where rows are full, empty ranges left out. Rows
    are concatenated in order."""
    n, width = slots.shape
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    short = np.nonzero(lengths < width)[0]
    ends = short * np.int64(width) + lengths[short]
    starts = np.r_[0, (short[:-1] + 1) * np.int64(width)] if len(short) else np.zeros(0, np.int64)
    tail_start = (int(short[-1]) + 1) * width if len(short) else 0
    if tail_start < n * width:
        starts, ends = np.r_[starts, tail_start], np.r_[ends, n * width]
    keep = ends > starts
    return starts[keep].astype(np.int64), ends[keep].astype(np.int64)


def slot_pieces(slots: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
    """Byte ranges of ``slots`` holding the first ``lengths[i]`` bytes of each row, merged where
    rows are full: ready for ``os.writev``. Rows are concatenated in order."""
    if len(slots) == 0:
        return []
    flat = memoryview(slots.reshape(-1))
    starts, ends = slot_runs(slots, lengths)
    return [flat[s:e] for s, e in zip(starts.tolist(), ends.tolist())]


def render(packets, topo: Topology, plan: Plan, snaplen: int = 128
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Frames of a packets table, concatenated.

    Parameters
    ----------
    packets : packets-table columns, ``(n,)`` each.
    topo, plan : addresses and transport settings.
    snaplen : bytes kept per frame (0: whole frames).

    Returns
    -------
    buf : uint8, the captured bytes of all frames back to back.
    offsets : ``(n + 1,)`` int64, frame ``i`` is ``buf[offsets[i]:offsets[i + 1]]``.
    caplen : ``(n,)`` int64 captured bytes.
    origlen : ``(n,)`` int64 frame length on the wire.
    """
    slots, caplen, origlen = render_slots(packets, topo, plan, snaplen)
    offsets = np.r_[0, np.cumsum(caplen)].astype(np.int64)
    buf = np.empty(int(offsets[-1]), dtype=np.uint8)
    pos = 0
    for piece in slot_pieces(slots, caplen):       # runs of whole rows, split at short frames
        buf[pos:pos + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        pos += len(piece)
    return buf, offsets, caplen, origlen
