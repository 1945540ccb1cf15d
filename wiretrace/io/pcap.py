"""pcap writer with nanosecond timestamps (magic 0xA1B23C4D).

File header (24 bytes, written little-endian): magic, version 2.4, thiszone 0, sigfigs 0, snaplen,
link type; each record: a 16-byte header (seconds, nanoseconds, captured length, original length)
then the captured bytes (tcpdump's pcap-savefile(5); IETF draft-ietf-opsawg-pcap). RoCEv2 frames
use link type 1 (Ethernet). Native InfiniBand frames are wrapped in ERF type 21 records under link
type 197 (LINKTYPE_ERF): Wireshark 4.0 does not dissect link type 247 (LINKTYPE_INFINIBAND).

Timestamps are ``ts_ns`` from the start of the iteration, i.e. they start at the Unix epoch.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..plan import Plan
from ..topology import Topology
from . import erf as _erf
from .write import Format, write_capture

MAGIC_NS = 0xA1B23C4D
LINKTYPE_ETHERNET = 1
LINKTYPE_ERF = 197
RECORD = np.dtype([("ts_sec", "<u4"), ("ts_nsec", "<u4"), ("incl_len", "<u4"), ("orig_len", "<u4")])
"""pcap record header."""
FILE_HEADER = struct.Struct("<IHHiIII")
"""magic, version major, minor, thiszone, sigfigs, snaplen, link type."""
MAX_SNAPLEN = 262144


class Pcap(Format):
    """Nanosecond pcap: Ethernet for RoCEv2, ERF-in-pcap (type 21) for native InfiniBand."""

    name = "pcap"
    suffixes = (".pcap",)

    def __init__(self, topo: Topology, plan: Plan, snaplen: int):
        super().__init__(topo, plan, snaplen)
        self.ib = plan.transport.kind == "ib"
        self.erf_len = _erf.HEADER.itemsize if self.ib else 0
        self.prefix = RECORD.itemsize + self.erf_len

    def file_header(self, nics=None) -> bytes:
        snap = self.snaplen + self.erf_len if self.snaplen else MAX_SNAPLEN
        return FILE_HEADER.pack(MAGIC_NS, 2, 4, 0, 0, snap, LINKTYPE_ERF if self.ib else LINKTYPE_ETHERNET)

    def finish_records(self, slots, chunk, caplen, origlen) -> np.ndarray:
        n = len(caplen)
        ts = np.asarray(chunk["ts_ns"], dtype=np.int64)
        # the record header as two little-endian 64-bit words per row: (seconds, nanoseconds)
        # and (captured length, original length)
        s0, s1 = (int(ts.min()) // 1_000_000_000, int(ts.max()) // 1_000_000_000) if n else (0, 0)
        # one second for the whole chunk (most chunks): a scalar, no division per row
        sec = np.int64(s0) if s0 == s1 else ts // 1_000_000_000   # (np.divmod is several times slower)
        if slots.strides[-1] == 1:
            # in place, without temporaries: nanoseconds << 32 | seconds, origlen << 32 | caplen
            w0 = ts - sec * 1_000_000_000
            w0 <<= 32
            w0 |= sec
            w1 = np.asarray(origlen, dtype=np.int64) + self.erf_len
            w1 <<= 32
            w1 |= np.asarray(caplen, dtype=np.int64) + self.erf_len
            slots[:, 0:8].view("<i8")[:, 0] = w0
            slots[:, 8:16].view("<i8")[:, 0] = w1
        else:
            hdr = np.empty(n, dtype=RECORD)
            hdr["ts_sec"], hdr["ts_nsec"] = sec, ts - sec * 1_000_000_000
            hdr["incl_len"], hdr["orig_len"] = caplen + self.erf_len, origlen + self.erf_len
            slots[:, :RECORD.itemsize] = hdr.view(np.uint8).reshape(n, RECORD.itemsize)
        if self.ib:
            slots[:, RECORD.itemsize:self.prefix] = _erf.headers(ts, caplen, origlen, _erf.TYPE_INFINIBAND, 0)
        return caplen + self.prefix


def write(path: str | Path, packet_chunks: Iterable[dict], topo: Topology, plan: Plan,
          snaplen: int = 128, progress: Callable[[int], None] | None = None) -> dict:
    """Write a nanosecond pcap of the packets, streaming chunk by chunk.

    Parameters
    ----------
    path : output file (written to a temporary name, renamed when complete).
    packet_chunks : time-ordered packets-table chunks (:func:`wiretrace.transport.packetize`).
    topo, plan : addresses and transport settings for rendering.
    snaplen : bytes kept per frame (0: whole frames); the original length is recorded.
    progress : called with the packets written so far after each chunk.

    Returns
    -------
    dict ``packets``, ``bytes``, ``files``.
    """
    return write_capture(path, packet_chunks, topo, plan, snaplen, fmt="pcap", progress=progress)
