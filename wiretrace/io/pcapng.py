"""pcapng writer: one interface per NIC (its name, nanosecond resolution), Enhanced Packet Blocks.

Layout (IETF draft-ietf-opsawg-pcapng, little-endian): a Section Header Block, one Interface
Description Block per NIC of the cluster (``if_name`` = ``node<N>/mlx5_<k>``, ``if_tsresol`` = 9,
i.e. nanoseconds), then one Enhanced Packet Block per frame on the interface of the NIC that sends
it, so that Wireshark's statistics split traffic by NIC. A file of one NIC (``split="nic"``)
declares that NIC's interface only. Link type 1 (Ethernet) for RoCEv2, 197
(ERF records of type 21) for native InfiniBand.
"""

from __future__ import annotations

import struct

import numpy as np

from ..plan import Plan
from ..topology import Topology
from . import erf as _erf
from .pcap import LINKTYPE_ERF, LINKTYPE_ETHERNET, MAX_SNAPLEN
from .write import Format

SHB_TYPE = 0x0A0D0D0A
IDB_TYPE = 0x00000001
EPB_TYPE = 0x00000006
BYTE_ORDER_MAGIC = 0x1A2B3C4D
OPT_ENDOFOPT, OPT_COMMENT = 0, 1
IF_NAME, IF_DESCRIPTION, IF_TSRESOL = 2, 3, 9
SHB_USERAPPL = 4
EPB = np.dtype([("type", "<u4"), ("total", "<u4"), ("iface", "<u4"), ("ts_high", "<u4"),
                ("ts_low", "<u4"), ("caplen", "<u4"), ("origlen", "<u4")])
"""Enhanced Packet Block fields before the packet data (28 bytes)."""


def _option(code: int, value: bytes) -> bytes:
    pad = (-len(value)) & 3
    return struct.pack("<HH", code, len(value)) + value + b"\0" * pad


def _block(btype: int, body: bytes) -> bytes:
    total = 12 + len(body)
    return struct.pack("<II", btype, total) + body + struct.pack("<I", total)


class Pcapng(Format):
    """pcapng with one Interface Description Block per NIC."""

    name = "pcapng"
    suffixes = (".pcapng",)
    suffix = 3 + 4          # pad to 4 bytes + trailing block length

    def __init__(self, topo: Topology, plan: Plan, snaplen: int):
        super().__init__(topo, plan, snaplen)
        self.ib = plan.transport.kind == "ib"
        self.erf_len = _erf.HEADER.itemsize if self.ib else 0
        self.prefix = EPB.itemsize + self.erf_len

    def file_header(self, nics=None) -> bytes:
        from .. import __version__

        shb = _block(SHB_TYPE, struct.pack("<IHHq", BYTE_ORDER_MAGIC, 1, 0, -1)
                     + _option(SHB_USERAPPL, f"wiretrace {__version__}".encode())
                     + _option(OPT_ENDOFOPT, b""))
        link = LINKTYPE_ERF if self.ib else LINKTYPE_ETHERNET
        snap = self.snaplen + self.erf_len if self.snaplen else MAX_SNAPLEN
        idbs = []
        for nic in (range(self.topo.num_nics) if nics is None else np.asarray(nics).tolist()):
            opts = (_option(IF_NAME, self.topo.nic_name(nic).encode())
                    + _option(IF_DESCRIPTION, self._describe(nic).encode())
                    + _option(IF_TSRESOL, bytes([9])) + _option(OPT_ENDOFOPT, b""))
            idbs.append(_block(IDB_TYPE, struct.pack("<HHI", link, 0, snap) + opts))
        return shb + b"".join(idbs)

    def _describe(self, nic: int) -> str:
        t = self.topo
        if self.ib:
            return f"InfiniBand LID {int(t.nic_lid[nic])}, rail {int(t.nic_rail[nic])}"
        ip = t.ipv4_str(nic) if self.plan.transport.ip_version == 4 else t.ipv6_str(nic)
        return f"RoCEv2 {ip} {t.mac_str(nic)}, rail {int(t.nic_rail[nic])}"

    def finish_records(self, slots, chunk, caplen, origlen) -> np.ndarray:
        n, width = slots.shape
        ts = np.asarray(chunk["ts_ns"], dtype=np.int64).astype(np.uint64)
        data_len = caplen + self.erf_len
        padded = (data_len + 3) & ~3
        total = EPB.itemsize + padded + 4
        h = np.empty(n, dtype=EPB)
        h["type"] = EPB_TYPE
        h["total"] = total
        # interface = the sending NIC (the file's only interface when a file holds one NIC)
        h["iface"] = 0 if self.single_interface else np.asarray(chunk["src_nic"], dtype=np.int64)
        h["ts_high"] = ts >> np.uint64(32)
        h["ts_low"] = ts & np.uint64(0xFFFFFFFF)
        h["caplen"] = data_len
        h["origlen"] = origlen + self.erf_len
        slots[:, :EPB.itemsize] = h.view(np.uint8).reshape(n, EPB.itemsize)
        if self.ib:
            slots[:, EPB.itemsize:self.prefix] = _erf.headers(ts.astype(np.int64), caplen, origlen,
                                                               _erf.TYPE_INFINIBAND, 0)
        flat = slots.reshape(-1)
        rows = np.arange(n, dtype=np.int64) * width
        end = EPB.itemsize + data_len
        for j in range(3):                       # zero padding to 4 bytes
            sel = end + j < EPB.itemsize + padded
            flat[rows[sel] + end[sel] + j] = 0
        tail = np.asarray(total, dtype="<u4").view(np.uint8).reshape(n, 4)
        pos = rows + EPB.itemsize + padded
        for j in range(4):
            flat[pos + j] = tail[:, j]
        return total
