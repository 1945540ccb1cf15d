"""ICRC (CRC-32) and VCRC (CRC-16) of many frames at once.

Both CRCs are reflected, table-driven CRCs (RoCEv2/IB ICRC: the Ethernet CRC-32, polynomial
0x04C11DB7, the value ``zlib.crc32`` computes; IB VCRC: polynomial 0x100B, initial value 0xFFFF,
final complement; IBTA vol. 1 sections 7.8.1 and 7.8.2). They are computed over whole columns:
one table look-up per byte *position* for all rows together, never a loop over frames.

CRCs are linear over GF(2), which gives the two speed-ups used here:

* the register after ``k`` zero bytes is a linear function of the register before them, applied
  with four 256-entry tables (:meth:`Crc.shift`), so a constant tail (the deterministic payload
  of a given length, the pad) is folded in with one table application per distinct length
  instead of a pass over its bytes;
* leading or trailing zero bytes can be added or removed exactly, so rows of different lengths
  are processed as one ``(n, max_len)`` array (:meth:`Crc.of_rows`).

ICRC masking (IBTA annex A17.4.1 for RoCEv2, vol. 1 7.8.1 for native IB): the CRC runs over
8 bytes of 0xFF standing for the absent LRH (RoCEv2), then the IP header with IPv4 TOS, TTL and
header checksum (IPv6 traffic class, flow label, hop limit) set to ones, the UDP header with its
checksum set to ones, the BTH with its byte 4 (FECN, BECN, reserved) set to ones, the extension
headers, payload and pad. Native IB masks the LRH VL field (the whole LRH when a GRH follows) and,
when present, GRH traffic class, flow label and hop limit. The 32-bit result is stored least
significant byte first (as scapy's ``BTH.pack_icrc`` and Linux ``rxe_icrc.c`` do).
"""

from __future__ import annotations

import functools
import zlib

import numpy as np



POSITIONAL_MAX_WIDTH = 192
"""Inputs up to this many bytes (headers) use per-position tables; longer ones the byte loop."""



def _byte_tables(images: np.ndarray, nbytes: int) -> np.ndarray:
    """Lookup tables of a GF(2)-linear map on ``8 * nbytes``-bit registers, one per byte.

    ``images[i]`` is the image of input bit ``i``; table ``q`` maps a value of byte ``q`` to the
    XOR of the images of its set bits, so the map of a register is the XOR of ``nbytes`` lookups.
    """
    out = np.zeros((nbytes, 256), dtype=np.uint64)
    v = np.arange(256, dtype=np.uint64)
    for q in range(nbytes):
        for bit in range(8):
            sel = ((v >> np.uint64(bit)) & np.uint64(1)).astype(bool)
            out[q, sel] ^= np.uint64(images[8 * q + bit])
    return out

class Crc:
    """A reflected CRC of ``width`` bits (16 or 32) with polynomial ``poly`` (reflected form),
    ``init`` and ``xorout``; register operations vectorized over rows.

    The *register* ``R(s, data)`` is the CRC state before the final complement; the checksum is
    ``R(init, data) ^ xorout``.
    """

    def __init__(self, width: int, poly_reflected: int, init: int, xorout: int, name: str):
        self.width = width
        self.mask = (1 << width) - 1
        self.init = init
        self.xorout = xorout
        self.name = name
        self.dtype = np.dtype(np.uint32 if width == 32 else np.uint16)
        table = np.zeros(256, dtype=np.uint32)
        for b in range(256):
            c = b
            for _ in range(8):
                c = (c >> 1) ^ poly_reflected if c & 1 else c >> 1
            table[b] = c
        self.table = table.astype(self.dtype)

    # -- scalar reference (plain Python, for tables and tests) ----------------------------------
    def register(self, state: int, data: bytes) -> int:
        """``R(state, data)`` for one byte string (plain Python; used to build tables)."""
        if self.width == 32:
            return zlib.crc32(data, state ^ 0xFFFFFFFF) ^ 0xFFFFFFFF
        t = self.table
        for b in data:
            state = int(t[(state ^ b) & 0xFF]) ^ (state >> 8)
        return state

    def checksum(self, data: bytes) -> int:
        """The CRC of one byte string (``zlib.crc32(data)`` for CRC-32)."""
        return self.register(self.init, bytes(data)) ^ self.xorout

    # -- vectorized register operations ---------------------------------------------------------
    def update(self, state: np.ndarray | int, buf: np.ndarray) -> np.ndarray:
        """Advance registers through the columns of ``buf``.

        Parameters
        ----------
        state : ``(n,)`` registers (or one int for all rows).
        buf : ``(n, L)`` uint8, each row fed in full.

        Returns
        -------
        ``(n,)`` registers of :attr:`dtype`.
        """
        buf = np.asarray(buf, dtype=np.uint8)
        n, width = buf.shape
        if np.ndim(state) == 0 and n > 16 and 0 < width <= POSITIONAL_MAX_WIDTH:
            return self._update_positional(int(state), buf)
        s = np.empty(n, dtype=self.dtype)
        s[...] = state
        t = self.table
        eight = self.dtype.type(8)
        for j in range(width):
            s = t[(s ^ buf[:, j]) & 0xFF] ^ (s >> eight)
        return s

    def _update_positional(self, state: int, buf: np.ndarray) -> np.ndarray:
        """:meth:`update` from one initial register for all rows, by linearity: the register
        after ``L`` bytes is the initial register shifted through ``L`` zero bytes XOR the
        contribution of each byte at its position, read from a per-position table. A column
        holding one value in every row contributes a constant, computed once."""
        n, width = buf.shape
        pos = self._position_tables(width)
        const = self.shift(np.array([state], dtype=self.dtype), width)[0]
        same = (buf == buf[0]).all(axis=0)
        cj = np.flatnonzero(same)
        if len(cj):
            const ^= np.bitwise_xor.reduce(pos[cj, buf[0, cj]])
        vj = np.flatnonzero(~same)
        if not len(vj):
            return np.full(n, const, dtype=self.dtype)
        return np.bitwise_xor.reduce(pos[vj, buf[:, vj]], axis=1) ^ const

    @functools.lru_cache(maxsize=64)
    def _position_tables(self, width: int) -> np.ndarray:
        """``(width, 256)``: register contribution of byte value ``b`` at position ``j`` of a
        ``width``-byte input started from a zero register, ``R(0, b)`` shifted through the
        ``width - 1 - j`` bytes after it."""
        out = np.empty((width, 256), dtype=self.dtype)
        for j in range(width):
            out[j] = self.shift(self.table, width - 1 - j)
        return out

    @functools.lru_cache(maxsize=512)
    def _shift_tables(self, k: int) -> np.ndarray:
        """``(W/8, 256)`` tables of the linear map 'advance the register through k zero bytes'."""
        nb = self.width // 8
        zeros = bytes(k)
        base = self.register(0, zeros)  # 0: linear part only
        basis = np.array([self.register(1 << i, zeros) ^ base for i in range(self.width)],
                         dtype=np.uint64)
        return _byte_tables(basis, nb).astype(self.dtype)

    @functools.lru_cache(maxsize=512)
    def _unshift_tables(self, k: int) -> np.ndarray:
        """Tables of the inverse map: remove ``k`` trailing zero bytes from a register."""
        fwd = self._shift_tables(k)
        w = self.width
        cols = [int(fwd[i // 8][1 << (i % 8)]) for i in range(w)]   # image of each basis bit
        # Solve M X = I over GF(2): Gaussian elimination on augmented rows (bit-matrix as ints).
        # Row r of M (as a w-bit int over input bits): bit i set if output bit r depends on input i.
        rows = [sum(((cols[i] >> r) & 1) << i for i in range(w)) for r in range(w)]
        aug = [(rows[r], 1 << r) for r in range(w)]
        for col in range(w):
            piv = next(r for r in range(col, w) if (aug[r][0] >> col) & 1)
            aug[col], aug[piv] = aug[piv], aug[col]
            for r in range(w):
                if r != col and (aug[r][0] >> col) & 1:
                    aug[r] = (aug[r][0] ^ aug[col][0], aug[r][1] ^ aug[col][1])
        # aug[i][1] is row i of M^-1 (which output bits of the shifted register form input bit i)
        inv_rows = [aug[i][1] for i in range(w)]
        inv_cols = [sum(((inv_rows[r] >> i) & 1) << r for r in range(w)) for i in range(w)]
        return _byte_tables(np.array(inv_cols, dtype=np.uint64), w // 8).astype(self.dtype)

    def _apply(self, tables: np.ndarray, s: np.ndarray) -> np.ndarray:
        out = tables[0][s & 0xFF]
        for q in range(1, tables.shape[0]):
            out = out ^ tables[q][(s >> self.dtype.type(8 * q)) & 0xFF]
        return out

    def shift(self, state: np.ndarray, k: int | np.ndarray, inverse: bool = False) -> np.ndarray:
        """Advance registers through ``k`` zero bytes (``inverse``: undo ``k`` zero bytes).

        ``k`` is one int or ``(n,)`` ints; rows are grouped by distinct ``k``.
        """
        state = np.asarray(state, dtype=self.dtype)
        get = self._unshift_tables if inverse else self._shift_tables
        if np.isscalar(k) or np.ndim(k) == 0:
            k = int(k)
            return state.copy() if k == 0 else self._apply(get(k), state)
        k = np.asarray(k, dtype=np.int64)
        if len(k) and (k == k[0]).all():                 # one shift for every row (common)
            return self.shift(state, int(k[0]), inverse)
        out = state.copy()
        ks, inv = np.unique(k, return_inverse=True)
        for i, kk in enumerate(ks):
            if kk == 0:
                continue
            sel = inv == i
            out[sel] = self._apply(get(int(kk)), state[sel])
        return out

    def of_rows(self, buf: np.ndarray, lengths: np.ndarray | None = None,
                state: int | None = None) -> np.ndarray:
        """Registers ``R(state, row[:length])`` of every row (state defaults to ``init``).

        Parameters
        ----------
        buf : ``(n, L)`` uint8.
        lengths : ``(n,)`` bytes of each row to use (default all ``L``).
        state : initial register (default :attr:`init`).

        Returns
        -------
        ``(n,)`` registers (apply ``^ xorout`` for the checksum).
        """
        buf = np.asarray(buf, dtype=np.uint8)
        n, width = buf.shape
        s0 = self.init if state is None else state
        if lengths is None:
            return self.update(s0, buf)
        lengths = np.asarray(lengths, dtype=np.int64)
        # Zero the bytes past each row's length, run from 0, then remove the trailing zeros and
        # add the initial value's contribution (both linear).
        masked = np.where(np.arange(width)[None, :] < lengths[:, None], buf, 0).astype(np.uint8)
        r = self.update(0, masked)
        r = self.shift(r, width - lengths, inverse=True)
        init_part = self.shift(np.full(n, s0, dtype=self.dtype), lengths)
        return r ^ init_part


CRC32 = Crc(32, 0xEDB88320, 0xFFFFFFFF, 0xFFFFFFFF, "crc32")
"""The Ethernet/zlib CRC-32 used by the ICRC."""
CRC16_VCRC = Crc(16, 0xD008, 0xFFFF, 0xFFFF, "vcrc16")
"""InfiniBand VCRC: CRC-16, polynomial 0x100B (reflected 0xD008), init 0xFFFF, final complement."""

PSEUDO_LRH = b"\xff" * 8
"""RoCEv2 ICRC: eight bytes of ones stand for the LRH that RoCEv2 does not carry."""
_STATE_AFTER_PSEUDO_LRH = CRC32.register(CRC32.init, PSEUDO_LRH)


@functools.lru_cache(maxsize=4096)
def _tail_register_cached(crc_name: str, key: bytes, k: int, pad: int) -> int:
    crc = CRC32 if crc_name == "crc32" else CRC16_VCRC
    return crc.register(0, key[:k] + bytes(pad))


def tail_register(crc: Crc, pattern: np.ndarray, payload_len: np.ndarray, pad: np.ndarray) -> np.ndarray:
    """``R(0, pattern[:payload_len] + pad zero bytes)`` per row, computed once per distinct
    (length, pad) pair: the contribution of a deterministic payload to a CRC."""
    payload_len = np.asarray(payload_len, dtype=np.int64)
    pad = np.asarray(pad, dtype=np.int64)
    key = payload_len * 4 + pad
    out = np.zeros(len(key), dtype=crc.dtype)
    if not len(key):
        return out
    if (key == key[0]).all():                           # one (length, pad) pair (common)
        ks, inv = key[:1], np.zeros(len(key), dtype=np.intp)
    else:
        ks, inv = np.unique(key, return_inverse=True)
    pat = pattern.tobytes()
    vals = np.array([_tail_register_cached(crc.name, pat, int(k) >> 2, int(k) & 3) for k in ks],
                    dtype=crc.dtype)
    return vals[inv]


# --------------------------------------------------------------------------------------------
# ICRC masking
# --------------------------------------------------------------------------------------------

def mask_rocev2(rows: np.ndarray, ip_version: int) -> np.ndarray:
    """Copy of ``(n, L)`` rows starting at the IP header with the ICRC's variant fields set to
    ones (IPv4 TOS, TTL, checksum / IPv6 traffic class, flow label, hop limit; UDP checksum;
    BTH byte 4)."""
    m = np.array(rows, dtype=np.uint8, copy=True)
    if ip_version == 4:
        m[:, 1] = 0xFF                 # TOS (DSCP + ECN)
        m[:, 8] = 0xFF                 # TTL
        m[:, 10:12] = 0xFF             # header checksum
        udp = 20
    else:
        m[:, 0] |= 0x0F                # traffic class, upper nibble
        m[:, 1:4] = 0xFF               # traffic class lower nibble + flow label
        m[:, 7] = 0xFF                 # hop limit
        udp = 40
    m[:, udp + 6:udp + 8] = 0xFF       # UDP checksum
    m[:, udp + 8 + 4] = 0xFF           # BTH FECN, BECN, reserved 6
    return m


def mask_ib(rows: np.ndarray, grh: bool) -> np.ndarray:
    """Copy of ``(n, L)`` rows starting at the LRH with the native-IB ICRC variant fields set to
    ones: LRH VL (local packets) or the whole LRH (global packets: routers rebuild it, which is
    why RoCEv2 puts eight bytes of ones in its place), GRH traffic class, flow label and hop
    limit, BTH byte 4 (IBTA vol. 1 7.8.1)."""
    m = np.array(rows, dtype=np.uint8, copy=True)
    m[:, 0] |= 0xF0                    # VL
    bth = 8
    if grh:
        m[:, 0:8] = 0xFF               # the whole LRH
        m[:, 8] |= 0x0F
        m[:, 9:12] = 0xFF
        m[:, 15] = 0xFF
        bth = 48
    m[:, bth + 4] = 0xFF
    return m


def icrc_rocev2(rows: np.ndarray, ip_version: int, lengths: np.ndarray | None = None) -> np.ndarray:
    """ICRC of RoCEv2 packets.

    Parameters
    ----------
    rows : ``(n, L)`` uint8 starting at the IP header and holding everything up to (not
        including) the ICRC: IP, UDP, BTH, extension headers, payload, pad.
    ip_version : 4 or 6.
    lengths : ``(n,)`` bytes of each row covered by the ICRC (default ``L``).

    Returns
    -------
    ``(n,)`` uint32 CRC values; the wire bytes are their little-endian encoding
    (:func:`icrc_bytes`).

    References
    ----------
    IBTA vol. 1 annex A17.4.1; ``scapy/contrib/roce.py`` ``BTH.compute_icrc``.
    """
    m = mask_rocev2(rows, ip_version)
    return CRC32.of_rows(m, lengths, state=_STATE_AFTER_PSEUDO_LRH) ^ np.uint32(CRC32.xorout)


def icrc_ib(rows: np.ndarray, grh: bool, lengths: np.ndarray | None = None) -> np.ndarray:
    """ICRC of native InfiniBand packets: ``rows`` start at the LRH and end before the ICRC
    (IBTA vol. 1 7.8.1). Returns ``(n,)`` uint32, stored little-endian like RoCEv2's."""
    m = mask_ib(rows, grh)
    return CRC32.of_rows(m, lengths) ^ np.uint32(CRC32.xorout)


def vcrc(rows: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """VCRC of native InfiniBand packets: CRC-16 over the LRH through the ICRC, nothing masked
    (IBTA vol. 1 7.8.2). ``rows`` start at the LRH. Returns ``(n,)`` uint16."""
    return CRC16_VCRC.of_rows(rows, lengths) ^ np.uint16(CRC16_VCRC.xorout)


def icrc_bytes(values: np.ndarray) -> np.ndarray:
    """``(n,)`` uint32 ICRC values -> ``(n, 4)`` uint8 wire bytes (least significant first)."""
    return np.asarray(values, dtype="<u4").view(np.uint8).reshape(-1, 4)


VCRC_BYTE_ORDER = "<"
"""VCRC wire order: like the ICRC, the reflected register is sent least significant byte first."""


def vcrc_bytes(values: np.ndarray) -> np.ndarray:
    """``(n,)`` uint16 VCRC values -> ``(n, 2)`` uint8 wire bytes."""
    return np.asarray(values, dtype=VCRC_BYTE_ORDER + "u2").view(np.uint8).reshape(-1, 2)


def icrc_scalar(frame: bytes, l3_offset: int = 14) -> int:
    """ICRC of one RoCEv2 Ethernet frame (without FCS, ICRC included at the end) in plain
    Python, written independently of the vectorized path: used by tests and the validator's
    error messages."""
    ip = bytearray(frame[l3_offset:-4])
    if ip[0] >> 4 == 4:
        ip[1] = 0xFF
        ip[8] = 0xFF
        ip[10:12] = b"\xff\xff"
        u = 20
    else:
        ip[0] |= 0x0F
        ip[1:4] = b"\xff\xff\xff"
        ip[7] = 0xFF
        u = 40
    ip[u + 6:u + 8] = b"\xff\xff"
    ip[u + 12] = 0xFF
    return zlib.crc32(PSEUDO_LRH + bytes(ip)) & 0xFFFFFFFF


__all__ = ["Crc", "CRC32", "CRC16_VCRC", "icrc_rocev2", "icrc_ib", "vcrc", "icrc_bytes",
           "vcrc_bytes", "mask_rocev2", "mask_ib", "tail_register", "icrc_scalar", "PSEUDO_LRH"]
