"""Send a capture onto a Linux interface or to a UDP socket, keeping (or scaling) its timing.

Two targets:

* ``iface``: every frame goes out unchanged through an ``AF_PACKET``/``SOCK_RAW`` socket bound to
  the interface (packet(7)); frames cut by a snap length are padded with zero bytes back to their
  original length (their ICRC then no longer matches the zeros, as with ``tcprewrite
  --fixlen=pad``). Needs root or ``CAP_NET_RAW``.
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
``--mbps``, ``--topspeed``, ``--loop``), after writing a padded copy when frames were truncated,
and parses its statistics.
"""

from __future__ import annotations

import errno
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
from .io.capture import LINKTYPE_ERF, LINKTYPE_ETHERNET, iter_frames, open_capture

ARPHRD_ETHER = 1
ARPHRD_LOOPBACK = 772
ARPHRD_INFINIBAND = 32
_ARPHRD_NAMES = {ARPHRD_ETHER: "Ethernet", ARPHRD_LOOPBACK: "loopback", ARPHRD_INFINIBAND: "InfiniBand (IPoIB)"}
_LINKTYPE_NAMES = {1: "Ethernet", 101: "raw IP", 113: "Linux cooked", 197: "ERF", 228: "raw IPv4",
                   229: "raw IPv6", 247: "InfiniBand", 276: "Linux cooked v2"}
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
    timing_error_mean_ns, timing_error_p99_ns, timing_error_max_ns : |actual - due| send time.
    padded : frames padded back to their original length.
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


def _check_linktypes(linktype: np.ndarray, iface: str, kind: int) -> None:
    bad = linktype != LINKTYPE_ETHERNET
    if bad.any():
        lt = int(linktype[np.argmax(bad)])
        raise WiretraceError(
            f"capture link type {lt} ({_LINKTYPE_NAMES.get(lt, 'unknown')}) cannot be sent on {iface} "
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
        return _replay_native(capture, iface, None, speed, pps, mbps, topspeed, loop, progress)
    return _replay_native(capture, None, udp, speed, pps, mbps, topspeed, loop, progress)


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


def _replay_native(capture, iface, udp, speed, pps, mbps, topspeed, loop, progress) -> ReplayReport:
    rep = ReplayReport(engine="native", target=iface or udp)
    if iface is not None:
        kind, mtu = check_interface(iface)
        max_frame = mtu + ETH_HEADER_LEN
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
        for k in range(loop):
            pacer.start_loop()
            for batch in iter_frames(capture, on_truncated="warn"):
                n = len(batch)
                if n == 0:
                    continue
                data = batch.data
                offs = batch.offsets
                caplen = batch.caplen.astype(np.int64)
                origlen = batch.origlen.astype(np.int64)
                if iface is not None:
                    _check_linktypes(batch.linktype, iface, kind)
                    big = origlen > max_frame
                    if big.any():
                        i = int(np.argmax(big))
                        raise WiretraceError(
                            f"frame {batch.first + i + 1} is {int(origlen[i])} bytes, more than {iface}'s "
                            f"MTU {mtu} + {ETH_HEADER_LEN}-byte header: raise it (ip link set {iface} mtu "
                            f"{int(origlen.max()) - ETH_HEADER_LEN})")
                    start = offs[:-1]
                    length = origlen
                    avail = caplen
                else:
                    part, length, _ = _udp_parts(batch)
                    start = offs[:-1] + np.maximum(part, 0)
                    avail = np.clip(caplen - part, 0, length)
                    skip = part < 0
                    rep.skipped += int(skip.sum())
                    length = np.where(skip, 0, length)
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
                    a = int(start[i])
                    av = int(avail[i])
                    frame = mv[a:a + av] if av >= ln else bytes(mv[a:a + av]) + bytes(ln - av)
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
                    if av < ln:
                        rep.padded += 1
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
        short = batch.caplen < batch.origlen
        padded += int(short.sum())
        truncated |= bool(short.any())
    with tempfile.TemporaryDirectory(prefix="wiretrace-replay-") as tmp:
        src = Path(capture)
        if truncated:
            src = Path(tmp) / "padded.pcap"
            _write_padded(capture, src)
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
    return _parse_tcpreplay(r.stdout + r.stderr, iface, loop, padded)


def _write_padded(capture: Path, out: Path) -> None:
    """Copy ``capture`` to a nanosecond pcap (dpkt's writer) with every truncated frame padded
    with zeros to its original length. (tcprewrite --fixlen=pad also rewrites the MAC addresses
    of IPv6 frames to multicast ones, so it is not used.)"""
    import dpkt

    with open(out, "wb") as f:
        w = dpkt.pcap.Writer(f, snaplen=262144, linktype=LINKTYPE_ETHERNET, nano=True)
        for batch in iter_frames(capture):
            for i in range(len(batch)):
                frame = batch.frame(i)
                pad = int(batch.origlen[i]) - len(frame)
                ts = Decimal(int(batch.ts_ns[i])) / Decimal(1_000_000_000)   # exact ns
                w.writepkt(frame + bytes(max(pad, 0)), ts=ts)


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
