"""ERF (Endace Extensible Record Format) writer: native InfiniBand as ibdump writes it.

Each record is a 16-byte header followed by the frame: timestamp (64-bit little-endian, 32.32
fixed point seconds), type (21 = InfiniBand; 2 = Ethernet, which adds 2 bytes of offset/pad before
the frame), flags (0x04: variable-length record), record length (big-endian, header included),
loss counter, wire length (big-endian). A ``.erf`` file is records back to back with no file header
(Endace "ERF Types" reference, Wireshark ``wiretap/erf.c``). The same records under pcap link type
197 are what :mod:`wiretrace.io.pcap` writes for native IB.
"""

from __future__ import annotations

import numpy as np

from ..plan import Plan
from ..topology import Topology
from .write import Format

TYPE_ETH = 2
TYPE_INFINIBAND = 21
FLAG_VLEN = 0x04
HEADER = np.dtype([("ts", "<u8"), ("type", "u1"), ("flags", "u1"), ("rlen", ">u2"),
                   ("lctr", ">u2"), ("wlen", ">u2")])
"""ERF record header (16 bytes)."""
ETH_PAD = 2


def timestamps(ts_ns: np.ndarray) -> np.ndarray:
    """ns -> ERF 32.32 fixed-point seconds (fraction rounded to nearest)."""
    ts = np.asarray(ts_ns, dtype=np.int64)
    whole = ts // 1_000_000_000
    sec = whole.astype(np.uint64)
    ns = (ts - whole * 1_000_000_000).astype(np.uint64)
    frac = ((ns << np.uint64(32)) + np.uint64(500_000_000)) // np.uint64(1_000_000_000)
    carry = frac >> np.uint64(32)
    return ((sec + carry) << np.uint64(32)) | (frac & np.uint64(0xFFFFFFFF))


def headers(ts_ns, caplen, origlen, erf_type: int, extra: int) -> np.ndarray:
    """``(n, 16)`` uint8 ERF headers for frames of ``caplen``/``origlen`` bytes; ``extra`` bytes
    (the Ethernet pad) sit between header and frame."""
    n = len(caplen)
    h = np.zeros(n, dtype=HEADER)
    h["ts"] = timestamps(ts_ns)
    h["type"] = erf_type
    h["flags"] = FLAG_VLEN
    h["rlen"] = np.asarray(caplen, dtype=np.int64) + HEADER.itemsize + extra
    h["wlen"] = np.minimum(np.asarray(origlen, dtype=np.int64), 0xFFFF)
    return h.view(np.uint8).reshape(n, HEADER.itemsize)


class Erf(Format):
    """ERF records: type 21 for native InfiniBand, type 2 for RoCEv2 Ethernet frames."""

    name = "erf"
    suffixes = (".erf",)

    def __init__(self, topo: Topology, plan: Plan, snaplen: int):
        super().__init__(topo, plan, snaplen)
        self.ib = plan.transport.kind == "ib"
        self.extra = 0 if self.ib else ETH_PAD
        self.prefix = HEADER.itemsize + self.extra

    def finish_records(self, slots, chunk, caplen, origlen) -> np.ndarray:
        ts = np.asarray(chunk["ts_ns"], dtype=np.int64)
        slots[:, :HEADER.itemsize] = headers(ts, caplen, origlen,
                                             TYPE_INFINIBAND if self.ib else TYPE_ETH, self.extra)
        if self.extra:
            slots[:, HEADER.itemsize:self.prefix] = 0
        return caplen + self.prefix
