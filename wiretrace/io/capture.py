"""Reading captures: pcap, pcapng and ERF, streamed as bounded batches of frames.

Any capture a network engineer brings is accepted, ours or a real one:

- **pcap** with microsecond (``0xa1b2c3d4``) or nanosecond (``0xa1b23c4d``) magic, written in
  either byte order, and the "modified" Kuznetzov variant (``0xa1b2cd34``);
- **pcapng** with several sections and several interfaces per section, each interface with its
  own ``if_tsresol`` (powers of 10 or of 2), ``if_tsoffset`` and ``if_name``; Enhanced, Simple
  and (obsolete) Packet Blocks; other blocks are skipped;
- **ERF** (Endace Extensible Record Format) either as a plain ``.erf`` file of back-to-back
  records or as pcap/pcapng frames of link type 197 (``LINKTYPE_ERF``, as Mellanox ``ibdump``
  writes them for InfiniBand ports).

File headers and interface descriptions are decoded with dpkt's declared layouts
(``dpkt.pcap.FileHdr`` and its record-header formats, ``dpkt.pcapng.InterfaceDescriptionBlock``
and its options). The records themselves are walked here with the same field layouts through
:mod:`struct`, because dpkt's ``Reader`` classes return timestamps as floats (nanoseconds are
lost), drop the original length and read only the first pcapng interface; dpkt has no ERF
reader. The walk goes run by run: record headers are read in a tight loop over the read buffer
and the bytes of all the frames of a run are gathered with one NumPy operation.

ERF records are unwrapped: a frame's bytes start at the first byte of the link header inside the
record (LRH for InfiniBand, the Ethernet destination address for Ethernet types, after the 2-byte
offset/pad field), its link type is the one of those bytes (247 ``LINKTYPE_INFINIBAND``, 1
``LINKTYPE_ETHERNET``, 228/229 raw IPv4/IPv6) and its timestamp is the ERF one, as Wireshark does
(wiretap ``erf.c`` and ``pcap-common.c``). Records of other ERF types keep link type 197 and
their whole record. In a plain ERF file, padding and provenance (META) records are skipped; as
frames of a pcap or pcapng file they stay (link type 197), so that frame numbers keep matching
Wireshark's.

A capture whose last record is cut short (a copy interrupted, a capture killed) yields every
complete frame; the cut is then described by :attr:`Capture.truncated` instead of an exception.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

import dpkt
import numpy as np

from ..errors import InputFormatError

# pcap link types (https://www.tcpdump.org/linktypes.html).
LINKTYPE_ETHERNET = 1
LINKTYPE_RAW = 101
LINKTYPE_LINUX_SLL = 113
LINKTYPE_ERF = 197
LINKTYPE_IPV4 = 228
LINKTYPE_IPV6 = 229
LINKTYPE_INFINIBAND = 247
LINKTYPE_LINUX_SLL2 = 276

# ERF record types (Endace ERF specification; Wireshark wiretap/erf_record.h).
ERF_TYPE_ETH = 2
ERF_TYPE_COLOR_ETH = 11
ERF_TYPE_DSM_COLOR_ETH = 16
ERF_TYPE_COLOR_HASH_ETH = 20
ERF_TYPE_INFINIBAND = 21
ERF_TYPE_IPV4 = 22
ERF_TYPE_IPV6 = 23
ERF_TYPE_INFINIBAND_LINK = 25
ERF_TYPE_META = 27
ERF_TYPE_PAD = 48
_ERF_ETH_TYPES = frozenset({ERF_TYPE_ETH, ERF_TYPE_COLOR_ETH, ERF_TYPE_DSM_COLOR_ETH,
                            ERF_TYPE_COLOR_HASH_ETH})
_ERF_LINKTYPE = {ERF_TYPE_INFINIBAND: LINKTYPE_INFINIBAND,
                 ERF_TYPE_INFINIBAND_LINK: LINKTYPE_INFINIBAND,
                 ERF_TYPE_IPV4: LINKTYPE_IPV4, ERF_TYPE_IPV6: LINKTYPE_IPV6}
_ERF_KNOWN_TYPES = frozenset(range(1, 30)) | {ERF_TYPE_PAD}
ERF_HEADER_LEN = 16  # ts (8, little-endian 32.32), type, flags, rlen, lctr, wlen (big-endian)
_ERF_HDR = struct.Struct("<QBB")
_ERF_LENS = struct.Struct(">HHH")

# Largest frame accepted in a record: pcap's libpcap limit for any link type (262144) plus room
# for an ERF header; a larger claimed length means a corrupt file, not a big frame.
MAX_RECORD_CAPLEN = 262144 + 64

_PCAPNG_EPB = dpkt.pcapng.PCAPNG_BT_EPB
_PCAPNG_SPB = dpkt.pcapng.PCAPNG_BT_SPB
_PCAPNG_PB = dpkt.pcapng.PCAPNG_BT_PB
_PCAPNG_IDB = dpkt.pcapng.PCAPNG_BT_IDB
_PCAPNG_SHB = dpkt.pcapng.PCAPNG_BT_SHB

DEFAULT_MAX_FRAMES = 65536
DEFAULT_MAX_BYTES = 16 << 20
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class Interface:
    """One capture interface (a pcapng IDB, the single interface of a pcap, an ERF port).

    Attributes
    ----------
    index : int
        Interface index as numbered in the file (pcapng: order of IDBs over all sections).
    name : str
        ``if_name`` when the file gives one, else ``"if<index>"`` (ERF: ``"erf<port>"``).
    linktype : int
        Link type declared for the interface (197 for ERF, before unwrapping).
    snaplen : int
        Snapshot length in bytes (0 = unlimited).
    """

    index: int
    name: str
    linktype: int
    snaplen: int


@dataclass(frozen=True)
class Truncation:
    """A record cut short at the end of the file.

    Attributes
    ----------
    frame : int
        1-based number the cut frame would have had.
    offset : int
        Byte offset of the record in the file.
    needed : int
        Bytes the record declares (header included).
    present : int
        Bytes of it present in the file (header included).
    frame_needed : int
        Bytes of the frame the record declares (its captured length, without the record header
        and padding), or -1 when the record header itself is cut (or the record holds no frame).
    frame_present : int
        Bytes of that frame present in the file, or -1 with ``frame_needed``.
    """

    frame: int
    offset: int
    needed: int
    present: int
    frame_needed: int = -1
    frame_present: int = -1

    def describe(self) -> str:
        """``record of frame N at byte O needs X ..., only Y present``: both numbers count frame
        bytes when the record header could be read, else record bytes (header included)."""
        where = f"record of frame {self.frame} at byte {self.offset}"
        if self.frame_needed >= 0 and self.frame_present >= self.frame_needed:
            short = self.needed - self.present
            return (f"{where} holds its {self.frame_needed} frame bytes but ends {short} "
                    f"byte{'s' if short != 1 else ''} short of the record's {self.needed}")
        if self.frame_needed >= 0:
            return f"{where} needs {self.frame_needed} frame bytes, only {self.frame_present} present"
        return f"{where} needs {self.needed} record bytes, only {self.present} present"

    def message(self, path: str | Path) -> str:
        """The one-line warning or error for a capture at ``path``."""
        return f"{path}: capture truncated: {self.describe()}"


class TruncatedCaptureWarning(UserWarning):
    """The last record of a capture is incomplete; the complete frames were read."""


@dataclass
class FrameBatch:
    """A bounded batch of consecutive frames, stored as one byte buffer plus offsets.

    Frame ``i`` is ``data[offsets[i]:offsets[i + 1]]``; its length is ``caplen[i]``.

    Attributes
    ----------
    first : int
        0-based index of the batch's first frame in the capture (Wireshark's frame number is
        ``first + i + 1``).
    ts_ns : numpy.ndarray, int64, shape (n,)
        Capture timestamps, ns since the Unix epoch.
    caplen : numpy.ndarray, int32, shape (n,)
        Bytes captured (may be less than ``origlen`` when the capture used a snap length).
    origlen : numpy.ndarray, int32, shape (n,)
        Length of the frame on the wire, bytes (ERF: the record's wire length ``wlen``).
    linktype : numpy.ndarray, uint16, shape (n,)
        Link type of the bytes in ``data`` (ERF unwrapped; see the module docstring).
    iface : numpy.ndarray, int16, shape (n,)
        Interface index (see :attr:`interfaces`).
    data : numpy.ndarray, uint8, shape (offsets[-1],)
        Captured bytes of all frames back to back.
    offsets : numpy.ndarray, int64, shape (n + 1,)
        Start of each frame in ``data``; ``offsets[-1] == len(data)``.
    interfaces : tuple of Interface
        Interfaces known when the batch was read, by index.
    """

    first: int
    ts_ns: np.ndarray
    caplen: np.ndarray
    origlen: np.ndarray
    linktype: np.ndarray
    iface: np.ndarray
    data: np.ndarray
    offsets: np.ndarray
    interfaces: tuple = field(default_factory=tuple)

    def __len__(self) -> int:
        return len(self.caplen)

    def frame(self, i: int) -> bytes:
        """Captured bytes of frame ``i`` of the batch."""
        return self.data[self.offsets[i]:self.offsets[i + 1]].tobytes()

    @property
    def frame_number(self) -> np.ndarray:
        """Wireshark frame numbers (1-based), int64, shape (n,)."""
        return np.arange(self.first + 1, self.first + 1 + len(self), dtype=np.int64)

    def iface_names(self) -> np.ndarray:
        """Interface name of each frame, object array of str, shape (n,)."""
        names = np.array([i.name for i in self.interfaces] or [""], dtype=object)
        return names[self.iface]


class _Window:
    """Sliding view over a binary file: ``buf[pos:]`` are the next unread bytes."""

    def __init__(self, f: BinaryIO, initial: bytes = b""):
        self.f = f
        self.buf = initial
        self.pos = 0
        self.base = 0  # file offset of buf[0]
        self.eof = False

    def need(self, n: int) -> bool:
        """Make ``n`` bytes available from ``pos``; False when the file ends first."""
        if self.pos + n <= len(self.buf):
            return True
        if self.eof:
            return False
        parts = [self.buf[self.pos:]]
        have = len(parts[0])
        want = max(_READ_CHUNK, n)
        while have < want:
            more = self.f.read(want - have)
            if not more:
                self.eof = True
                break
            parts.append(more)
            have += len(more)
        self.base += self.pos
        self.buf = b"".join(parts)
        self.pos = 0
        return n <= len(self.buf)

    @property
    def offset(self) -> int:
        """File offset of the next unread byte."""
        return self.base + self.pos

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos


class _BatchBuilder:
    """Collects frames until a batch is full."""

    def __init__(self, first: int):
        self.first = first
        self.ts: list[int] = []
        self.caplen: list[int] = []
        self.origlen: list[int] = []
        self.linktype: list[int] = []
        self.iface: list[int] = []
        self.parts: list = []
        self.nbytes = 0

    def add(self, ts_ns: int, payload, origlen: int, linktype: int, iface: int) -> None:
        self.ts.append(ts_ns)
        self.caplen.append(len(payload))
        self.origlen.append(origlen)
        self.linktype.append(linktype)
        self.iface.append(iface)
        self.parts.append(payload)
        self.nbytes += len(payload)

    def __len__(self) -> int:
        return len(self.caplen)

    def build(self, interfaces) -> FrameBatch:
        caplen = np.array(self.caplen, dtype=np.int32)
        offsets = np.zeros(len(caplen) + 1, dtype=np.int64)
        np.cumsum(caplen, out=offsets[1:])
        data = np.frombuffer(b"".join(self.parts), dtype=np.uint8)
        return FrameBatch(
            first=self.first,
            ts_ns=np.array(self.ts, dtype=np.int64),
            caplen=caplen,
            origlen=np.array(self.origlen, dtype=np.int32),
            linktype=np.array(self.linktype, dtype=np.uint16),
            iface=np.array(self.iface, dtype=np.int16),
            data=data,
            offsets=offsets,
            interfaces=tuple(interfaces),
        )


def _gather_ranges(buf: bytes, starts: list[int], lengths: list[int]) -> np.ndarray:
    """Concatenate ``buf[s:s + n]`` for increasing, non-overlapping ranges, as one uint8 array
    (a mask over the span, so no per-byte index array is built)."""
    lo, hi = starts[0], starts[-1] + lengths[-1]
    region = np.frombuffer(buf, dtype=np.uint8, count=hi - lo, offset=lo)
    st = np.array(starts, dtype=np.int64) - lo
    ln = np.array(lengths, dtype=np.int64)
    nz = ln > 0
    marks = np.zeros(hi - lo + 1, dtype=np.int8)
    marks[st[nz]] += 1
    marks[st[nz] + ln[nz]] -= 1
    return region[np.cumsum(marks[:-1], dtype=np.int8) > 0]


def _erf_timestamp_ns(ts: int) -> int:
    """ERF 32.32 fixed-point timestamp -> ns, rounded to nearest as Wireshark's wiretap does."""
    return (ts >> 32) * 1_000_000_000 + (((ts & 0xFFFFFFFF) * 1_000_000_000 + (1 << 31)) >> 32)


def _erf_frame_span(rec, rlen: int) -> tuple[int, int] | None:
    """``(start, end)`` of the frame in an ERF record of ``rlen`` bytes whose first bytes are
    ``rec`` (its header at least; a cut record counts its frame as far as the header says), or
    None for records without a frame (padding, provenance)."""
    rtype = rec[8]
    base_type = rtype & 0x7F
    if base_type in (ERF_TYPE_PAD, ERF_TYPE_META):
        return None
    (wlen,) = struct.unpack_from(">H", rec, 14)
    pos = ERF_HEADER_LEN
    if rtype & 0x80:  # extension headers, 8 bytes each; bit 7 of the first byte: more follow
        while pos + 8 <= len(rec):
            more = rec[pos] & 0x80
            pos += 8
            if not more:
                break
    if base_type in _ERF_ETH_TYPES:
        pos += 2  # offset and pad bytes before the Ethernet header
    elif base_type not in _ERF_LINKTYPE:
        return 0, rlen
    return pos, max(pos, min(rlen, pos + wlen))


def _unwrap_erf(rec, iface_base: int = 0):
    """Decode one ERF record (bytes-like, header included, possibly truncated by a snap length).

    Returns ``(ts_ns, payload, wlen, linktype, port)`` or None for records that carry no frame
    (padding, provenance metadata). Raises ValueError on a malformed header.
    """
    if len(rec) < ERF_HEADER_LEN:
        raise ValueError(f"ERF header needs {ERF_HEADER_LEN} bytes, record has {len(rec)}")
    ts, rtype, flags = _ERF_HDR.unpack_from(rec, 0)
    rlen, _lctr, wlen = _ERF_LENS.unpack_from(rec, 10)
    if rlen < ERF_HEADER_LEN:
        raise ValueError(f"ERF record length {rlen} is shorter than its 16-byte header")
    base_type = rtype & 0x7F
    if base_type in (ERF_TYPE_PAD, ERF_TYPE_META):
        return None
    pos = ERF_HEADER_LEN
    if rtype & 0x80:  # extension headers, 8 bytes each; bit 7 of the first byte: more follow
        while True:
            if pos + 8 > len(rec):
                break
            more = rec[pos] & 0x80
            pos += 8
            if not more:
                break
    port = (flags & 0x03) | ((flags & 0x40) >> 4)
    # A record may be padded past its frame (rlen rounded up); wlen bounds the frame.
    end = min(len(rec), rlen)
    if base_type in _ERF_ETH_TYPES:
        pos += 2  # offset and pad bytes before the Ethernet header
        linktype = LINKTYPE_ETHERNET
    elif base_type in _ERF_LINKTYPE:
        linktype = _ERF_LINKTYPE[base_type]
    else:
        return _erf_timestamp_ns(ts), rec[:end], len(rec), LINKTYPE_ERF, port
    end = min(end, pos + wlen)
    return _erf_timestamp_ns(ts), rec[pos:max(pos, end)], wlen, linktype, port


class Capture:
    """An open capture file, read as a stream of :class:`FrameBatch`.

    Parameters
    ----------
    path : str or Path
        pcap, pcapng or ERF file (format recognised from its first bytes, not its suffix).

    Raises
    ------
    InputFormatError
        The file is empty, shorter than its header, or none of the three formats.
    FileNotFoundError, IsADirectoryError, PermissionError
        As :func:`open` raises them.

    Attributes
    ----------
    format : str
        ``"pcap"``, ``"pcap-ns"``, ``"pcapng"`` or ``"erf"``.
    interfaces : list of Interface
        Interfaces seen so far (pcapng declares them as it goes).
    truncated : Truncation or None
        Set once the batches are exhausted when the last record was cut short.
    frames : int
        Frames yielded so far.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "rb")
        try:
            head = self._f.read(24)
            self._win = _Window(self._f, head)
            self.interfaces: list[Interface] = []
            self.truncated: Truncation | None = None
            self.frames = 0
            self._pending = 0  # frames read into the batch being built
            self._sniff(head)
        except BaseException:
            self._f.close()
            raise

    # -- format detection --------------------------------------------------------------------

    def _sniff(self, head: bytes) -> None:
        if len(head) == 0:
            if Path(self.path).suffix.lower() == ".erf":
                # ERF has no file header: an .erf file of no records is an empty ERF capture
                self.format = "erf"
                self.interfaces = []
                return
            raise InputFormatError(f"{self.path}: empty file; expected a pcap, pcapng or ERF capture")
        if len(head) >= 4:
            magic_be = struct.unpack(">I", head[:4])[0]
            if magic_be == _PCAPNG_SHB:
                self.format = "pcapng"
                if not self._win.need(12):
                    raise InputFormatError(f"{self.path}: truncated pcapng section header block")
                blen = struct.unpack_from("<I" if head[8:12] == b"\x4d\x3c\x2b\x1a" else ">I",
                                          self._win.buf, 4)[0]
                if not self._win.need(max(blen, 28)):
                    raise InputFormatError(f"{self.path}: truncated pcapng section header block "
                                           f"({self._win.remaining} of {blen} bytes)")
                return
            if magic_be in dpkt.pcap.MAGIC_TO_PKT_HDR:
                self._open_pcap(head)
                return
        if self._looks_like_erf():
            self.format = "erf"
            self.interfaces = []
            return
        raise InputFormatError(
            f"{self.path}: not a capture: first bytes {head[:8].hex()} are neither pcap nor "
            f"pcapng magic nor an ERF record header")

    def _open_pcap(self, head: bytes) -> None:
        if len(head) < dpkt.pcap.FileHdr.__hdr_len__:
            raise InputFormatError(
                f"{self.path}: truncated pcap file header ({len(head)} of 24 bytes)")
        fh = dpkt.pcap.FileHdr(head)
        magic = fh.magic  # as read big-endian: tells the byte order and the resolution
        if magic in (dpkt.pcap.PMUDPCT_MAGIC, dpkt.pcap.PMUDPCT_MAGIC_NANO,
                     dpkt.pcap.PACPDOM_MAGIC):
            fh = dpkt.pcap.LEFileHdr(head)
        nano = magic in (dpkt.pcap.TCPDUMP_MAGIC_NANO, dpkt.pcap.PMUDPCT_MAGIC_NANO)
        rec_cls = dpkt.pcap.MAGIC_TO_PKT_HDR[magic]
        self.format = "pcap-ns" if nano else "pcap"
        self._pcap_rec = struct.Struct(rec_cls.__hdr_fmt__)
        self._pcap_frac_ns = 1 if nano else 1000
        # Upper bits of the link-type field carry FCS information (pcap spec, LinkType field).
        linktype = fh.linktype & 0xFFFF
        self.interfaces = [Interface(0, "if0", linktype, fh.snaplen)]
        self._win.pos = 24

    def _looks_like_erf(self) -> bool:
        """Heuristic as Wireshark's: the first records must have sane ERF headers."""
        win = self._win
        pos, checked = 0, 0
        while checked < 3 and win.need(pos + ERF_HEADER_LEN):
            rtype = win.buf[pos + 8]
            rlen, _lctr, wlen = _ERF_LENS.unpack_from(win.buf, pos + 10)
            if (rtype & 0x7F) not in _ERF_KNOWN_TYPES or rlen < ERF_HEADER_LEN:
                return False
            if (rtype & 0x7F) not in (ERF_TYPE_PAD, ERF_TYPE_META) and wlen == 0:
                return False
            if (win.buf[pos + 9] & 0x80) != 0:  # reserved flag bit
                return False
            checked += 1
            pos += rlen
            if not win.need(pos + 1):
                break
        return checked > 0

    # -- streaming ---------------------------------------------------------------------------

    def batches(self, max_frames: int = DEFAULT_MAX_FRAMES,
                max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[FrameBatch]:
        """Yield the frames in file order, in batches of at most ``max_frames`` frames and about
        ``max_bytes`` bytes of frame data.

        Raises
        ------
        InputFormatError
            A record is malformed (a length field smaller than its header, a caplen beyond
            262144 bytes, pcapng block lengths that disagree, a packet on an undeclared
            interface). A record cut by the end of the file is not an error: see
            :attr:`truncated`.
        """
        if max_frames < 1 or max_bytes < 1:
            raise ValueError("max_frames and max_bytes must be positive")
        if self.format == "erf":
            yield from self._batches_erf(max_frames, max_bytes)
            return
        walk = self._batches_pcap if self.format in ("pcap", "pcap-ns") else self._batches_pcapng
        for batch in walk(max_frames, max_bytes):
            yield self._unwrap_erf_frames(batch)

    def _batches_erf(self, max_frames: int, max_bytes: int) -> Iterator[FrameBatch]:
        batch = _BatchBuilder(self.frames)
        for ts_ns, payload, origlen, linktype, iface in self._records_erf():
            batch.add(ts_ns, payload, origlen, linktype, iface)
            self.frames += 1
            if len(batch) >= max_frames or batch.nbytes >= max_bytes:
                yield batch.build(self.interfaces)
                batch = _BatchBuilder(self.frames)
        if len(batch):
            yield batch.build(self.interfaces)

    def _unwrap_erf_frames(self, batch: FrameBatch) -> FrameBatch:
        """Frames of link type 197 (ERF records inside pcap/pcapng) -> their link-layer frame.

        Records that carry no frame (padding, metadata) stay as they are, so that frame numbers
        keep matching Wireshark's."""
        if not (batch.linktype == LINKTYPE_ERF).any():
            return batch
        out = _BatchBuilder(batch.first)
        for i in range(len(batch)):
            payload = batch.frame(i)
            ts, orig, lt = int(batch.ts_ns[i]), int(batch.origlen[i]), int(batch.linktype[i])
            if lt == LINKTYPE_ERF:
                try:
                    unwrapped = _unwrap_erf(payload)
                except ValueError as e:
                    raise InputFormatError(f"{self.path}: frame {batch.first + i + 1}: bad ERF "
                                           f"record: {e}") from None
                if unwrapped is not None:
                    ts, payload, orig, lt, _port = unwrapped
            out.add(ts, payload, orig, lt, int(batch.iface[i]))
        return out.build(batch.interfaces)

    def _batches_pcap(self, max_frames: int, max_bytes: int) -> Iterator[FrameBatch]:
        """Plain pcap, the common case, read run by run: the record headers are walked in a
        tight loop over the read buffer and each run's frame bytes are gathered with one NumPy
        operation (same results as the generic path, about three times faster)."""
        win, rec, frac_ns = self._win, self._pcap_rec, self._pcap_frac_ns
        hlen = rec.size
        unpack = rec.unpack_from
        done = False
        while not done:
            secs: list[int] = []
            fracs: list[int] = []
            caps: list[int] = []
            origs: list[int] = []
            parts: list[np.ndarray] = []
            nbytes = 0
            while len(caps) < max_frames and nbytes < max_bytes:
                buf, pos, end = win.buf, win.pos, len(win.buf)
                starts: list[int] = []
                first_cap = len(caps)
                need = hlen
                need_frame = -1
                while len(caps) < max_frames and nbytes < max_bytes:
                    if pos + hlen > end:
                        need = hlen
                        need_frame = -1
                        break
                    sec, frac, caplen, origlen = unpack(buf, pos)[:4]
                    if caplen > MAX_RECORD_CAPLEN:
                        win.pos = pos
                        raise self._corrupt(
                            f"pcap record of frame {self.frames + len(caps) + 1} claims "
                            f"{caplen} captured bytes (at most {MAX_RECORD_CAPLEN} expected)")
                    if pos + hlen + caplen > end:
                        need = hlen + caplen
                        need_frame = caplen
                        break
                    secs.append(sec)
                    fracs.append(frac)
                    caps.append(caplen)
                    origs.append(origlen)
                    starts.append(pos + hlen)
                    nbytes += caplen
                    pos += hlen + caplen
                if starts:
                    parts.append(_gather_ranges(buf, starts, caps[first_cap:]))
                win.pos = pos
                if len(caps) >= max_frames or nbytes >= max_bytes:
                    break
                if not win.need(need):
                    if win.remaining:
                        self._pending = len(caps)
                        self._cut(need, need_frame, hlen)
                    done = True
                    break
            if not caps:
                return
            ts = (np.array(secs, dtype=np.int64) * 1_000_000_000
                  + np.array(fracs, dtype=np.int64) * frac_ns)
            origs = np.maximum(np.array(origs, dtype=np.int64), np.array(caps, dtype=np.int64))
            yield self._build(ts, caps, origs, [0] * len(caps), parts)

    @property
    def position(self) -> int:
        """Bytes of the file consumed so far (for progress reports)."""
        return self._win.offset

    @property
    def size(self) -> int:
        """Size of the file in bytes (0 when unknown)."""
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _cut(self, needed: int, frame_needed: int = -1, frame_start: int = 0) -> None:
        """Record that the file ends inside the next record, which declares ``needed`` bytes;
        ``frame_needed`` of them are the frame, from byte ``frame_start`` of the record (-1: the
        record header is cut, or the record holds no frame)."""
        present = self._win.remaining
        frame_present = (min(max(present - frame_start, 0), frame_needed) if frame_needed >= 0
                         else -1)
        self.truncated = Truncation(frame=self.frames + self._pending + 1,
                                    offset=self._win.offset, needed=needed, present=present,
                                    frame_needed=frame_needed, frame_present=frame_present)

    def _corrupt(self, what: str) -> InputFormatError:
        return InputFormatError(f"{self.path}: byte {self._win.offset}: {what}")

    # pcapng ----------------------------------------------------------------------------------

    def _ng_section(self, order: str) -> None:
        """Start a pcapng section in byte order ``order``: no interfaces declared yet."""
        self._ng_order = order
        self._ng_blk = struct.Struct(order + "II")
        self._ng_u32 = struct.Struct(order + "I")
        self._ng_epb = struct.Struct(order + "IIIII")
        self._ng_pb = struct.Struct(order + "HHIIII")
        self._ng_scale: list[tuple[int, int, int, int]] = []  # per interface of the section
        self._ng_first_iface = len(self.interfaces)

    def _ng_ts(self, iface: int, tsh: int, tsl: int) -> int:
        mul, shift, div, off = self._ng_scale[iface]
        return ((((tsh << 32) | tsl) * mul) >> shift) // div + off

    def _ng_block(self):
        """Process the pcapng block at the read position.

        Returns None at the end of the file (a cut block is recorded in :attr:`truncated`),
        ``()`` for a block without a frame, or ``(ts_ns, payload, origlen, iface)``.
        """
        win = self._win
        if not win.need(8):
            if win.remaining:
                self._cut(12)
            return None
        btype, blen = self._ng_blk.unpack_from(win.buf, win.pos)
        if btype == _PCAPNG_SHB:
            if not win.need(12):
                self._cut(12)
                return None
            bom = win.buf[win.pos + 8:win.pos + 12]
            if bom == b"\x4d\x3c\x2b\x1a":
                self._ng_section("<")
            elif bom == b"\x1a\x2b\x3c\x4d":
                self._ng_section(">")
            else:
                raise self._corrupt(f"pcapng section header with byte-order magic {bom.hex()}"
                                    " (expected 1a2b3c4d in either byte order)")
            btype, blen = self._ng_blk.unpack_from(win.buf, win.pos)
        if blen < 12 or blen % 4:
            raise self._corrupt(f"pcapng block of type {btype:#x} has length {blen} "
                                "(expected a multiple of 4, at least 12)")
        if blen > MAX_RECORD_CAPLEN + 64 and btype in (_PCAPNG_EPB, _PCAPNG_SPB, _PCAPNG_PB):
            raise self._corrupt(f"pcapng packet block of {blen} bytes "
                                f"(at most {MAX_RECORD_CAPLEN} bytes of packet expected)")
        if not win.need(blen):
            self._cut(blen, *self._ng_cut_frame(btype, blen))
            return None
        p, buf = win.pos, win.buf
        if self._ng_u32.unpack_from(buf, p + blen - 4)[0] != blen:
            raise self._corrupt(f"pcapng block of type {btype:#x}: trailing length differs "
                                f"from leading length {blen}")
        result = ()
        if btype == _PCAPNG_EPB or btype == _PCAPNG_PB:
            if btype == _PCAPNG_EPB:
                iface, tsh, tsl, caplen, origlen = self._ng_epb.unpack_from(buf, p + 8)
            else:
                iface, _drops, tsh, tsl, caplen, origlen = self._ng_pb.unpack_from(buf, p + 8)
            if iface >= len(self._ng_scale):
                raise self._corrupt(f"packet on interface {iface}, but the section declares "
                                    f"{len(self._ng_scale)} interface(s)")
            if 28 + caplen > blen - 4:
                raise self._corrupt(f"pcapng packet block of {blen} bytes claims {caplen} "
                                    "captured bytes")
            self._ng_last_ts = self._ng_ts(iface, tsh, tsl)
            result = (self._ng_last_ts, buf[p + 28:p + 28 + caplen], max(origlen, caplen),
                      self._ng_first_iface + iface)
        elif btype == _PCAPNG_SPB:
            if not self._ng_scale:
                raise self._corrupt("simple packet block before any interface description")
            (origlen,) = self._ng_u32.unpack_from(buf, p + 8)
            snap = self.interfaces[self._ng_first_iface].snaplen
            caplen = min(origlen, blen - 16, snap if snap else origlen)
            # A Simple Packet Block has no timestamp: it keeps the previous frame's time.
            result = (self._ng_last_ts, buf[p + 12:p + 12 + caplen], origlen,
                      self._ng_first_iface)
        elif btype == _PCAPNG_IDB:
            self._ng_interface(bytes(buf[p:p + blen]))
        win.pos = p + blen
        return result

    def _ng_cut_frame(self, btype: int, blen: int) -> tuple[int, int]:
        """``(frame bytes, offset of the frame in the block)`` of a packet block cut by the end
        of the file; ``(-1, 0)`` when its header is cut too or it holds no frame."""
        win = self._win
        if btype in (_PCAPNG_EPB, _PCAPNG_PB) and win.remaining >= 28:
            caplen = self._ng_u32.unpack_from(win.buf, win.pos + 20)[0]
            return min(caplen, max(blen - 32, 0)), 28
        if btype == _PCAPNG_SPB and win.remaining >= 12 and self._ng_scale:
            (origlen,) = self._ng_u32.unpack_from(win.buf, win.pos + 8)
            snap = self.interfaces[self._ng_first_iface].snaplen
            return min(origlen, blen - 16, snap if snap else origlen), 12
        return -1, 0

    def _ng_interface(self, block: bytes) -> None:
        """Declare the interface of an Interface Description Block (options read by dpkt)."""
        le = self._ng_order == "<"
        idb_cls = (dpkt.pcapng.InterfaceDescriptionBlockLE if le
                   else dpkt.pcapng.InterfaceDescriptionBlock)
        try:
            idb = idb_cls(block)
        except (dpkt.UnpackError, dpkt.NeedData) as e:
            raise self._corrupt(f"bad pcapng interface description block: {e}") from None
        index = len(self.interfaces)
        name, tsresol, tsoffset = f"if{index}", 6, 0
        for opt in idb.opts:
            if opt.code == dpkt.pcapng.PCAPNG_OPT_IF_NAME:
                name = opt.data.rstrip(b"\0").decode("utf-8", "replace") or name
            elif opt.code == dpkt.pcapng.PCAPNG_OPT_IF_TSRESOL and opt.data:
                tsresol = opt.data[0]
            elif opt.code == dpkt.pcapng.PCAPNG_OPT_IF_TSOFFSET and len(opt.data) >= 8:
                tsoffset = struct.unpack(self._ng_order + "q", opt.data[:8])[0]
        off = tsoffset * 1_000_000_000
        if tsresol & 0x80:  # a negative power of two
            scale = (1_000_000_000, tsresol & 0x7F, 1, off)
        elif tsresol <= 9:  # a negative power of ten
            scale = (10 ** (9 - tsresol), 0, 1, off)
        else:
            scale = (1, 0, 10 ** (tsresol - 9), off)
        self._ng_scale.append(scale)
        self.interfaces.append(Interface(index, name, idb.linktype, idb.snaplen))

    def _batches_pcapng(self, max_frames: int, max_bytes: int) -> Iterator[FrameBatch]:
        """pcapng read run by run: consecutive Enhanced Packet Blocks are walked in a tight loop
        and their bytes gathered with one NumPy operation; every other block goes through
        :meth:`_ng_block`."""
        win = self._win
        self._ng_section("<")  # replaced by the first block, a Section Header Block
        self._ng_last_ts = 0
        done = False
        while not done:
            ts: list[int] = []
            ifs: list[int] = []
            caps: list[int] = []
            origs: list[int] = []
            parts: list = []
            nbytes = 0
            while len(caps) < max_frames and nbytes < max_bytes:
                buf, pos, end = win.buf, win.pos, len(win.buf)
                blk, epb, u32 = self._ng_blk, self._ng_epb, self._ng_u32
                scale, first_iface = self._ng_scale, self._ng_first_iface
                nif = len(scale)
                starts: list[int] = []
                run_caps: list[int] = []
                while len(caps) < max_frames and nbytes < max_bytes and pos + 28 <= end:
                    btype, blen = blk.unpack_from(buf, pos)
                    if btype != _PCAPNG_EPB or pos + blen > end or blen < 32:
                        break
                    iface, tsh, tsl, caplen, origlen = epb.unpack_from(buf, pos + 8)
                    if (iface >= nif or 32 + caplen > blen
                            or u32.unpack_from(buf, pos + blen - 4)[0] != blen):
                        break  # let _ng_block report it
                    mul, shift, div, off = scale[iface]
                    ts.append(((((tsh << 32) | tsl) * mul) >> shift) // div + off)
                    ifs.append(first_iface + iface)
                    caps.append(caplen)
                    origs.append(max(origlen, caplen))
                    starts.append(pos + 28)
                    run_caps.append(caplen)
                    nbytes += caplen
                    pos += blen
                if starts:
                    parts.append(_gather_ranges(buf, starts, run_caps))
                    self._ng_last_ts = ts[-1]
                win.pos = pos
                if len(caps) >= max_frames or nbytes >= max_bytes:
                    break
                self._pending = len(caps)
                result = self._ng_block()
                if result is None:
                    done = True
                    break
                if result:
                    t, payload, origlen, gidx = result
                    ts.append(t)
                    ifs.append(gidx)
                    caps.append(len(payload))
                    origs.append(origlen)
                    parts.append(np.frombuffer(bytes(payload), dtype=np.uint8))
                    nbytes += len(payload)
            if not caps:
                return
            yield self._build(ts, caps, origs, ifs, parts)

    def _build(self, ts, caps, origs, ifs, parts) -> FrameBatch:
        c = np.array(caps, dtype=np.int32)
        offsets = np.zeros(len(c) + 1, dtype=np.int64)
        np.cumsum(c, out=offsets[1:])
        iface = np.array(ifs, dtype=np.int16)
        links = np.array([i.linktype for i in self.interfaces], dtype=np.uint16)
        batch = FrameBatch(
            first=self.frames, ts_ns=np.array(ts, dtype=np.int64), caplen=c,
            origlen=np.array(origs, dtype=np.int32), linktype=links[iface], iface=iface,
            data=(np.concatenate(parts) if len(parts) != 1 else parts[0]).astype(np.uint8, copy=False),
            offsets=offsets, interfaces=tuple(self.interfaces))
        self.frames += len(c)
        self._pending = 0
        return batch

    def _records_erf(self):
        win = self._win
        ports: dict[int, int] = {}
        while True:
            if not win.need(ERF_HEADER_LEN):
                if win.remaining:
                    self._cut(ERF_HEADER_LEN)
                return
            rlen = _ERF_LENS.unpack_from(win.buf, win.pos + 10)[0]
            if rlen < ERF_HEADER_LEN:
                raise self._corrupt(f"ERF record length {rlen} is shorter than its 16-byte header")
            if not win.need(rlen):
                span = _erf_frame_span(memoryview(win.buf)[win.pos:], rlen)
                self._cut(rlen, *((span[1] - span[0], span[0]) if span else (-1, 0)))
                return
            rec = memoryview(win.buf)[win.pos:win.pos + rlen]
            win.pos += rlen
            unwrapped = _unwrap_erf(rec)
            if unwrapped is None:
                continue
            ts_ns, payload, wlen, linktype, port = unwrapped
            if port not in ports:
                ports[port] = len(self.interfaces)
                self.interfaces.append(Interface(ports[port], f"erf{port}", LINKTYPE_ERF, 0))
            yield ts_ns, payload, max(wlen, len(payload)), linktype, ports[port]

    # -- context management ------------------------------------------------------------------

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_capture(path: str | Path) -> Capture:
    """Open a pcap, pcapng or ERF capture; see :class:`Capture`.

    Raises
    ------
    InputFormatError
        Not a capture, or its header is truncated.
    """
    return Capture(path)


def iter_frames(path: str | Path, max_frames: int = DEFAULT_MAX_FRAMES,
                max_bytes: int = DEFAULT_MAX_BYTES,
                on_truncated: str = "warn") -> Iterator[FrameBatch]:
    """Stream the frames of a capture as :class:`FrameBatch` objects of bounded size.

    Memory stays bounded by ``max_bytes`` plus one read chunk (8 MiB), whatever the file size.

    Parameters
    ----------
    path : str or Path
        pcap (µs or ns, either byte order), pcapng or ERF file.
    max_frames : int
        Most frames per batch.
    max_bytes : int
        Approximate most bytes of frame data per batch.
    on_truncated : {"warn", "raise", "ignore"}
        What to do, after the last complete frame, when the last record is cut short: emit a
        :class:`TruncatedCaptureWarning`, raise :class:`InputFormatError`, or nothing.

    Yields
    ------
    FrameBatch

    Raises
    ------
    InputFormatError
        The file is not a capture or a record is malformed (see :meth:`Capture.batches`).
    """
    if on_truncated not in ("warn", "raise", "ignore"):
        raise ValueError("on_truncated must be 'warn', 'raise' or 'ignore'")
    with Capture(path) as cap:
        yield from cap.batches(max_frames=max_frames, max_bytes=max_bytes)
        if cap.truncated is not None:
            msg = cap.truncated.message(path)
            if on_truncated == "raise":
                raise InputFormatError(msg)
            if on_truncated == "warn":
                warnings.warn(msg, TruncatedCaptureWarning, stacklevel=2)
