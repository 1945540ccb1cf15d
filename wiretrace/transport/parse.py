"""Raw frames -> packets-table columns: RoCEv2 (Ethernet, 802.1Q, IPv4/IPv6, UDP 4791) and native
InfiniBand (LRH, optional GRH), vectorized over a batch of frames.

The header layouts come from :mod:`wiretrace.transport.headers` (declared once there); this module
only finds where each header sits in each frame and reads it with :meth:`Header.parse`. Frames are
grouped by layout (link type, VLAN tags, IP version, GRH): within a group every header is at a
position computed as one column operation, and each header is read for the whole group at once.

A frame is RoCE (kept) when its UDP header is captured and its destination port is 4791, or when it
is a native IB frame whose LRH announces a BTH (LNH 2) or a GRH carrying one (LNH 3, next header
0x1B). Everything else (ARP, TCP, LLDP, IB raw or IP-over-IB packets) is counted and skipped.

Frames cut by a snap length are parsed as far as their bytes go: each header is read only when all
of its bytes were captured; lengths (payload, frame) come from the IP/UDP/LRH length fields, so they
are known even when the payload was not captured. Columns of headers that are missing hold -1
(signed columns) or 0, and the ``has_*`` columns say which headers were seen.

Sources: IEEE 802.1Q; RFC 791, RFC 8200, RFC 768; IBTA vol. 1 rel. 1.4 sections 7.7 (LRH), 8.3
(GRH), 9.2-9.3 (BTH and extension headers, table 38 opcodes), annex A17 (RoCEv2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from ..io.capture import (LINKTYPE_ETHERNET, LINKTYPE_INFINIBAND, LINKTYPE_IPV4, LINKTYPE_IPV6,
                          LINKTYPE_LINUX_SLL, LINKTYPE_LINUX_SLL2, LINKTYPE_RAW, FrameBatch,
                          iter_frames)
from . import headers as H

HEAD_WINDOW = 128
"""Bytes of each frame examined for headers: Ethernet + two VLAN tags + IPv6 + UDP + BTH + the
longest extension headers (RD: RDETH + DETH + AtomicETH) fit in it, as do LRH + GRH + BTH + ...."""

_ETHERTYPE_QINQ = 0x88A8
_LINKTYPE_RAW_ALIASES = (LINKTYPE_RAW, 12, 14)  # DLT_RAW is 12 or 14 on some systems
BTH_LEN = H.BTH.length

# Where each extension header sits after the BTH for every opcode (-1: absent), derived from the
# opcode table of headers.py.
def _ext_offsets(name: str) -> np.ndarray:
    out = np.full(256, -1, dtype=np.int16)
    for code, op in H.OPCODES.items():
        pos = 0
        for h in op.ext:
            if h == name:
                out[code] = pos
            pos += H.HEADERS[h].length
    return out


RETH_AT = _ext_offsets("reth")
AETH_AT = _ext_offsets("aeth")
IMMDT_AT = _ext_offsets("immdt")
DETH_AT = _ext_offsets("deth")

KIND_ROCE_V4, KIND_ROCE_V6, KIND_IB, KIND_IB_GRH = 0, 1, 2, 3
"""Values of the ``kind`` column: RoCEv2 over IPv4 / IPv6, native IB with LRH only / with GRH."""

COLUMNS = {
    # name: (dtype, fill for frames where the field is absent)
    "row": (np.int64, -1), "frame": (np.int64, -1), "ts_ns": (np.int64, 0),
    "caplen": (np.int32, 0), "origlen": (np.int32, 0), "iface": (np.int16, 0),
    "kind": (np.uint8, 0), "l3_offset": (np.int32, -1), "bth_offset": (np.int32, -1),
    "vlan": (np.int32, -1), "pcp": (np.int8, -1),
    "src_addr": (np.uint8, 0), "dst_addr": (np.uint8, 0),
    "ip_len": (np.int32, -1), "ip_checksum": (np.int32, -1), "ttl": (np.int16, -1),
    "dscp": (np.uint8, 0), "ecn": (np.uint8, 0),
    "udp_sport": (np.int32, -1), "udp_len": (np.int32, -1), "udp_checksum": (np.int32, -1),
    "vl": (np.int8, -1), "sl": (np.int8, -1), "slid": (np.int32, -1), "dlid": (np.int32, -1),
    "lrh_pktlen": (np.int32, -1), "grh_paylen": (np.int32, -1),
    "opcode": (np.uint8, 0), "se": (np.bool_, False), "migreq": (np.bool_, False),
    "pad": (np.uint8, 0), "tver": (np.uint8, 0), "pkey": (np.int32, -1),
    "fecn": (np.bool_, False), "becn": (np.bool_, False),
    "dest_qp": (np.int32, -1), "ack_req": (np.bool_, False), "psn": (np.int32, -1),
    "ext_len": (np.int16, 0), "dma_len": (np.int64, -1), "rkey": (np.int64, -1),
    "va": (np.uint64, 0), "aeth_syndrome": (np.int16, -1), "msn": (np.int32, -1),
    "imm": (np.int64, -1), "src_qp": (np.int32, -1),
    "payload_len": (np.int32, -1), "frame_len": (np.int32, -1),
    "has_bth": (np.bool_, False), "has_ext": (np.bool_, False), "complete": (np.bool_, False),
    "truncated": (np.bool_, False),
}
"""Columns returned by :func:`parse_frames`, their dtypes and the value of absent fields.

Meaning: ``row`` index of the frame in its batch, ``frame`` Wireshark frame number (1-based);
``kind`` see ``KIND_*``; ``l3_offset``/``bth_offset`` byte offset of the IP header (RoCEv2) or
LRH (IB, 0) and of the BTH in the frame; ``src_addr``/``dst_addr`` (n, 16) uint8: IPv6 addresses,
IPv4 as IPv4-mapped ``::ffff:a.b.c.d``, GRH GIDs for IB (zeros without GRH); ``ip_len`` bytes
from the IP header (or LRH) through the ICRC; ``lrh_pktlen`` the LRH PktLen (4-byte words) and
``grh_paylen`` the GRH PayLen (bytes) of native IB frames; ``ip_checksum`` the stored IPv4 header checksum;
``payload_len`` IB payload bytes (after BTH and extension headers, before pad and ICRC);
``frame_len`` bytes of the frame on the wire from the Ethernet header (or LRH) through the ICRC
(and VCRC), without FCS, from the length fields (frames captured without an Ethernet header count
a 14-byte one); ``dma_len`` RETH DMA length, bytes; ``msn`` AETH MSN; ``has_bth`` the BTH was
captured, ``has_ext`` its extension headers too, ``complete`` the frame was captured through its
ICRC (and VCRC); ``truncated`` caplen < origlen.
"""

PACKETS_COLUMNS = ("ts_ns", "udp_sport", "dest_qp", "psn", "opcode", "ack_req", "payload_len",
                   "pad", "frame_len", "dscp", "ecn")
"""Columns shared with the packets table (schemas/packets.schema.json)."""


LINK_HEADER_LEN = {LINKTYPE_ETHERNET: 14, LINKTYPE_LINUX_SLL: 16, LINKTYPE_LINUX_SLL2: 20}
"""Bytes a frame of each link type needs before it can be told apart (Ethernet header, Linux
cooked header); raw IP link types need one. An IB record is IB whatever is left of it (its
frames cut inside the LRH count as cut before the BTH)."""


class ParseStats:
    """Counters over everything parsed: ``frames``, ``roce`` (RoCEv2 or IB transport frames),
    ``non_roce`` (skipped), ``truncated`` (RoCE frames, or frames that may be, with caplen <
    origlen), ``cut_roce`` (frames the snap length cut before the end of their BTH whose captured
    headers are those of a RoCE or IB frame), ``cut_unknown`` (frames cut inside their link-layer
    header, so nobody can tell what they carry); the two cut counts are neither RoCE nor other
    traffic."""

    def __init__(self):
        self.frames = 0
        self.roce = 0
        self.non_roce = 0
        self.truncated = 0
        self.cut_roce = 0
        self.cut_unknown = 0

    def add(self, n_frames: int, cols: dict, cut_roce: int = 0, batch: FrameBatch | None = None) -> None:
        """Count a batch of ``n_frames`` frames, ``cols`` its parsed rows, ``cut_roce`` frames
        of it cut before the BTH (:func:`cut_before_bth`); ``batch`` (the frames themselves)
        lets frames cut inside their link-layer header be counted apart."""
        no_bth = int(np.count_nonzero(~cols["has_bth"]))     # parsed up to the BTH, cut there
        unknown = 0
        if batch is not None and n_frames:
            need = np.zeros(len(batch.caplen), dtype=np.int64)
            lt = batch.linktype
            for t, k in LINK_HEADER_LEN.items():
                need[lt == t] = k
            need[np.isin(lt, (*_LINKTYPE_RAW_ALIASES, LINKTYPE_IPV4, LINKTYPE_IPV6))] = 1
            cap = batch.caplen.astype(np.int64)
            unknown = int(np.count_nonzero((cap < need) & (cap < batch.origlen)))
        self.frames += n_frames
        self.roce += len(cols["row"]) - no_bth
        self.cut_roce += cut_roce + no_bth
        self.cut_unknown += unknown
        self.non_roce += n_frames - len(cols["row"]) - cut_roce - unknown
        self.truncated += int(np.count_nonzero(cols["truncated"])) + cut_roce + unknown

    def as_dict(self) -> dict:
        return {"frames": self.frames, "roce_frames": self.roce, "non_roce_frames": self.non_roce,
                "truncated": self.truncated, "cut_before_bth": self.cut_roce,
                "cut_before_link_header": self.cut_unknown}


def _head_window(batch: FrameBatch, width: int = HEAD_WINDOW) -> np.ndarray:
    """``(n, width)`` uint8: the first ``width`` bytes of each frame, zeros past its caplen."""
    n = len(batch)
    if n == 0 or len(batch.data) == 0:
        return np.zeros((n, width), dtype=np.uint8)
    padded = np.concatenate([batch.data, np.zeros(width, dtype=np.uint8)])
    rows = np.lib.stride_tricks.sliding_window_view(padded, width)[batch.offsets[:-1]]
    short = np.nonzero(batch.caplen < width)[0]
    if len(short):
        rows[short] *= (np.arange(width)[None, :] < batch.caplen[short, None])
    return rows


def _be16(rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
    r = np.arange(len(pos))
    return (rows[r, pos].astype(np.int32) << 8) | rows[r, pos + 1]


def _empty(n: int) -> dict[str, np.ndarray]:
    out = {}
    for name, (dt, fill) in COLUMNS.items():
        shape = (n, 16) if name in ("src_addr", "dst_addr") else (n,)
        out[name] = np.full(shape, fill, dtype=dt)
    return out


def parse_frames(batch: FrameBatch, cut: list | None = None) -> dict[str, np.ndarray]:
    """Parse the RoCEv2 and InfiniBand frames of a batch into columns.

    Parameters
    ----------
    batch : FrameBatch
        Frames from :func:`wiretrace.io.capture.iter_frames`.
    cut : list, optional
        When given, receives (appended) the number of frames of the batch that the snap length
        cut before their BTH while every header captured says RoCEv2 / IB: EtherType IPv4/IPv6
        (after VLAN tags), IP protocol UDP and UDP destination port 4791 as far as they were
        captured, or an LRH (and GRH) of a native IB record. Such frames cannot be checked and
        are not returned.

    Returns
    -------
    dict of str -> numpy.ndarray
        One row per RoCE/IB frame of the batch, in capture order; columns and dtypes as
        :data:`COLUMNS` (``src_addr``/``dst_addr`` are ``(n, 16)``). Non-RoCE frames are absent;
        ``row`` maps back to the batch.
    """
    n = len(batch)
    rows = _head_window(batch)
    cap = batch.caplen.astype(np.int64)
    lt = batch.linktype.astype(np.int64)

    # -- link layer: where the IP header starts and which EtherType announces it --------------
    l3 = np.full(n, -1, dtype=np.int64)
    etype = np.zeros(n, dtype=np.int64)
    vlan = np.full(n, -1, dtype=np.int64)
    pcp = np.full(n, -1, dtype=np.int64)
    eth = lt == LINKTYPE_ETHERNET
    r_eth = np.nonzero(eth & (cap >= 14))[0]
    if len(r_eth):
        pos = np.full(len(r_eth), 12, dtype=np.int64)
        t = _be16(rows[r_eth], pos)
        for _ in range(2):  # up to two tags (802.1ad outer, 802.1Q inner)
            tagged = ((t == H.ETHERTYPE_VLAN) | (t == _ETHERTYPE_QINQ)) & (cap[r_eth] >= pos + 6)
            if not tagged.any():
                break
            sel = np.nonzero(tagged)[0]
            tag = H.DOT1Q.parse(rows[r_eth[sel]], pos[sel] + 2)
            vlan[r_eth[sel]] = tag["vid"]  # the innermost tag wins
            pcp[r_eth[sel]] = tag["pcp"]
            t[sel] = tag["type"]
            pos[sel] += 4
        l3[r_eth] = pos + 2
        etype[r_eth] = t
    sll = (lt == LINKTYPE_LINUX_SLL) & (cap >= 16)
    l3[sll] = 16
    etype[sll] = _be16(rows[sll], np.full(int(sll.sum()), 14))
    sll2 = (lt == LINKTYPE_LINUX_SLL2) & (cap >= 20)
    l3[sll2] = 20
    etype[sll2] = _be16(rows[sll2], np.zeros(int(sll2.sum()), dtype=np.int64))
    raw = np.isin(lt, (*_LINKTYPE_RAW_ALIASES, LINKTYPE_IPV4, LINKTYPE_IPV6)) & (cap >= 1)
    l3[raw] = 0
    version = rows[raw, 0] >> 4
    etype[raw] = np.where(version == 4, H.ETHERTYPE_IPV4,
                          np.where(version == 6, H.ETHERTYPE_IPV6, 0))

    # -- IP and UDP ------------------------------------------------------------------------------
    l4 = np.full(n, -1, dtype=np.int64)
    ip_len = np.full(n, -1, dtype=np.int64)
    kind = np.zeros(n, dtype=np.int64)
    src = np.zeros((n, 16), dtype=np.uint8)
    dst = np.zeros((n, 16), dtype=np.uint8)
    dscp = np.zeros(n, dtype=np.int64)
    ecn = np.zeros(n, dtype=np.int64)
    ttl = np.full(n, -1, dtype=np.int64)
    ip_sum = np.full(n, -1, dtype=np.int64)

    r4 = np.nonzero((etype == H.ETHERTYPE_IPV4) & (l3 >= 0))[0]
    r4 = r4[cap[r4] >= l3[r4] + H.IPV4.length]
    if len(r4):
        ip = H.IPV4.parse(rows[r4], l3[r4])
        ok = ((ip["version"] == 4) & (ip["ihl"] >= 5) & (ip["proto"] == H.IP_PROTO_UDP)
              & (ip["frag_offset"] == 0) & ((ip["flags"] & 1) == 0))
        r4, ip = r4[ok], {k: v[ok] for k, v in ip.items()}
        l4[r4] = l3[r4] + ip["ihl"].astype(np.int64) * 4
        ip_len[r4] = ip["total_length"]
        kind[r4] = KIND_ROCE_V4
        src[r4, 10:12] = 0xFF
        dst[r4, 10:12] = 0xFF
        src[r4, 12:] = ip["src"].astype(">u4").view(np.uint8).reshape(-1, 4)
        dst[r4, 12:] = ip["dst"].astype(">u4").view(np.uint8).reshape(-1, 4)
        dscp[r4], ecn[r4], ttl[r4], ip_sum[r4] = ip["dscp"], ip["ecn"], ip["ttl"], ip["checksum"]

    r6 = np.nonzero((etype == H.ETHERTYPE_IPV6) & (l3 >= 0))[0]
    r6 = r6[cap[r6] >= l3[r6] + H.IPV6.length]
    if len(r6):
        ip = H.IPV6.parse(rows[r6], l3[r6])
        ok = (ip["version"] == 6) & (ip["next_header"] == H.IP_PROTO_UDP)
        r6, ip = r6[ok], {k: v[ok] for k, v in ip.items()}
        l4[r6] = l3[r6] + H.IPV6.length
        ip_len[r6] = ip["payload_length"].astype(np.int64) + H.IPV6.length
        kind[r6] = KIND_ROCE_V6
        src[r6], dst[r6] = ip["src"], ip["dst"]
        dscp[r6], ecn[r6], ttl[r6] = ip["dscp"], ip["ecn"], ip["hop_limit"]

    udp_sport = np.full(n, -1, dtype=np.int64)
    udp_len = np.full(n, -1, dtype=np.int64)
    udp_sum = np.full(n, -1, dtype=np.int64)
    bth = np.full(n, -1, dtype=np.int64)
    ru = np.nonzero(l4 >= 0)[0]
    ru = ru[(cap[ru] >= l4[ru] + H.UDP.length) & (l4[ru] + H.UDP.length <= HEAD_WINDOW)]
    if len(ru):
        udp = H.UDP.parse(rows[ru], l4[ru])
        ok = udp["dport"] == H.ROCEV2_UDP_PORT
        ru = ru[ok]
        udp_sport[ru] = udp["sport"][ok]
        udp_len[ru] = udp["length"][ok]
        udp_sum[ru] = udp["checksum"][ok]
        bth[ru] = l4[ru] + H.UDP.length

    # -- native InfiniBand: LRH [GRH] -------------------------------------------------------------
    vl = np.full(n, -1, dtype=np.int64)
    sl = np.full(n, -1, dtype=np.int64)
    slid = np.full(n, -1, dtype=np.int64)
    dlid = np.full(n, -1, dtype=np.int64)
    pktlen = np.full(n, -1, dtype=np.int64)
    paylen = np.full(n, -1, dtype=np.int64)
    rib = np.nonzero((lt == LINKTYPE_INFINIBAND) & (cap >= H.LRH.length))[0]
    if len(rib):
        lrh = H.LRH.parse(rows[rib], 0)
        lnh = lrh["lnh"]
        local = lnh == H.LNH_BTH
        glob = (lnh == H.LNH_GRH) & (cap[rib] >= H.LRH.length + H.GRH.length)
        rg = rib[glob]
        if len(rg):
            grh = H.GRH.parse(rows[rg], H.LRH.length)
            iba = grh["nxthdr"] == H.GRH_NEXT_HEADER_IBA
            glob[np.nonzero(glob)[0][~iba]] = False
            rg = rg[iba]
            src[rg], dst[rg] = grh["sgid"][iba], grh["dgid"][iba]
            ttl[rg] = grh["hoplmt"][iba]
            paylen[rg] = grh["paylen"][iba]
        keep = local | glob
        rib, lrh = rib[keep], {k: v[keep] for k, v in lrh.items()}
        local = local[keep]
        kind[rib] = np.where(local, KIND_IB, KIND_IB_GRH)
        bth[rib] = np.where(local, H.LRH.length, H.LRH.length + H.GRH.length)
        l3[rib] = 0
        vl[rib], sl[rib] = lrh["vl"], lrh["sl"]
        slid[rib], dlid[rib] = lrh["slid"], lrh["dlid"]
        pktlen[rib] = lrh["pktlen"]
        ip_len[rib] = lrh["pktlen"].astype(np.int64) * 4

    if cut is not None:
        cut.append(_count_cut_before_bth(batch, rows, cap, lt, l3, etype, bth))

    # -- keep the RoCE/IB frames, read BTH and extension headers ---------------------------------
    keep = np.nonzero(bth >= 0)[0]
    m = len(keep)
    out = _empty(m)
    if m == 0:
        return out
    out["row"][:] = keep
    out["frame"][:] = batch.first + 1 + keep
    out["ts_ns"][:] = batch.ts_ns[keep]
    out["caplen"][:] = batch.caplen[keep]
    out["origlen"][:] = batch.origlen[keep]
    out["iface"][:] = batch.iface[keep]
    out["truncated"][:] = batch.caplen[keep] < batch.origlen[keep]
    k_kind = kind[keep]
    out["kind"][:] = k_kind
    out["l3_offset"][:] = l3[keep]
    out["bth_offset"][:] = bth[keep]
    out["vlan"][:] = vlan[keep]
    out["pcp"][:] = pcp[keep]
    out["src_addr"][:] = src[keep]
    out["dst_addr"][:] = dst[keep]
    out["ip_len"][:] = ip_len[keep]
    out["ip_checksum"][:] = ip_sum[keep]
    out["ttl"][:] = ttl[keep]
    roce = k_kind <= KIND_ROCE_V6
    out["dscp"][:] = np.where(roce, dscp[keep], 0)
    out["ecn"][:] = np.where(roce, ecn[keep], 0)
    out["udp_sport"][:] = udp_sport[keep]
    out["udp_len"][:] = udp_len[keep]
    out["udp_checksum"][:] = udp_sum[keep]
    for name, arr in (("vl", vl), ("sl", sl), ("slid", slid), ("dlid", dlid),
                      ("lrh_pktlen", pktlen), ("grh_paylen", paylen)):
        out[name][:] = arr[keep]

    b = bth[keep]
    kc = cap[keep]
    has_bth = (kc >= b + BTH_LEN) & (b + BTH_LEN <= HEAD_WINDOW)
    out["has_bth"][:] = has_bth
    hb = np.nonzero(has_bth)[0]
    if len(hb):
        f = H.BTH.parse(rows[keep[hb]], b[hb])
        op = f["opcode"].astype(np.int64)
        out["opcode"][hb] = op
        out["se"][hb] = f["se"].astype(bool)
        out["migreq"][hb] = f["migreq"].astype(bool)
        out["pad"][hb] = f["padcnt"]
        out["tver"][hb] = f["tver"]
        out["pkey"][hb] = f["pkey"]
        out["fecn"][hb] = f["fecn"].astype(bool)
        out["becn"][hb] = f["becn"].astype(bool)
        out["dest_qp"][hb] = f["destqp"]
        out["ack_req"][hb] = f["ackreq"].astype(bool)
        out["psn"][hb] = f["psn"]
        ext = H.EXT_LEN[op].astype(np.int64)
        out["ext_len"][hb] = ext
        ext_at = b[hb] + BTH_LEN
        has_ext = (kc[hb] >= ext_at + ext) & (ext_at + ext <= HEAD_WINDOW)
        out["has_ext"][hb] = has_ext
        for at_table, header, fields in (
                (RETH_AT, H.RETH, (("dmalen", "dma_len"), ("rkey", "rkey"), ("va", "va"))),
                (AETH_AT, H.AETH, (("syndrome", "aeth_syndrome"), ("msn", "msn"))),
                (IMMDT_AT, H.IMMDT, (("imm", "imm"),)),
                (DETH_AT, H.DETH, (("srcqp", "src_qp"),))):
            at = at_table[op].astype(np.int64)
            sel = np.nonzero(has_ext & (at >= 0))[0]
            if len(sel):
                vals = header.parse(rows[keep[hb[sel]]], ext_at[sel] + at[sel])
                for fname, col in fields:
                    out[col][hb[sel]] = vals[fname]
        # Lengths from the headers' length fields (known even when the payload is not captured).
        b_rel = np.where(roce[hb], b[hb] - l4[keep[hb]], b[hb])  # UDP or LRH(+GRH) before BTH
        total = np.where(roce[hb], udp_len[keep[hb]], ip_len[keep[hb]])
        out["payload_len"][hb] = (total - b_rel - BTH_LEN - ext - f["padcnt"].astype(np.int64)
                                  - H.ICRC_LEN)
    # frame length on the wire: link header + IP (or LRH..ICRC, + VCRC)
    l2 = np.where(eth[keep], l3[keep], 14)
    flen = np.where(roce, l2 + ip_len[keep], ip_len[keep] + H.VCRC_LEN)
    flen = np.where(ip_len[keep] >= 0, flen, -1)
    out["frame_len"][:] = flen
    out["complete"][:] = np.where(roce, kc >= l3[keep] + ip_len[keep],
                                  kc >= ip_len[keep] + H.VCRC_LEN) & (ip_len[keep] >= 0)
    return out


def _count_cut_before_bth(batch, rows, cap, lt, l3, etype, bth) -> int:
    """Frames cut by the snap length before the BTH whose captured headers all say RoCE/IB."""
    cand = (batch.caplen.astype(np.int64) < batch.origlen.astype(np.int64)) & (bth < 0)
    if not cand.any():
        return 0
    r = np.arange(len(cap))
    at = np.clip(l3, 0, rows.shape[1] - 1)

    def byte(off):                       # byte at l3 + off, and whether it was captured
        pos = np.clip(l3 + off, 0, rows.shape[1] - 1)
        return rows[r, pos].astype(np.int64), (l3 >= 0) & (cap > l3 + off) & (l3 + off < rows.shape[1])

    v4 = (etype == H.ETHERTYPE_IPV4) & (l3 >= 0)
    v6 = (etype == H.ETHERTYPE_IPV6) & (l3 >= 0)
    proto4, seen4 = byte(9)
    proto6, seen6 = byte(6)
    udp_ok = np.where(v4, ~seen4 | (proto4 == H.IP_PROTO_UDP), ~seen6 | (proto6 == H.IP_PROTO_UDP))
    ihl = (rows[r, at] & 0x0F).astype(np.int64) * 4
    l4 = np.where(v4, l3 + np.where(cap > l3, ihl, 20), l3 + H.IPV6.length)
    port_pos = np.clip(l4 + 2, 0, rows.shape[1] - 2)
    dport = (rows[r, port_pos].astype(np.int64) << 8) | rows[r, port_pos + 1]
    port_seen = cap >= l4 + 4
    port_ok = ~port_seen | (dport == H.ROCEV2_UDP_PORT)
    roce = (v4 | v6) & udp_ok & port_ok
    lnh_grh = (rows[:, 1] & 0x03) == H.LNH_GRH
    ib = (lt == LINKTYPE_INFINIBAND) & ((cap < H.LRH.length)   # LRH (or its GRH) cut: no BTH to read
                                        | (lnh_grh & (cap < H.LRH.length + H.GRH.length)))
    return int(np.count_nonzero(cand & (roce | ib)))


def as_packets(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Columns of the packets table (schemas/packets.schema.json) from :func:`parse_frames`.

    A capture does not say which message or NIC index a frame belongs to: ``msg_id``,
    ``src_nic`` and ``dst_nic`` are -1, as the schema prescribes for foreign captures.
    ``udp_sport`` is -1 for native InfiniBand. Fields of headers that were not captured keep
    the fill values of :data:`COLUMNS`.
    """
    from ..tables import column_names, numpy_dtype

    n = len(cols["row"])
    out = {}
    for name in column_names("packets"):
        dt = numpy_dtype("packets", name)
        if name in cols:
            out[name] = cols[name].astype(dt)
        else:  # msg_id, src_nic, dst_nic
            out[name] = np.full(n, -1, dtype=dt)
    return out


def iter_packets(path: str | Path, stats: ParseStats | None = None,
                 **batch_options) -> Iterator[tuple[FrameBatch, dict[str, np.ndarray]]]:
    """Stream a capture as ``(batch, columns)`` pairs, columns from :func:`parse_frames`.

    Parameters
    ----------
    path : capture file (pcap, pcapng, ERF).
    stats : optional :class:`ParseStats` updated as batches are parsed.
    **batch_options : passed to :func:`wiretrace.io.capture.iter_frames`.

    Raises
    ------
    InputFormatError
        From the capture reader.
    """
    for batch in iter_frames(path, **batch_options):
        cols = parse_frames(batch)
        if stats is not None:
            stats.add(len(batch), cols)
        yield batch, cols


def read_packets(path: str | Path, **batch_options) -> dict[str, np.ndarray]:
    """All RoCE/IB frames of a (small) capture as one dict of columns (see :func:`parse_frames`).

    Memory grows with the capture: use :func:`iter_packets` for large files.
    """
    parts = [cols for _, cols in iter_packets(path, **batch_options)]
    if not parts:
        return _empty(0)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def format_address(addr: np.ndarray) -> str:
    """One 16-byte address row as text: dotted IPv4 for IPv4-mapped addresses, else IPv6/GID."""
    import ipaddress

    a = ipaddress.IPv6Address(bytes(np.asarray(addr, dtype=np.uint8)))
    return str(a.ipv4_mapped) if a.ipv4_mapped is not None else str(a)
