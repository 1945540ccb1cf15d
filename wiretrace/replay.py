"""Send a capture onto a Linux interface or to a UDP socket, keeping (or scaling) its timing.

Two targets:

* ``iface``: every frame goes out unchanged through an ``AF_PACKET``/``SOCK_RAW`` socket bound to
  the interface (packet(7)). Needs root or ``CAP_NET_RAW``. Frames cut by a snap length are
  completed to their original length as wiretrace renders them (:class:`Completion`): the rest of
  the deterministic payload pattern, zero pad bytes and a recomputed ICRC (VCRC for native IB), so
  that a receiving RoCE NIC or Soft-RoCE accepts them; a capture made with ``generate --snaplen N``
  replays exactly as ``--snaplen 0`` would have written it. (``tcprewrite --fixlen=pad`` pads with
  zeros, which leaves the ICRC wrong.) Truncated frames that are not RoCE, or whose headers were
  cut, are padded with zeros and counted.
* ``udp``: the RoCEv2 part of each frame, from the BTH through the ICRC (the UDP payload of a
  RoCEv2 frame; for native InfiniBand frames the bytes after LRH/GRH through the ICRC), is sent
  as one datagram to ``HOST:PORT``, for software RoCE models that listen on a socket. Frames
  that carry no BTH are skipped and counted.

Pacing: frame ``i`` is due at ``t0 + (ts_i - ts_0) / speed`` (recorded timing), at ``t0 + i /
pps`` (``pps``), when the bits before it have gone at ``mbps`` (``mbps``), or at once
(``topspeed``). Loops follow each other without pause and keep counting. The sender sleeps until
about 200 µs before a frame is due and spins for the rest, so a frame leaves within a few
microseconds of its due time on an idle machine; on a busy one the scheduler may hold it for
milliseconds, unless ``rt_priority`` runs the sender under SCHED_FIFO (then it sleeps until 50 µs
before). Late frames are sent at once (the schedule catches up). The report gives the actual
error.

``engine="tcpreplay"`` hands an interface replay to tcpreplay (``--multiplier``, ``--pps``,
``--mbps``, ``--topspeed``, ``--loop``), after writing a completed copy when frames were truncated,
and parses its statistics.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Callable

import numpy as np

from .analysis.stats import Distribution
from .errors import WiretraceError
from .io.capture import LINKTYPE_ERF, LINKTYPE_ETHERNET, LINKTYPE_INFINIBAND, iter_frames, open_capture

ARPHRD_ETHER = 1
ARPHRD_LOOPBACK = 772
ARPHRD_INFINIBAND = 32
_ARPHRD_NAMES = {ARPHRD_ETHER: "Ethernet", ARPHRD_LOOPBACK: "loopback", ARPHRD_INFINIBAND: "InfiniBand (IPoIB)"}
_LINKTYPE_NAMES = {1: "Ethernet", 101: "raw IP", 113: "Linux cooked", 197: "ERF", 228: "raw IPv4",
                   229: "raw IPv6", 247: "InfiniBand", 276: "Linux cooked v2"}
ERF_TYPE_NAMES = {LINKTYPE_INFINIBAND: (21, "InfiniBand")}
"""ERF record type behind the link type the capture reader gives an ERF record's bytes (ERF
types: Endace ERF specification; type 21 = InfiniBand, as Mellanox ibdump writes)."""
IFF_UP = 0x1
ETH_HEADER_LEN = 14
SPIN_NS = 200_000
"""Sleep until this long before a frame is due, then spin (time.sleep overshoots by ~50-100 µs)."""


@dataclass
class ReplayReport:
    """What a replay did.

    Attributes
    ----------
    packets, bytes : frames (datagrams) sent and their bytes (padded length; UDP payload bytes).
    skipped : frames not sent (UDP mode: frames without a BTH).
    loops : passes over the capture.
    duration_ns : first to last send.
    achieved_pps, achieved_bps : (packets - 1) / duration, bits of all but the last frame / duration.
    timing_error_mean_ns, timing_error_p99_ns, timing_error_max_ns : |actual - due| send time;
        None with ``topspeed`` (no due times) and with tcpreplay.
    padded : truncated frames completed to their original length.
    zero_padded : of those, frames padded with zero bytes (not RoCEv2/IB, or headers not
        captured): their ICRC does not match.
    engine : ``native`` or ``tcpreplay``.
    """

    packets: int = 0
    bytes: int = 0
    skipped: int = 0
    loops: int = 0
    duration_ns: int = 0
    achieved_pps: float | None = None
    achieved_bps: float | None = None
    timing_error_mean_ns: float | None = None
    timing_error_p99_ns: float | None = None
    timing_error_max_ns: float | None = None
    padded: int = 0
    zero_padded: int = 0
    engine: str = "native"
    target: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------


def interface_info(name: str) -> tuple[int, int, bool]:
    """``(ARPHRD type, MTU, up)`` of a network interface, from ``/sys/class/net``.

    Raises
    ------
    WiretraceError : the interface does not exist.
    """
    base = Path("/sys/class/net") / name
    if not name or "/" in name or not base.is_dir():
        raise WiretraceError(f"--iface {name}: no such network interface (see `ip link`)")
    kind = int((base / "type").read_text())
    mtu = int((base / "mtu").read_text())
    flags = int((base / "flags").read_text(), 16)
    return kind, mtu, bool(flags & IFF_UP)


def check_interface(name: str) -> tuple[int, int]:
    """Raise WiretraceError unless ``name`` exists, is up and takes Ethernet frames; returns
    ``(ARPHRD type, MTU)``."""
    kind, mtu, up = interface_info(name)
    if not up:
        raise WiretraceError(f"--iface {name}: interface is down (ip link set {name} up)")
    if kind not in (ARPHRD_ETHER, ARPHRD_LOOPBACK):
        raise WiretraceError(f"--iface {name}: a {_ARPHRD_NAMES.get(kind, f'type {kind}')} interface; "
                             "only Ethernet interfaces take raw frames")
    return kind, mtu


def _check_linktypes(linktype: np.ndarray, iface: str, kind: int, fmt: str = "pcap") -> None:
    bad = linktype != LINKTYPE_ETHERNET
    if bad.any():
        lt = int(linktype[np.argmax(bad)])
        if fmt == "erf":
            # an ERF file (pcap link type 197) whose records are not Ethernet ones
            what = (f"ERF records of type {ERF_TYPE_NAMES[lt][0]} ({ERF_TYPE_NAMES[lt][1]}; pcap link type "
                    f"{LINKTYPE_ERF})" if lt in ERF_TYPE_NAMES else f"ERF records (pcap link type {LINKTYPE_ERF})")
        else:
            what = f"capture link type {lt} ({_LINKTYPE_NAMES.get(lt, 'unknown')})"
        raise WiretraceError(
            f"{what} cannot be sent on {iface} "
            f"({_ARPHRD_NAMES.get(kind, kind)}): only Ethernet frames (link type 1) go on an Ethernet "
            "interface; use --udp HOST:PORT to send the RoCE part of InfiniBand frames")


def _open_raw(iface: str) -> socket.socket:
    try:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    except PermissionError:
        raise WiretraceError("replay --iface needs a raw socket: run as root or grant CAP_NET_RAW "
                             "(setcap cap_net_raw+ep on the Python interpreter)") from None
    try:
        s.bind((iface, 0))
    except OSError as e:
        s.close()
        raise WiretraceError(f"--iface {iface}: cannot bind a raw socket: {e.strerror}") from None
    return s


def parse_hostport(text: str) -> tuple[str, int, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) -> ``(host, port, address family)``.

    Raises
    ------
    WiretraceError : malformed, port out of range, or a host name that does not resolve.
    """
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", text.strip())
    if not m:
        raise WiretraceError(f"--udp {text}: expected HOST:PORT, e.g. 127.0.0.1:4791 or [::1]:4791")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 < port < 65536:
        raise WiretraceError(f"--udp {text}: port {port} is not in 1..65535")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise WiretraceError(f"--udp {text}: cannot resolve {host}: {e.strerror}") from None
    return info[0][4][0], port, info[0][0]


# --------------------------------------------------------------------------------------------
# pacing
# --------------------------------------------------------------------------------------------


class _Pacer:
    """Due time of each frame (ns from the start), across loops."""

    def __init__(self, speed: float, pps: float | None, mbps: float | None, topspeed: bool):
        self.speed, self.pps, self.mbps, self.topspeed = speed, pps, mbps, topspeed
        self.index = 0
        self.bits = 0.0
        self.loop_offset = 0       # ns added to recorded times of the current loop
        self.first_ts = None
        self.last_due = 0

    def start_loop(self) -> None:
        self.first_ts = None
        self.loop_offset = self.last_due

    def due(self, ts_ns: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Due times (ns from the replay start) of a batch of frames."""
        n = len(ts_ns)
        if self.topspeed:
            out = np.zeros(n, dtype=np.int64)
        elif self.pps:
            out = ((self.index + np.arange(n)) * (1e9 / self.pps)).astype(np.int64)
        elif self.mbps:
            before = self.bits + np.concatenate([[0.0], np.cumsum(nbytes[:-1] * 8.0)])
            out = (before / (self.mbps * 1e6) * 1e9).astype(np.int64)
        else:
            if self.first_ts is None:
                self.first_ts = int(ts_ns[0])
            rel = (ts_ns - self.first_ts).astype(np.float64) / self.speed
            out = self.loop_offset + np.maximum(rel, 0).astype(np.int64)
        self.index += n
        self.bits += float(np.sum(nbytes) * 8.0)
        if n:
            self.last_due = int(out[-1])
        return out


REPLAY_CACHE_BYTES = 256 * 1024 * 1024
"""Captures up to this size are read and completed once, before the first frame is sent."""

RT_SPIN_NS = 50_000
"""Spin margin under SCHED_FIFO, where a sleeping sender wakes within tens of microseconds."""


def _wait_until(due_abs_ns: int, spin_ns: int = SPIN_NS) -> int:
    while True:
        now = time.perf_counter_ns()
        left = due_abs_ns - now
        if left <= 0:
            return now
        if left > spin_ns:
            time.sleep((left - spin_ns) / 1e9)


def set_realtime(priority: int) -> None:
    """Run the calling process under SCHED_FIFO at ``priority`` (1..99; sched(7)), so that other
    work on a loaded host does not delay frames by milliseconds.

    Raises
    ------
    WiretraceError : priority out of range, or no permission (root or CAP_SYS_NICE needed).
    """
    lo, hi = os.sched_get_priority_min(os.SCHED_FIFO), os.sched_get_priority_max(os.SCHED_FIFO)
    if not lo <= priority <= hi:
        raise WiretraceError(f"--rt-priority {priority}: expected {lo}..{hi}")
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except PermissionError:
        raise WiretraceError("--rt-priority needs root or CAP_SYS_NICE (SCHED_FIFO)") from None


# --------------------------------------------------------------------------------------------
# completing truncated frames
# --------------------------------------------------------------------------------------------

REBUILD_ROWS = 4096
"""Truncated frames whose captured prefixes are gathered into one array for their CRCs."""


@functools.lru_cache(maxsize=4096)
def _tail_register(crc_name: str, start: int, payload_len: int, pad: int) -> int:
    """``R(0, B)`` of the bytes ``B`` from ``start`` (bytes after the extension headers) to the
    ICRC: the rest of the payload pattern, then the pad's zero bytes."""
    from .transport.icrc import CRC16_VCRC, CRC32
    from .transport.render import PAYLOAD_PATTERN

    crc = CRC32 if crc_name == CRC32.name else CRC16_VCRC
    pattern = PAYLOAD_PATTERN[min(start, payload_len):payload_len].tobytes()
    return crc.register(0, pattern + bytes(payload_len + pad - max(start, payload_len)))


@dataclass
class Completion:
    """How the truncated frames of a batch are brought back to their original length.

    A truncated RoCEv2 or native InfiniBand frame whose headers (through the extension headers)
    were captured is completed as wiretrace renders frames (:mod:`wiretrace.transport.render`):
    the captured bytes, then the rest of the payload pattern (byte ``i`` of the payload is
    ``i mod 256``), zero pad bytes, the ICRC (and for native IB the VCRC) computed over the result,
    then zeros up to the original length (Ethernet minimum-size padding). A frame that
    ``generate --snaplen N`` cut comes back equal to what ``--snaplen 0`` writes. Other truncated
    frames (not RoCE, or headers cut) are padded with zeros.

    Attributes
    ----------
    rebuilt : (n,) bool, the frame is completed as above.
    payload_start : (n,) int64, offset of the payload in the frame.
    payload_len, pad : (n,) int64, IB payload and pad bytes.
    trailer : (n, 6) uint8, ICRC (4 bytes, little-endian) then VCRC (2 bytes, native IB only).
    trailer_len : (n,) int64, 4 (RoCEv2) or 6 (native IB).
    """

    rebuilt: np.ndarray
    payload_start: np.ndarray
    payload_len: np.ndarray
    pad: np.ndarray
    trailer: np.ndarray
    trailer_len: np.ndarray

    def tail(self, i: int, caplen: int, origlen: int) -> bytes:
        """Bytes ``caplen .. origlen`` of frame ``i`` (zeros unless the frame is rebuilt)."""
        if not self.rebuilt[i]:
            return bytes(origlen - caplen)
        from .transport.render import PAYLOAD_PATTERN

        ps, pl, pad = int(self.payload_start[i]), int(self.payload_len[i]), int(self.pad[i])
        icrc_at = ps + pl + pad
        end = icrc_at + int(self.trailer_len[i])
        parts = []
        if caplen < ps + pl:
            parts.append(PAYLOAD_PATTERN[caplen - ps:pl].tobytes())
        if max(caplen, ps + pl) < icrc_at:
            parts.append(bytes(icrc_at - max(caplen, ps + pl)))
        if caplen < end:
            parts.append(self.trailer[i, max(caplen - icrc_at, 0):end - icrc_at].tobytes())
        parts.append(bytes(origlen - max(caplen, end)))
        return b"".join(parts)


def complete_frames(batch) -> Completion:
    """Work out how to complete the truncated frames of ``batch`` (see :class:`Completion`).

    The CRCs are computed without materializing the missing bytes: by linearity, the register
    over the captured prefix (masked as for generation: :func:`wiretrace.transport.icrc.mask_rocev2`,
    :func:`~wiretrace.transport.icrc.mask_ib`) is advanced through the missing bytes and XORed
    with their contribution, computed once per distinct (start, payload length, pad).

    Parameters
    ----------
    batch : FrameBatch from :func:`wiretrace.io.capture.iter_frames`.

    Returns
    -------
    Completion

    References
    ----------
    IBTA vol. 1 7.8.1 (ICRC), 7.8.2 (VCRC), annex A17.4.1 (RoCEv2 ICRC).
    """
    from .transport import icrc as C
    from .transport.headers import ICRC_LEN, VCRC_LEN
    from .transport.parse import KIND_IB, KIND_IB_GRH, KIND_ROCE_V4, parse_frames

    n = len(batch)
    out = Completion(np.zeros(n, bool), np.zeros(n, np.int64), np.zeros(n, np.int64),
                     np.zeros(n, np.int64), np.zeros((n, ICRC_LEN + VCRC_LEN), np.uint8),
                     np.full(n, ICRC_LEN, np.int64))
    short = batch.caplen < batch.origlen
    if not short.any():
        return out
    cols = parse_frames(batch)
    row = cols["row"]
    l3 = cols["l3_offset"].astype(np.int64)
    ps = cols["bth_offset"].astype(np.int64) + 12 + cols["ext_len"].astype(np.int64)
    pl = cols["payload_len"].astype(np.int64)
    pad = cols["pad"].astype(np.int64)
    icrc_at = l3 + cols["ip_len"].astype(np.int64) - ICRC_LEN
    cap = cols["caplen"].astype(np.int64)
    ib = np.isin(cols["kind"], (KIND_IB, KIND_IB_GRH))
    ok = (short[row] & cols["has_ext"] & (pl >= 0) & (ps + pl + pad == icrc_at)
          & (cols["origlen"] >= icrc_at + ICRC_LEN + np.where(ib, VCRC_LEN, 0)))
    out.payload_start[row] = ps
    out.payload_len[row] = pl
    out.pad[row] = pad
    out.trailer_len[row] = np.where(ib, ICRC_LEN + VCRC_LEN, ICRC_LEN)
    sel = np.flatnonzero(ok)
    # group by layout (kind and where the IP header or LRH starts), then in bounded blocks
    layout = cols["kind"][sel].astype(np.int64) << 32 | l3[sel]
    for key in np.unique(layout).tolist():
        kind, start = key >> 32, key & 0xFFFFFFFF
        idx = sel[layout == key]
        for b0 in range(0, len(idx), REBUILD_ROWS):
            j = idx[b0:b0 + REBUILD_ROWS]
            have = np.minimum(cap[j], icrc_at[j]) - start          # captured bytes the ICRC covers
            width = int(have.max())
            pos = batch.offsets[row[j]][:, None] + start + np.arange(width)[None, :]
            inside = np.arange(width)[None, :] < have[:, None]
            prefix = np.where(inside, batch.data[np.where(inside, pos, 0)], 0).astype(np.uint8)
            missing = icrc_at[j] - start - have
            # distinct (start in payload, payload length, pad) of the missing bytes
            keys, inv = np.unique(np.stack([have + start - ps[j], pl[j], pad[j]], axis=1), axis=0,
                                  return_inverse=True)
            inv = inv.ravel()
            if kind in (KIND_IB, KIND_IB_GRH):
                masked = C.mask_ib(prefix, grh=kind == KIND_IB_GRH)
                reg = C.CRC32.of_rows(masked, have)
            else:
                masked = C.mask_rocev2(prefix, 4 if kind == KIND_ROCE_V4 else 6)
                reg = C.CRC32.of_rows(masked, have, state=C._STATE_AFTER_PSEUDO_LRH)
            tail = np.array([_tail_register(C.CRC32.name, *k) for k in keys.tolist()], dtype=np.uint32)[inv]
            value = (C.CRC32.shift(reg, missing) ^ tail) ^ np.uint32(C.CRC32.xorout)
            icrc = C.icrc_bytes(value)
            out.trailer[row[j], :ICRC_LEN] = icrc
            if kind in (KIND_IB, KIND_IB_GRH):
                # VCRC: LRH through ICRC, nothing masked
                r16 = C.CRC16_VCRC.of_rows(prefix, have)
                t16 = np.array([_tail_register(C.CRC16_VCRC.name, *k) for k in keys.tolist()],
                               dtype=np.uint16)[inv]
                r16 = C.CRC16_VCRC.update(C.CRC16_VCRC.shift(r16, missing) ^ t16, icrc)
                out.trailer[row[j], ICRC_LEN:] = C.vcrc_bytes(r16 ^ np.uint16(C.CRC16_VCRC.xorout))
            out.rebuilt[row[j]] = True
    return out


# --------------------------------------------------------------------------------------------
# replay
# --------------------------------------------------------------------------------------------


def replay(capture: str | Path, *, iface: str | None = None, udp: str | None = None,
           speed: float = 1.0, pps: float | None = None, mbps: float | None = None,
           topspeed: bool = False, loop: int = 1, engine: str = "native",
           rt_priority: int | None = None,
           progress: Callable[[int], None] | None = None) -> ReplayReport:
    """Replay ``capture`` on ``iface`` or to ``udp`` (exactly one of them).

    Parameters
    ----------
    capture : pcap, pcapng or ERF file.
    iface : Linux interface name (Ethernet or loopback), for raw frames.
    udp : ``HOST:PORT`` for the RoCE part of each frame as UDP datagrams.
    speed : multiplier of the recorded timing (2.0 replays twice as fast).
    pps : frames per second, overriding the recorded timing.
    mbps : megabits per second (10^6 bits/s of frame bytes), overriding the recorded timing.
    topspeed : send as fast as possible.
    loop : passes over the capture (>= 1).
    engine : ``native`` or ``tcpreplay`` (interface only).
    rt_priority : run the sender under SCHED_FIFO at this priority (root or CAP_SYS_NICE): frames
        leave within tens of microseconds of their due time even on a busy host.
    progress : called with the number of frames sent after each batch.

    Returns
    -------
    ReplayReport

    Raises
    ------
    WiretraceError : bad options, missing permission (raw sockets need root or CAP_NET_RAW), an
        interface that does not exist or is down, a link type the interface cannot carry, a frame
        longer than the interface MTU allows, tcpreplay missing or failing.
    """
    capture = Path(capture)
    if (iface is None) == (udp is None):
        raise WiretraceError("replay needs exactly one target: --iface IF or --udp HOST:PORT")
    rate_opts = sum(x is not None and x is not False for x in (pps, mbps, topspeed or None))
    if rate_opts > 1:
        raise WiretraceError("choose one of --pps, --mbps and --topspeed")
    for name, value in (("--speed", speed), ("--pps", pps), ("--mbps", mbps)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise WiretraceError(f"{name} {value:g}: expected a positive finite number")
    if loop < 1:
        raise WiretraceError(f"--loop {loop}: must be at least 1")
    if engine not in ("native", "tcpreplay"):
        raise WiretraceError(f"--engine {engine}: expected native or tcpreplay")
    with open_capture(capture) as cap:   # one clear line now when the file is not a capture
        declared = [i.linktype for i in cap.interfaces]
        fmt = cap.format
    if iface is not None and declared:
        # a pcap declares its link type up front: refuse before sending anything (pcapng and ERF
        # files are checked batch by batch as their interfaces appear)
        kind, _ = check_interface(iface)
        lt = np.array(declared)
        _check_linktypes(lt[lt != LINKTYPE_ERF], iface, kind)
    if rt_priority is not None:
        set_realtime(rt_priority)
    if engine == "tcpreplay":
        if iface is None:
            raise WiretraceError("--engine tcpreplay sends on interfaces only; use the native engine with --udp")
        return _replay_tcpreplay(capture, iface, speed, pps, mbps, topspeed, loop)
    if iface is not None:
        return _replay_native(capture, iface, None, speed, pps, mbps, topspeed, loop, progress, fmt)
    return _replay_native(capture, None, udp, speed, pps, mbps, topspeed, loop, progress, fmt)


def _udp_parts(batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start, length and (captured) available length of the RoCE part of each frame; -1 start
    for frames without a BTH."""
    from .transport.parse import KIND_IB, KIND_IB_GRH, parse_frames

    cols = parse_frames(batch)
    n = len(batch)
    start = np.full(n, -1, dtype=np.int64)
    length = np.zeros(n, dtype=np.int64)
    rows = cols["row"]
    ok = cols["has_bth"]
    bth = cols["bth_offset"].astype(np.int64)
    ib = np.isin(cols["kind"], (KIND_IB, KIND_IB_GRH))
    # RoCEv2: UDP payload = UDP length - 8; IB: LRH PktLen (4-byte words, LRH..ICRC) - BTH offset
    roce_len = cols["udp_len"].astype(np.int64) - 8
    ib_len = cols["lrh_pktlen"].astype(np.int64) * 4 - bth
    ln = np.where(ib, ib_len, roce_len)
    good = ok & (ln > 0)
    start[rows[good]] = bth[good]
    length[rows[good]] = ln[good]
    return start, length, cols


def _check_mtu(batch, iface: str, mtu: int) -> None:
    """Raise WiretraceError when a frame of ``batch`` (at its original length) does not fit the
    interface's MTU plus the Ethernet header."""
    origlen = batch.origlen.astype(np.int64)
    big = origlen > mtu + ETH_HEADER_LEN
    if big.any():
        i = int(np.argmax(big))
        raise WiretraceError(
            f"frame {batch.first + i + 1} is {int(origlen[i])} bytes, more than {iface}'s "
            f"MTU {mtu} + {ETH_HEADER_LEN}-byte header: raise it (ip link set {iface} mtu "
            f"{int(origlen.max()) - ETH_HEADER_LEN})")


def _replay_native(capture, iface, udp, speed, pps, mbps, topspeed, loop, progress, fmt="pcap") -> ReplayReport:
    rep = ReplayReport(engine="native", target=iface or udp)
    if iface is not None:
        kind, mtu = check_interface(iface)
        sock = _open_raw(iface)
        send = sock.send
    else:
        host, port, family = parse_hostport(udp)
        sock = socket.socket(family, socket.SOCK_DGRAM)
        addr = (host, port)

        def send(data, _s=sock.sendto, _a=addr):
            return _s(data, _a)
    pacer = _Pacer(speed, pps, mbps, topspeed)
    spin = RT_SPIN_NS if os.sched_getscheduler(0) == os.SCHED_FIFO else SPIN_NS
    errors = Distribution(classes=None, max_distinct=4096)
    err_sum = 0.0
    first_sent = last_sent = None
    last_bytes = 0
    t0 = None
    try:
        def prepared():
            """Each batch with what sending it needs: the part of each frame to send, its length,
            and the completion of truncated frames."""
            for batch in iter_frames(capture, on_truncated="warn"):
                n = len(batch)
                if n == 0:
                    continue
                caplen = batch.caplen.astype(np.int64)
                origlen = batch.origlen.astype(np.int64)
                skipped = 0
                if iface is not None:
                    _check_linktypes(batch.linktype, iface, kind, fmt)
                    _check_mtu(batch, iface, mtu)
                    part = np.zeros(n, dtype=np.int64)      # the whole frame
                    length = origlen
                else:
                    part, length, _ = _udp_parts(batch)
                    skip = part < 0
                    skipped = int(skip.sum())
                    length = np.where(skip, 0, length)
                short = caplen < origlen
                fill = complete_frames(batch) if short.any() else None
                yield batch, caplen, origlen, part, length, short, fill, skipped

        # a capture that fits in memory is prepared once, so that every pass starts on time
        cache = list(prepared()) if os.path.getsize(capture) <= REPLAY_CACHE_BYTES else None
        for k in range(loop):
            pacer.start_loop()
            for batch, caplen, origlen, part, length, short, fill, skipped in (cache if cache is not None
                                                                                 else prepared()):
                n = len(batch)
                data = batch.data
                offs = batch.offsets
                rep.skipped += skipped
                due = pacer.due(batch.ts_ns, length)
                if t0 is None:
                    t0 = time.perf_counter_ns() + 1_000_000   # 1 ms to settle
                sent_at = np.zeros(n, dtype=np.int64)
                sent = np.zeros(n, dtype=bool)
                mv = memoryview(data)
                for i in range(n):
                    ln = int(length[i])
                    if ln <= 0:
                        continue
                    a, cl = int(offs[i]), int(caplen[i])
                    p = int(part[i])
                    if short[i]:
                        frame = bytes(mv[a:a + cl]) + fill.tail(i, cl, int(origlen[i]))
                        frame = frame[p:p + ln]
                    else:
                        frame = mv[a + p:a + p + ln]
                    sent_at[i] = _wait_until(t0 + int(due[i]), spin)
                    try:
                        send(frame)
                    except OSError as e:
                        if e.errno == errno.EMSGSIZE:
                            raise WiretraceError(f"frame {batch.first + i + 1} ({ln} bytes) is too long for "
                                                 f"{iface or udp}: {e.strerror}") from None
                        if e.errno in (errno.ENETDOWN, errno.ENXIO, errno.ENODEV):
                            raise WiretraceError(f"{iface or udp}: {e.strerror} while sending") from None
                        raise WiretraceError(f"sending frame {batch.first + i + 1} to {iface or udp} "
                                             f"failed: {e.strerror}") from None
                    sent[i] = True
                    if short[i]:
                        rep.padded += 1
                        rep.zero_padded += int(not fill.rebuilt[i])
                if sent.any():
                    err = np.abs(sent_at[sent] - (t0 + due[sent]))
                    errors.add(err)
                    err_sum += float(err.sum())
                    idx = np.flatnonzero(sent)
                    if first_sent is None:
                        first_sent = int(sent_at[idx[0]])
                    last_sent = int(sent_at[idx[-1]])
                    rep.packets += int(sent.sum())
                    rep.bytes += int(length[sent].sum())
                    last_bytes = int(length[idx[-1]])
                if progress:
                    progress(rep.packets)
            rep.loops = k + 1
    finally:
        sock.close()
    if rep.packets:
        rep.duration_ns = int(last_sent - first_sent)
        if rep.duration_ns > 0 and rep.packets > 1:
            rep.achieved_pps = (rep.packets - 1) * 1e9 / rep.duration_ns
            rep.achieved_bps = (rep.bytes - last_bytes) * 8e9 / rep.duration_ns
        if not topspeed:     # as fast as possible: no schedule, so no timing error to report
            rep.timing_error_mean_ns = err_sum / errors.count
            rep.timing_error_p99_ns = errors.percentile(99)
            rep.timing_error_max_ns = errors.max
    return rep


def _replay_tcpreplay(capture, iface, speed, pps, mbps, topspeed, loop) -> ReplayReport:
    exe = shutil.which("tcpreplay")
    if exe is None:
        raise WiretraceError("--engine tcpreplay: tcpreplay is not installed (apt install tcpreplay)")
    if os.geteuid() != 0:
        # tcpreplay opens a raw socket too; say so before it fails less clearly
        try:
            socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0).close()
        except PermissionError:
            raise WiretraceError("replay --iface needs a raw socket: run as root or grant CAP_NET_RAW") from None
    kind, mtu = check_interface(iface)
    padded = 0
    truncated = False
    with open_capture(capture) as cap:
        fmt = cap.format
    if fmt == "erf":
        raise WiretraceError(f"{capture}: tcpreplay cannot read ERF files; use the native engine")
    for batch in iter_frames(capture):
        _check_linktypes(batch.linktype, iface, kind)
        _check_mtu(batch, iface, mtu)           # tcpreplay would skip such frames and exit 0
        short = batch.caplen < batch.origlen
        padded += int(short.sum())
        truncated |= bool(short.any())
    with tempfile.TemporaryDirectory(prefix="wiretrace-replay-") as tmp:
        src = Path(capture)
        zero_padded = 0
        if truncated:
            src = Path(tmp) / "padded.pcap"
            zero_padded = _write_padded(capture, src)
        cmd = [exe, f"--intf1={iface}", f"--loop={loop}"]
        if topspeed:
            cmd.append("--topspeed")
        elif pps:
            cmd.append(f"--pps={pps:g}")
        elif mbps:
            cmd.append(f"--mbps={mbps:g}")
        elif speed != 1.0:
            cmd.append(f"--multiplier={speed:g}")
        cmd.append(str(src))
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise WiretraceError(f"tcpreplay failed: {_last_line(r.stderr or r.stdout)}")
    rep = _parse_tcpreplay(r.stdout + r.stderr, iface, loop, padded)
    rep.zero_padded = zero_padded * loop
    return rep


def _write_padded(capture: Path, out: Path) -> int:
    """Copy ``capture`` to a nanosecond pcap (dpkt's writer) with every truncated frame completed
    to its original length (:func:`complete_frames`); returns the frames padded with zeros.
    (tcprewrite --fixlen=pad pads with zeros and rewrites the MAC addresses of IPv6 frames to
    multicast ones, so it is not used.)"""
    import dpkt

    zero_padded = 0
    with open(out, "wb") as f:
        w = dpkt.pcap.Writer(f, snaplen=262144, linktype=LINKTYPE_ETHERNET, nano=True)
        for batch in iter_frames(capture):
            fill = complete_frames(batch)
            for i in range(len(batch)):
                frame = bytes(batch.frame(i))
                cl, ol = len(frame), int(batch.origlen[i])
                if cl < ol:
                    frame += fill.tail(i, cl, ol)
                    zero_padded += int(not fill.rebuilt[i])
                ts = Decimal(int(batch.ts_ns[i])) / Decimal(1_000_000_000)   # exact ns
                w.writepkt(frame, ts=ts)
    return zero_padded


def _last_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "no output"


def _parse_tcpreplay(out: str, iface: str, loop: int, padded: int) -> ReplayReport:
    """Read tcpreplay's ``Actual: N packets (B bytes) sent in S seconds`` and ``Rated:`` lines."""
    rep = ReplayReport(engine="tcpreplay", target=iface, loops=loop, padded=padded * loop)
    m = re.search(r"Actual:\s*(\d+)\s*packets\s*\((\d+)\s*bytes\)\s*sent in\s*([0-9.]+)\s*seconds", out)
    if not m:
        raise WiretraceError(f"tcpreplay output not understood: {_last_line(out)}")
    rep.packets, rep.bytes = int(m.group(1)), int(m.group(2))
    rep.duration_ns = int(float(m.group(3)) * 1e9)
    m = re.search(r"Rated:\s*([0-9.]+)\s*Bps,\s*([0-9.]+)\s*Mbps,\s*([0-9.]+)\s*pps", out)
    if m:
        rep.achieved_bps = float(m.group(2)) * 1e6
        rep.achieved_pps = float(m.group(3))
    return rep
