"""Wire headers of RoCEv2 and native InfiniBand, each declared once as (field, bits, default).

Every header below is a table of fields in wire order, most significant bit first, the way dpkt
declares ``__hdr__`` and scapy declares ``fields_desc``. From one declaration :class:`Header`
derives both directions, over whole columns at once:

* :meth:`Header.pack` fills an ``(n, length)`` uint8 array from columns: the header is cut into
  big-endian 64/32/16/8-bit words, scalars are folded into each word's constant once, array
  fields are shifted into their words, and each word is stored for all rows at once;
* :meth:`Header.parse` turns an ``(n, >= length)`` uint8 array back into columns.

Field values are unsigned integers. Fields wider than 64 bits (IPv6 addresses, GIDs) and the MAC
addresses may also be given as ``(n, k)`` / ``(k,)`` uint8 arrays or ``bytes``; the parser returns
fields wider than 64 bits as ``(n, k)`` uint8 arrays.

Sources of the layouts: IEEE 802.3 (Ethernet II), IEEE 802.1Q (tag), RFC 791 (IPv4), RFC 8200
(IPv6), RFC 768 (UDP), InfiniBand Architecture Specification vol. 1 release 1.4: LRH 7.7, GRH
8.3, BTH 9.2, RDETH 9.3.1, DETH 9.3.2, RETH 9.3.3, AtomicETH 9.3.4, AETH 9.3.5, AtomicAckETH
9.3.6, ImmDt 9.3.7, IETH 9.3.8, opcodes table 38; RoCEv2 annex A17 (UDP port 4791, ICRC
masking, CNP A17.9.3). The opcode table is built from transport x operation as in scapy's
``scapy/contrib/roce.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

# --------------------------------------------------------------------------------------------
# Constants (one place for the protocol facts)
# --------------------------------------------------------------------------------------------

ETHERTYPE_IPV4 = 0x0800
ETHERTYPE_IPV6 = 0x86DD
ETHERTYPE_VLAN = 0x8100
IP_PROTO_UDP = 17
ROCEV2_UDP_PORT = 4791
"""IANA-assigned UDP destination port of RoCEv2 (IBTA annex A17.2.1)."""
UDP_SPORT_MIN = 0xC000
"""RoCEv2 UDP source ports are drawn from 49152..65535 (Linux ``IB_ROCE_UDP_ENCAP_VALID_PORT_MIN``)."""
DEFAULT_PKEY = 0xFFFF
"""Default partition key, full membership (IBTA 10.9.1.2)."""
GRH_NEXT_HEADER_IBA = 0x1B
"""GRH NxtHdr value announcing an IBA transport header (IBTA 8.3.1)."""
LNH_RAW, LNH_IP_NON_IBA, LNH_BTH, LNH_GRH = 0, 1, 2, 3
"""LRH LNH: 2 = IBA local (BTH follows), 3 = IBA global (GRH follows) (IBTA 7.7.5)."""
PMTU_VALUES = (256, 512, 1024, 2048, 4096)
"""Valid InfiniBand path MTUs in bytes of payload (IBTA 9.7.4.1.1 / ibv_mtu)."""
ICRC_LEN = 4
VCRC_LEN = 2
CNP_PAYLOAD_LEN = 16
"""A RoCEv2 CNP carries 16 reserved bytes after its BTH (IBTA annex A17.9.3)."""


# --------------------------------------------------------------------------------------------
# The declaration machinery
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    """One header field: ``name``, width in ``bits``, ``default`` value, bit ``offset`` from the
    header's first bit (MSB first)."""

    name: str
    bits: int
    default: int | bytes
    offset: int = 0

    @property
    def byte_aligned(self) -> bool:
        return self.offset % 8 == 0 and self.bits % 8 == 0

    @property
    def first_byte(self) -> int:
        return self.offset // 8

    @property
    def last_byte(self) -> int:
        return (self.offset + self.bits - 1) // 8

    @property
    def dtype(self) -> np.dtype:
        """Smallest unsigned NumPy dtype holding the field (uint8 rows for fields > 64 bits)."""
        for t in (np.uint8, np.uint16, np.uint32, np.uint64):
            if self.bits <= np.dtype(t).itemsize * 8:
                return np.dtype(t)
        return np.dtype(np.uint8)


def _big_endian_bytes(v: np.ndarray, k: int) -> np.ndarray:
    """``(n,)`` unsigned integers -> ``(n, k)`` uint8, big-endian, k <= 8."""
    size = 1 if k == 1 else 2 if k == 2 else 4 if k <= 4 else 8
    be = np.asarray(v).astype(f">u{size}", copy=False)
    return be.view(np.uint8).reshape(-1, size)[:, size - k:]


class Header:
    """A header layout declared as ``(name, bits, default)`` rows in wire order.

    Parameters
    ----------
    name : short name (``"bth"``).
    fields : sequence of ``(name, bits, default)``; widths must add up to whole bytes.
    doc : one line saying what the header is and where it is specified.

    Raises
    ------
    ValueError : the widths do not add up to a whole number of bytes.
    """

    def __init__(self, name: str, fields: Sequence[tuple[str, int, int | bytes]], doc: str = ""):
        self.name = name
        self.doc = doc
        out, off = [], 0
        for fname, bits, default in fields:
            out.append(Field(fname, bits, default, off))
            off += bits
        if off % 8:
            raise ValueError(f"header {name}: fields add up to {off} bits, not whole bytes")
        self.fields: tuple[Field, ...] = tuple(out)
        self.by_name = {f.name: f for f in out}
        self.length = off // 8
        self._template_cache: dict = {}
        self._plans: dict = {}

    def __repr__(self) -> str:
        return f"Header({self.name!r}, {self.length} bytes)"

    def __len__(self) -> int:
        return self.length

    # -- writing ------------------------------------------------------------------------------
    def template(self, **values) -> np.ndarray:
        """One packed row ``(length,)`` uint8 from scalar values (defaults for the rest)."""
        row = np.zeros(self.length, dtype=np.uint8)
        self._pack_scalars(row, {f.name: values.get(f.name, f.default) for f in self.fields})
        return row

    def _pack_scalars(self, row: np.ndarray, values: Mapping[str, object]) -> None:
        acc = 0
        for f in self.fields:
            if f.name not in values:
                continue
            v = values[f.name]
            if isinstance(v, (bytes, bytearray, np.ndarray)):
                b = bytes(np.asarray(bytearray(v) if isinstance(v, (bytes, bytearray)) else v,
                                     dtype=np.uint8).reshape(-1))
                if not f.byte_aligned or len(b) != f.bits // 8:
                    raise ValueError(f"{self.name}.{f.name}: expected {f.bits // 8} bytes, got {len(b)}")
                v = int.from_bytes(b, "big")
            v = int(v)
            if v < 0 or v >> f.bits:
                raise ValueError(f"{self.name}.{f.name} = {v} does not fit in {f.bits} bits")
            acc |= v << (self.length * 8 - f.offset - f.bits)
        row |= np.frombuffer(acc.to_bytes(self.length, "big"), dtype=np.uint8)

    def pack(self, n: int, values: Mapping[str, object] | None = None,
             out: np.ndarray | None = None) -> np.ndarray:
        """Pack ``n`` headers from columns.

        Parameters
        ----------
        n : number of rows.
        values : field name -> scalar (int, or bytes for byte-aligned fields) or array: ``(n,)``
            unsigned integers, or ``(n, k)`` uint8 for byte-aligned fields of k bytes (addresses).
            Fields not given take their declared default. Integer arrays are truncated to the
            field width.
        out : optional ``(n, length)`` uint8 array (may be a column slice of a wider frame
            array) to fill in place.

        Returns
        -------
        ``(n, length)`` uint8 array (``out`` when given).

        Raises
        ------
        KeyError : a value names a field the header does not have.
        ValueError : a scalar does not fit its field, or an array has the wrong shape.
        """
        values = dict(values or {})
        unknown = set(values) - set(self.by_name)
        if unknown:
            raise KeyError(f"header {self.name} has no field(s) {sorted(unknown)}")
        scalars, arrays = {}, {}
        for f in self.fields:
            v = values.get(f.name, f.default)
            if isinstance(v, np.ndarray) and v.ndim >= 1 and not (v.ndim == 1 and v.dtype == np.uint8
                                                                 and f.byte_aligned and len(v) == f.bits // 8
                                                                 and f.bits > 64):
                arrays[f.name] = v
            else:
                scalars[f.name] = v
        key = tuple(sorted((k, v if not isinstance(v, np.ndarray) else v.tobytes()) for k, v in scalars.items()))
        tmpl = self._template_cache.get(key)
        if tmpl is None:
            tmpl = np.zeros(self.length, dtype=np.uint8)
            self._pack_scalars(tmpl, scalars)
            if len(self._template_cache) < 256:
                self._template_cache[key] = tmpl
        if out is None:
            out = np.empty((n, self.length), dtype=np.uint8)
        elif out.shape != (n, self.length):
            raise ValueError(f"{self.name}: out has shape {out.shape}, expected {(n, self.length)}")
        for name, v in arrays.items():
            f = self.by_name[name]
            if v.ndim == 2:
                if not f.byte_aligned or v.shape != (n, f.bits // 8):
                    raise ValueError(f"{self.name}.{name}: expected shape {(n, f.bits // 8)}, got {v.shape}")
            elif v.shape != (n,):
                raise ValueError(f"{self.name}.{name}: expected shape {(n,)}, got {v.shape}")
            elif f.bits > 64:
                raise ValueError(f"{self.name}.{name}: a {f.bits}-bit field needs (n, {f.bits // 8}) uint8 rows")
        if n == 0:
            return out
        plan = self._word_plan(tuple((k, v.dtype.itemsize) for k, v in arrays.items() if v.ndim == 1),
                               tuple(k for k, v in arrays.items() if v.ndim == 2))
        wide = out if out.strides[-1] == 1 else None
        as64: dict[str, np.ndarray] = {}
        for start, size, parts in plan:
            if size == 0:                       # a byte field given as (n, k) rows: copy it
                out[:, start:start + parts[1]] = arrays[parts[0]]
                continue
            const = int.from_bytes(tmpl[start:start + size].tobytes(), "big")
            acc = None
            for name, sr, mask, sl, exact in parts:
                v = as64.get(name)
                if v is None:
                    v = as64[name] = np.asarray(arrays[name]).astype(np.uint64, copy=False)
                c = v >> np.uint64(sr) if sr else v
                if not exact:
                    c = c & np.uint64(mask)
                if sl:
                    c = c << np.uint64(sl)
                acc = c if acc is None else (acc | c)
            if acc is not None and const:
                acc = acc | np.uint64(const)
            value = const if acc is None else acc
            if size == 1:
                out[:, start] = value if acc is None else value.astype(np.uint8)
            elif wide is not None:
                out[:, start:start + size].view(f">u{size}")[:, 0] = value
            else:
                out[:, start:start + size] = _big_endian_bytes(np.broadcast_to(np.uint64(value), (n,))
                                                               if acc is None else value, size)
        return out

    def _word_plan(self, ints: tuple, rows: tuple) -> list:
        """How :meth:`pack` writes: big-endian words (8, 4, 2 or 1 bytes) covering the header,
        each with the (shift right, mask, shift left) of every array field bit range inside it;
        ``size == 0`` entries copy a field given as byte rows."""
        key = (ints, rows)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        plan = []
        skip = {}
        for name in rows:
            f = self.by_name[name]
            skip[f.first_byte] = (name, f.bits // 8)
        b = 0
        runs = []
        while b < self.length:
            if b in skip:
                plan.append((b, 0, skip[b]))
                b += skip[b][1]
                continue
            e = b
            while e < self.length and e not in skip:
                e += 1
            runs.append((b, e))
            b = e
        for b, e in runs:
            while b < e:
                size = next(s for s in (8, 4, 2, 1) if b + s <= e)
                w0, w1 = 8 * b, 8 * (b + size)
                parts = []
                for name, itemsize in ints:
                    f = self.by_name[name]
                    f0, f1 = f.offset, f.offset + f.bits
                    lo, hi = max(w0, f0), min(w1, f1)
                    if lo >= hi:
                        continue
                    ln = hi - lo
                    sr, sl = f1 - hi, w1 - hi
                    # exact: the whole field lies in this word and its dtype holds nothing more
                    exact = f0 >= w0 and f1 <= w1 and f.bits == 8 * itemsize
                    parts.append((name, sr, (1 << ln) - 1, sl, exact))
                plan.append((b, size, parts))
                b += size
        self._plans[key] = plan
        return plan

    # -- reading ------------------------------------------------------------------------------
    def parse(self, buf: np.ndarray, offset: int | np.ndarray = 0,
              names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Read columns from packed rows.

        Parameters
        ----------
        buf : ``(n, m)`` uint8, each row holding this header at ``offset``.
        offset : byte offset of the header in every row (int) or per row (``(n,)`` ints).
        names : the fields to read (default all).

        Returns
        -------
        dict field -> ``(n,)`` array of :attr:`Field.dtype`, or ``(n, k)`` uint8 for fields
        wider than 64 bits.

        Raises
        ------
        ValueError : rows are too short for the header at ``offset``.
        """
        buf = np.asarray(buf, dtype=np.uint8)
        n = buf.shape[0]
        if not np.isscalar(offset):
            off = np.asarray(offset, dtype=np.int64)
            if n and int(off.max()) + self.length > buf.shape[1]:
                raise ValueError(f"{self.name}: rows of {buf.shape[1]} bytes are too short at offset {int(off.max())}")
            buf = buf[np.arange(n)[:, None], off[:, None] + np.arange(self.length)]
            offset = 0
        offset = int(offset)
        if offset + self.length > buf.shape[1]:
            raise ValueError(f"{self.name}: rows of {buf.shape[1]} bytes are too short for "
                             f"{self.length} bytes at offset {offset}")
        out = {}
        for f in self.fields:
            if names is not None and f.name not in names:
                continue
            b0, b1 = offset + f.first_byte, offset + f.last_byte + 1
            if f.bits > 64:
                out[f.name] = np.ascontiguousarray(buf[:, b0:b1])
                continue
            span = b1 - b0
            acc = np.zeros(n, dtype=np.uint64)
            for b in range(b0, b1):
                acc = (acc << np.uint64(8)) | buf[:, b].astype(np.uint64)
            shift = span * 8 - (f.offset - 8 * f.first_byte) - f.bits
            val = (acc >> np.uint64(shift)) & np.uint64((1 << f.bits) - 1) if (shift or f.bits % 8) else acc
            out[f.name] = val.astype(f.dtype)
        return out


# --------------------------------------------------------------------------------------------
# The headers (wire order, MSB first). Defaults are what wiretrace puts on the wire.
# --------------------------------------------------------------------------------------------

ETHERNET = Header("eth", [
    ("dst", 48, 0),                     # destination MAC
    ("src", 48, 0),                     # source MAC
    ("type", 16, ETHERTYPE_IPV4),       # EtherType
], "Ethernet II header (IEEE 802.3), 14 bytes, no FCS")

DOT1Q = Header("vlan", [
    ("pcp", 3, 0),                      # priority code point (802.1p), PFC priority
    ("dei", 1, 0),                      # drop eligible indicator
    ("vid", 12, 0),                     # VLAN id
    ("type", 16, ETHERTYPE_IPV4),       # EtherType of what follows
], "IEEE 802.1Q tag after the source MAC (TPID 0x8100 is the Ethernet type before it), 4 bytes")

IPV4 = Header("ipv4", [
    ("version", 4, 4),
    ("ihl", 4, 5),                      # header length in 32-bit words (no options)
    ("dscp", 6, 26),                    # RoCE default traffic class 26 (ConnectX, NCCL_IB_TC=106)
    ("ecn", 2, 2),                      # ECT(0)
    ("total_length", 16, 0),            # bytes from this header through the ICRC
    ("id", 16, 0),
    ("flags", 3, 0b010),                # DF set, as RoCEv2 NICs send
    ("frag_offset", 13, 0),
    ("ttl", 8, 64),
    ("proto", 8, IP_PROTO_UDP),
    ("checksum", 16, 0),                # RFC 1071 one's complement over the header
    ("src", 32, 0),
    ("dst", 32, 0),
], "IPv4 header without options (RFC 791), 20 bytes")

IPV6 = Header("ipv6", [
    ("version", 4, 6),
    ("dscp", 6, 26),                    # traffic class, upper 6 bits
    ("ecn", 2, 2),                      # traffic class, lower 2 bits
    ("flow_label", 20, 0),
    ("payload_length", 16, 0),          # bytes after this header through the ICRC
    ("next_header", 8, IP_PROTO_UDP),
    ("hop_limit", 8, 64),
    ("src", 128, 0),
    ("dst", 128, 0),
], "IPv6 fixed header (RFC 8200), 40 bytes")

UDP = Header("udp", [
    ("sport", 16, UDP_SPORT_MIN),
    ("dport", 16, ROCEV2_UDP_PORT),
    ("length", 16, 0),                  # bytes from this header through the ICRC
    ("checksum", 16, 0),                # RoCEv2 senders leave it 0 (annex A17.4.2)
], "UDP header (RFC 768), 8 bytes")

LRH = Header("lrh", [
    ("vl", 4, 0),                       # virtual lane
    ("lver", 4, 0),                     # link version
    ("sl", 4, 0),                       # service level
    ("resv2", 2, 0),
    ("lnh", 2, LNH_BTH),                # link next header: 2 BTH, 3 GRH
    ("dlid", 16, 0),
    ("resv5", 5, 0),
    ("pktlen", 11, 0),                  # 4-byte words from LRH through ICRC (VCRC excluded)
    ("slid", 16, 0),
], "InfiniBand Local Route Header (IBTA 7.7), 8 bytes")

GRH = Header("grh", [
    ("ipver", 4, 6),
    ("tclass", 8, 0),
    ("flow_label", 20, 0),
    ("paylen", 16, 0),                  # bytes after the GRH through the ICRC
    ("nxthdr", 8, GRH_NEXT_HEADER_IBA),
    ("hoplmt", 8, 64),
    ("sgid", 128, 0),
    ("dgid", 128, 0),
], "InfiniBand Global Route Header (IBTA 8.3), 40 bytes, laid out like IPv6")

BTH = Header("bth", [
    ("opcode", 8, 0),
    ("se", 1, 0),                       # solicited event
    ("migreq", 1, 1),                   # MigReq: 1 = migrated/no APM, as ConnectX sends
    ("padcnt", 2, 0),                   # pad bytes after the payload (0..3)
    ("tver", 4, 0),                     # transport header version
    ("pkey", 16, DEFAULT_PKEY),
    ("fecn", 1, 0),                     # forward ECN (IB only; RoCEv2 uses IP ECN)
    ("becn", 1, 0),                     # backward ECN (set in CNPs)
    ("resv6", 6, 0),
    ("destqp", 24, 0),
    ("ackreq", 1, 0),
    ("resv7", 7, 0),
    ("psn", 24, 0),
], "Base Transport Header (IBTA 9.2), 12 bytes")

RDETH = Header("rdeth", [
    ("resv8", 8, 0),
    ("ee_context", 24, 0),
], "Reliable Datagram Extended Transport Header (IBTA 9.3.1), 4 bytes")

DETH = Header("deth", [
    ("qkey", 32, 0),
    ("resv8", 8, 0),
    ("srcqp", 24, 0),
], "Datagram Extended Transport Header (IBTA 9.3.2), 8 bytes")

RETH = Header("reth", [
    ("va", 64, 0),                      # remote virtual address
    ("rkey", 32, 0),                    # remote key
    ("dmalen", 32, 0),                  # DMA length: bytes of the whole RDMA operation
], "RDMA Extended Transport Header (IBTA 9.3.3), 16 bytes")

ATOMICETH = Header("atomiceth", [
    ("va", 64, 0),
    ("rkey", 32, 0),
    ("swap_add", 64, 0),
    ("compare", 64, 0),
], "Atomic Extended Transport Header (IBTA 9.3.4), 28 bytes")

AETH = Header("aeth", [
    ("syndrome", 8, 0),                 # 0b0 00 CCCCC = ACK with credit count CCCCC
    ("msn", 24, 0),                     # message sequence number of the last completed message
], "ACK Extended Transport Header (IBTA 9.3.5), 4 bytes")

ATOMICACKETH = Header("atomicacketh", [
    ("orig_data", 64, 0),
], "Atomic ACK Extended Transport Header (IBTA 9.3.6), 8 bytes")

IMMDT = Header("immdt", [
    ("imm", 32, 0),
], "Immediate Data Extended Transport Header (IBTA 9.3.7), 4 bytes")

IETH = Header("ieth", [
    ("rkey", 32, 0),
], "Invalidate Extended Transport Header (IBTA 9.3.8), 4 bytes")

CNP = Header("cnp", [
    ("reserved", 128, 0),
], "RoCEv2 Congestion Notification Packet payload: 16 reserved bytes (IBTA annex A17.9.3)")

HEADERS = {h.name: h for h in (ETHERNET, DOT1Q, IPV4, IPV6, UDP, LRH, GRH, BTH, RDETH, DETH, RETH,
                               ATOMICETH, AETH, ATOMICACKETH, IMMDT, IETH, CNP)}
"""Every declared header by name."""


# --------------------------------------------------------------------------------------------
# BTH opcodes: transport (upper 3 bits) x operation (lower 5 bits), IBTA vol. 1 table 38
# --------------------------------------------------------------------------------------------

TRANSPORTS = {"RC": 0x00, "UC": 0x20, "RD": 0x40, "UD": 0x60, "CNP": 0x80}

# operation -> (code, extension headers after BTH in wire order, carries payload)
OPERATIONS: dict[str, tuple[int, tuple[str, ...], bool]] = {
    "SEND_FIRST": (0x00, (), True),
    "SEND_MIDDLE": (0x01, (), True),
    "SEND_LAST": (0x02, (), True),
    "SEND_LAST_WITH_IMMEDIATE": (0x03, ("immdt",), True),
    "SEND_ONLY": (0x04, (), True),
    "SEND_ONLY_WITH_IMMEDIATE": (0x05, ("immdt",), True),
    "RDMA_WRITE_FIRST": (0x06, ("reth",), True),
    "RDMA_WRITE_MIDDLE": (0x07, (), True),
    "RDMA_WRITE_LAST": (0x08, (), True),
    "RDMA_WRITE_LAST_WITH_IMMEDIATE": (0x09, ("immdt",), True),
    "RDMA_WRITE_ONLY": (0x0A, ("reth",), True),
    "RDMA_WRITE_ONLY_WITH_IMMEDIATE": (0x0B, ("reth", "immdt"), True),
    "RDMA_READ_REQUEST": (0x0C, ("reth",), False),
    "RDMA_READ_RESPONSE_FIRST": (0x0D, ("aeth",), True),
    "RDMA_READ_RESPONSE_MIDDLE": (0x0E, (), True),
    "RDMA_READ_RESPONSE_LAST": (0x0F, ("aeth",), True),
    "RDMA_READ_RESPONSE_ONLY": (0x10, ("aeth",), True),
    "ACKNOWLEDGE": (0x11, ("aeth",), False),
    "ATOMIC_ACKNOWLEDGE": (0x12, ("aeth", "atomicacketh"), False),
    "COMPARE_SWAP": (0x13, ("atomiceth",), False),
    "FETCH_ADD": (0x14, ("atomiceth",), False),
    "SEND_LAST_WITH_INVALIDATE": (0x16, ("ieth",), True),
    "SEND_ONLY_WITH_INVALIDATE": (0x17, ("ieth",), True),
}

_VALID_OPS = {
    "RC": tuple(OPERATIONS),
    "UC": ("SEND_FIRST", "SEND_MIDDLE", "SEND_LAST", "SEND_LAST_WITH_IMMEDIATE", "SEND_ONLY",
           "SEND_ONLY_WITH_IMMEDIATE", "RDMA_WRITE_FIRST", "RDMA_WRITE_MIDDLE", "RDMA_WRITE_LAST",
           "RDMA_WRITE_LAST_WITH_IMMEDIATE", "RDMA_WRITE_ONLY", "RDMA_WRITE_ONLY_WITH_IMMEDIATE"),
    "RD": tuple(k for k in OPERATIONS if "INVALIDATE" not in k),
    "UD": ("SEND_ONLY", "SEND_ONLY_WITH_IMMEDIATE"),
}
# RD packets carry RDETH + DETH before the operation's headers; UD carries DETH (IBTA 9.2, table 38)
_TRANSPORT_PREFIX = {"RC": (), "UC": (), "RD": ("rdeth", "deth"), "UD": ("deth",)}

CNP_OPCODE = 0x81
"""RoCEv2 Congestion Notification Packet opcode (IBTA annex A17.9.3)."""


@dataclass(frozen=True)
class Opcode:
    """A BTH opcode: its number, name (``RC_RDMA_WRITE_FIRST``), the extension headers that follow
    the BTH in wire order, and whether a payload follows them."""

    code: int
    name: str
    transport: str
    operation: str
    ext: tuple[str, ...]
    payload: bool

    @property
    def ext_len(self) -> int:
        """Bytes of extension headers between BTH and payload."""
        return sum(HEADERS[h].length for h in self.ext)


def _build_opcodes() -> dict[int, Opcode]:
    table = {}
    for tname, tbase in TRANSPORTS.items():
        for op in _VALID_OPS.get(tname, ()):
            code, ext, payload = OPERATIONS[op]
            table[tbase + code] = Opcode(tbase + code, f"{tname}_{op}", tname, op,
                                         _TRANSPORT_PREFIX[tname] + ext, payload)
    table[CNP_OPCODE] = Opcode(CNP_OPCODE, "CNP", "CNP", "CNP", ("cnp",), False)
    return table


OPCODES: dict[int, Opcode] = _build_opcodes()
"""BTH opcode number -> :class:`Opcode`, for every opcode of IBTA table 38 plus the RoCEv2 CNP."""
OPCODE_BY_NAME: dict[str, int] = {o.name: c for c, o in OPCODES.items()}
"""``"RC_RDMA_WRITE_FIRST"`` -> 0x06, and so on."""


def opcode(name: str) -> int:
    """The BTH opcode number of ``name`` (e.g. ``"RC_ACKNOWLEDGE"`` -> 0x11).

    Raises
    ------
    KeyError : unknown opcode name.
    """
    try:
        return OPCODE_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown BTH opcode {name!r}") from None


EXT_LEN = np.zeros(256, dtype=np.int16)
"""Bytes of extension headers after the BTH for every opcode number (0 for unknown ones)."""
HAS_PAYLOAD = np.zeros(256, dtype=bool)
"""Whether an opcode carries a payload after its extension headers (CNP: its 16 reserved bytes
are counted as extension header, not payload)."""
KNOWN_OPCODE = np.zeros(256, dtype=bool)
for _c, _o in OPCODES.items():
    EXT_LEN[_c] = _o.ext_len
    HAS_PAYLOAD[_c] = _o.payload
    KNOWN_OPCODE[_c] = True
del _c, _o


# --------------------------------------------------------------------------------------------
# Helpers shared by writer and parser
# --------------------------------------------------------------------------------------------

def ipv4_checksum(hdr: np.ndarray) -> np.ndarray:
    """RFC 1071 header checksum of ``(n, 20)`` IPv4 headers (checksum field read as zero).

    Returns ``(n,)`` uint16: the value to store in the checksum field (big-endian on the wire).
    A header whose stored checksum is correct gives 0 when summed including its checksum field,
    which :func:`ipv4_checksum_ok` uses.
    """
    words = np.ascontiguousarray(hdr[:, :20]).view(">u2").astype(np.uint32)
    s = words.sum(axis=1) - words[:, 5]
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return (~s & 0xFFFF).astype(np.uint16)


def ipv4_checksum_ok(hdr: np.ndarray) -> np.ndarray:
    """``(n,)`` bool: whether each ``(n, >=20)`` IPv4 header's stored checksum is correct."""
    words = np.ascontiguousarray(hdr[:, :20]).view(">u2").astype(np.uint32)
    s = words.sum(axis=1)
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return s == 0xFFFF


def udp_checksum_ipv4(ip_udp: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """RFC 768 UDP checksum over the IPv4 pseudo-header, UDP header and data.

    ``ip_udp`` is ``(n, L)`` uint8 starting at a 20-byte IPv4 header; ``lengths`` the bytes of
    each row from the IP header through the end of the UDP data (default ``L``). The stored
    checksum field is read as zero. RoCEv2 senders put 0 here (annex A17.4.2); this exists to
    rebuild foreign frames that carry one. Returns ``(n,)`` uint16 (0 is sent as 0xFFFF).
    """
    ip_udp = np.asarray(ip_udp, dtype=np.uint8)
    n, width = ip_udp.shape
    lengths = np.full(n, width) if lengths is None else np.asarray(lengths, dtype=np.int64)
    data = np.where(np.arange(width)[None, :] < lengths[:, None], ip_udp, 0).astype(np.uint8)
    data[:, 26:28] = 0
    if width % 2:
        data = np.pad(data, ((0, 0), (0, 1)))
    words = data.view(">u2").astype(np.uint64)
    s = words[:, 10:].sum(axis=1)                       # UDP header + data
    s += words[:, 6:10].sum(axis=1)                     # source and destination address
    s += IP_PROTO_UDP + (lengths - 20).astype(np.uint64)
    while (s >> 16).any():
        s = (s & 0xFFFF) + (s >> 16)
    c = (~s & 0xFFFF).astype(np.uint16)
    c[c == 0] = 0xFFFF
    return c


def pad_count(payload_len: np.ndarray) -> np.ndarray:
    """BTH PadCnt: bytes that round ``payload_len`` up to a multiple of 4 (IBTA 9.2.4)."""
    return ((-np.asarray(payload_len)) & 3).astype(np.uint8)


__all__ = [
    "Field", "Header", "HEADERS", "ETHERNET", "DOT1Q", "IPV4", "IPV6", "UDP", "LRH", "GRH", "BTH",
    "RDETH", "DETH", "RETH", "ATOMICETH", "AETH", "ATOMICACKETH", "IMMDT", "IETH", "CNP",
    "Opcode", "OPCODES", "OPCODE_BY_NAME", "TRANSPORTS", "OPERATIONS", "opcode", "CNP_OPCODE",
    "EXT_LEN", "HAS_PAYLOAD", "KNOWN_OPCODE", "ipv4_checksum", "ipv4_checksum_ok", "udp_checksum_ipv4",
    "pad_count",
    "ETHERTYPE_IPV4", "ETHERTYPE_IPV6", "ETHERTYPE_VLAN", "IP_PROTO_UDP", "ROCEV2_UDP_PORT",
    "UDP_SPORT_MIN", "DEFAULT_PKEY", "GRH_NEXT_HEADER_IBA", "LNH_BTH", "LNH_GRH", "PMTU_VALUES",
    "ICRC_LEN", "VCRC_LEN", "CNP_PAYLOAD_LEN",
]
