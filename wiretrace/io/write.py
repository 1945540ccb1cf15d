"""Streaming capture writing shared by the pcap, pcapng and ERF writers.

A writer takes the packets table as time-ordered chunks, renders each chunk's frames into a slot
array with room for the format's record header before each frame (and trailer after it), fills the
record headers with column stores, and hands the rows to the kernel with ``os.writev`` — no
per-packet Python code, no extra copy of the frame bytes. Producing the next chunk (the caller's
generator), rendering and writing run on three threads at once (:func:`write_stream`); whole
frames are rendered in pieces of :data:`SLOT_BYTES` so that memory stays bounded. Payloads are
deterministic (:data:`~wiretrace.transport.render.PAYLOAD_PATTERN`): when frames carry long ones,
only headers and trailers are rendered and each record goes out as its row's bytes before the
payload, then the pattern itself; the bytes after the payload are moved to the row's end so that
they join the next record's (two iovecs a record). Payload bytes are copied once, by the kernel.

Files are written under a temporary name beside the target and renamed when complete, so a failed
run leaves nothing behind. :func:`write_capture` adds the two ways of cutting a capture: one file
per NIC (``split="nic"``, the frames each NIC sends) and rotation at a size (``max_file_size``,
like ``tcpdump -C``: ``out.pcap``, ``out.pcap1``, ``out.pcap2``, ...).
"""

from __future__ import annotations

import abc
import ctypes
import errno
import os
import sys
import queue
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from ..errors import WiretraceError
from ..plan import Plan
from ..topology import Topology
from ..transport.render import PAYLOAD_PATTERN, payload_spans, render_slots, slot_runs, take_rows

IOV_MAX = 1024
MAX_OPEN_FILES = 256
"""Files kept open at once by ``split="nic"`` (the rest are reopened for appending)."""


class Format(abc.ABC):
    """A capture format: file header, per-record prefix/suffix, record header filling.

    Subclasses: :class:`wiretrace.io.pcap.Pcap`, :class:`wiretrace.io.pcapng.Pcapng`,
    :class:`wiretrace.io.erf.Erf`.
    """

    name = ""
    suffixes: tuple[str, ...] = ()
    prefix = 0
    suffix = 0
    single_interface = False
    """Records of one file all come from one NIC, declared as the file's only interface."""

    def __init__(self, topo: Topology, plan: Plan, snaplen: int):
        self.topo, self.plan, self.snaplen = topo, plan, snaplen

    def file_header(self, nics: np.ndarray | None = None) -> bytes:
        """File header; ``nics``: the NICs whose frames the file holds (None: all)."""
        return b""

    @abc.abstractmethod
    def finish_records(self, slots: np.ndarray, chunk: dict, caplen: np.ndarray,
                       origlen: np.ndarray) -> np.ndarray:
        """Fill record headers (and trailers) in ``slots``; return each record's length."""


def _libc_writev():
    """libc's ``writev`` through ctypes (the GIL is released during the call), or None."""
    try:
        f = ctypes.CDLL(None, use_errno=True).writev
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    f.restype = ctypes.c_ssize_t
    return f


_WRITEV = _libc_writev()


def _writev_iov(fd: int, iov: np.ndarray) -> int:
    """Write the memory ranges of ``iov`` (``(k, 2)`` uintp rows ``{address, length}``, a
    ``struct iovec`` array), in order, with one ``writev`` per :data:`IOV_MAX` ranges; short
    writes go on from where the kernel stopped. Returns the bytes written."""
    total = 0
    i = 0
    while i < len(iov):
        batch = iov[i:i + IOV_MAX]
        want = int(batch[:, 1].sum())
        done = _WRITEV(fd, batch.ctypes.data, len(batch))
        if done < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, os.strerror(err))
        total += done
        if done == want:
            i += len(batch)
            continue
        full = int(np.searchsorted(np.cumsum(batch[:, 1]), done, side="right"))
        i += full
        skip = done - int(batch[:full, 1].sum())
        iov[i, 0] += np.uintp(skip)
        iov[i, 1] -= np.uintp(skip)
    return total


def _writev_runs(fd: int, base: int, starts: np.ndarray, ends: np.ndarray) -> int:
    """Write the byte ranges ``[starts[i], ends[i])`` of the memory at address ``base``, in
    order (an iovec array built with NumPy: no Python object per range). Returns the bytes
    written."""
    iov = np.empty((len(starts), 2), dtype=np.uintp)        # struct iovec {base, len}
    iov[:, 0] = np.uintp(base) + starts.astype(np.uintp)
    iov[:, 1] = (ends - starts).astype(np.uintp)
    return _writev_iov(fd, iov)


Holes = tuple[np.ndarray, np.ndarray]
"""Per row ``(at, length)``: the row's bytes ``at .. at + length`` are the payload pattern
(:data:`wiretrace.transport.render.PAYLOAD_PATTERN`), sent from the pattern itself."""

_PATTERN_ADDR = PAYLOAD_PATTERN.ctypes.data


def _hole_iovecs(slots: np.ndarray, rows: np.ndarray, lengths: np.ndarray, holes: Holes) -> np.ndarray:
    """iovecs of records ``rows`` of ``slots``: each row's bytes before its hole, the payload
    pattern, then the row's bytes after the hole, which :func:`_tails_to_row_ends` moved to the
    end of the row, so that they and the next row's first bytes are one range (empty ranges
    dropped, touching ranges merged: about two iovecs a record instead of three)."""
    width = slots.shape[1]
    at, ln = (np.asarray(h, dtype=np.int64) for h in holes)
    lengths = np.asarray(lengths, dtype=np.int64)
    start = rows.astype(np.int64) * width
    has = ln > 0
    iov = np.empty((len(rows), 3, 2), dtype=np.uintp)
    base = np.uintp(slots.ctypes.data)
    tail = np.where(has, lengths - at - ln, 0)
    iov[:, 0, 0] = base + start.astype(np.uintp)
    iov[:, 0, 1] = np.where(has, at, lengths).astype(np.uintp)
    iov[:, 1, 0] = np.uintp(_PATTERN_ADDR)
    iov[:, 1, 1] = ln.astype(np.uintp)
    iov[:, 2, 0] = base + (start + width - tail).astype(np.uintp)
    iov[:, 2, 1] = tail.astype(np.uintp)
    iov = iov.reshape(-1, 2)
    iov = iov[iov[:, 1] > 0]
    if len(iov) < 2:
        return iov
    touch = iov[:-1, 0] + iov[:-1, 1] == iov[1:, 0]
    if not touch.any():
        return iov
    first = np.flatnonzero(np.r_[True, ~touch])
    out = iov[first]
    out[:, 1] = np.add.reduceat(iov[:, 1], first)
    return out


def _tails_to_row_ends(slots: np.ndarray, lengths: np.ndarray, holes: Holes) -> None:
    """Move the bytes after each row's payload hole (pad, ICRC/VCRC, record trailer: at most a
    few bytes) to the end of the row, into space the record does not use, so that they run
    on into the next row (see :func:`_hole_iovecs`)."""
    n, width = slots.shape
    at, ln = (np.asarray(h, dtype=np.int64) for h in holes)
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.flatnonzero((ln > 0) & (lengths < width))
    if not len(rows):
        return
    src_at = at[rows] + ln[rows]
    k = lengths[rows] - src_at                     # tail bytes
    flat = slots.reshape(-1)
    base = rows * width
    src = base + src_at
    dst = base + width - k
    moved = []
    for j in range(int(k.max()) if len(k) else 0):     # gather every byte before writing any
        sel = np.flatnonzero(j < k)
        moved.append((sel, flat[src[sel] + j]))
    for j, (sel, b) in enumerate(moved):
        flat[dst[sel] + j] = b


def _write_rows(fd: int, slots: np.ndarray, lengths: np.ndarray, holes: Holes | None = None,
                rows: np.ndarray | None = None) -> int:
    """Write the first ``lengths[i]`` bytes of each row of ``slots`` (C-contiguous), in order;
    ``rows``: only these rows (``lengths`` and ``holes`` are theirs); ``holes``: ranges sent
    from the payload pattern instead of the row (see :data:`Holes`)."""
    if _WRITEV is None or not slots.flags.c_contiguous:
        if holes is not None:
            raise ValueError("payload holes need libc writev and C-contiguous slots")
        sub = slots if rows is None else slots[rows]
        starts, ends = slot_runs(sub, lengths)
        flat = memoryview(np.ascontiguousarray(sub).reshape(-1))
        return _writev_all(fd, [flat[s:e] for s, e in zip(starts.tolist(), ends.tolist())])
    if holes is not None:
        r = np.arange(len(slots)) if rows is None else rows
        return _writev_iov(fd, _hole_iovecs(slots, r, lengths, holes))
    if rows is not None:
        starts = rows.astype(np.int64) * slots.shape[1]
        ends = starts + np.asarray(lengths, dtype=np.int64)
        keep = ends > starts
        return _writev_runs(fd, slots.ctypes.data, starts[keep], ends[keep])
    starts, ends = slot_runs(slots, lengths)
    return _writev_runs(fd, slots.ctypes.data, starts, ends)


def _writev_all(fd: int, pieces: list) -> int:
    total = 0
    for i in range(0, len(pieces), IOV_MAX):
        batch = pieces[i:i + IOV_MAX]
        want = sum(map(len, batch))
        done = os.writev(fd, batch)
        while done < want:  # partial write: continue from where the kernel stopped
            rest, skip = [], done
            for p in batch:
                if skip >= len(p):
                    skip -= len(p)
                    continue
                rest.append(p[skip:])
                skip = 0
            batch = rest
            want -= done
            done = os.writev(fd, batch)
        total += sum(map(len, pieces[i:i + IOV_MAX]))
    return total


class _File:
    """One output file under a temporary name; ``commit`` renames it into place."""

    def __init__(self, path: Path, header: bytes):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".part", dir=self.path.parent)
        self.fd, self.tmp = fd, Path(name)
        os.fchmod(fd, 0o644)               # mkstemp creates 0600; captures are ordinary files
        self.size = 0
        self.packets = 0
        if header:
            self.size += _writev_all(fd, [memoryview(header)])

    def write(self, slots: np.ndarray, lengths: np.ndarray, holes: Holes | None = None,
              rows: np.ndarray | None = None) -> None:
        """Append the first ``lengths[i]`` bytes of each row of ``slots`` (one record a row; only
        ``rows`` when given), payload ``holes`` sent from the pattern (see :func:`_write_rows`).
        An OSError names the output (``filename``)."""
        try:
            self.size += _write_rows(self._open(), slots, lengths, holes, rows)
        except OSError as e:
            raise self._named(e) from None
        self.packets += len(lengths)

    def write_iov(self, iov: np.ndarray, records: int) -> None:
        """Append the byte ranges ``iov`` (a ``struct iovec`` array, see :func:`_writev_iov`)
        holding ``records`` records."""
        try:
            self.size += _writev_iov(self._open(), iov)
        except OSError as e:
            raise self._named(e) from None
        self.packets += records

    def _named(self, e: OSError) -> OSError:
        """``e`` with this output as its file name (a closed pipe stays a BrokenPipeError)."""
        name = "standard output" if str(self.path) == STDOUT else str(self.path)
        return type(e)(e.errno, e.strerror or os.strerror(e.errno or 0), name)

    def _open(self) -> int:
        if self.fd < 0:                    # closed to stay under the open-file limit: reopen
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_APPEND)
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def commit(self) -> None:
        self.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.close()
        self.tmp.unlink(missing_ok=True)


class _Stdout(_File):
    """The capture streamed to standard output (``-o -``): no temporary name, nothing to rename
    or remove; what was written stays written."""

    def __init__(self, header: bytes):
        self.path = Path("-")
        self.fd = sys.stdout.fileno()
        self.tmp = None
        self.size = 0
        self.packets = 0
        if header:
            self.size += _writev_all(self.fd, [memoryview(header)])

    def _open(self) -> int:
        return self.fd

    def close(self) -> None:
        """Standard output stays open (the process closes it)."""

    def commit(self) -> None:
        """Nothing to rename."""

    def abort(self) -> None:
        """A stream cannot be taken back."""


STDOUT = "-"
"""The output name that streams the capture to standard output."""


BY_REFERENCE_BYTES = 512
"""Chunks whose frames capture this many payload bytes on average send the payload from
:data:`~wiretrace.transport.render.PAYLOAD_PATTERN` (one more iovec a record) instead of
rendering it into every row: the bytes are then copied once, by the kernel, as by one write()."""


def _records(fmt: Format, chunk: dict, buf: np.ndarray | None):
    """Render ``chunk`` into slot rows with their record headers: ``(slots, reclen, holes)``,
    ``holes`` (see :data:`Holes`) None when the payload was rendered into the rows."""
    holes = None
    if _WRITEV is not None and len(chunk["ts_ns"]) and not 0 < fmt.snaplen < BY_REFERENCE_BYTES:
        at, ln = payload_spans(chunk, fmt.topo, fmt.plan, fmt.snaplen, prefix=fmt.prefix)
        if ln.mean() >= BY_REFERENCE_BYTES:
            holes = (at, ln)
    slots, caplen, origlen = render_slots(chunk, fmt.topo, fmt.plan, fmt.snaplen, prefix=fmt.prefix,
                                          out=buf, suffix=fmt.suffix, payload=holes is None)
    reclen = fmt.finish_records(slots, chunk, caplen, origlen)
    if holes is not None:
        _tails_to_row_ends(slots, reclen, holes)
    return slots, reclen, holes


SLOT_BYTES = 32 << 20
"""Bytes of frames rendered at once: whole 4 KiB frames are cut into pieces of this size so the
slot buffer stays small and is reused."""


def _byte_bounded(chunk: dict, fmt: Format) -> Iterator[dict]:
    """``chunk`` cut into row ranges whose captured bytes stay near :data:`SLOT_BYTES`."""
    fl = np.asarray(chunk["frame_len"])
    n = len(fl)
    longest = int(fl.max()) if n else 0
    width = (longest if fmt.snaplen <= 0 else min(longest, fmt.snaplen)) + fmt.prefix + fmt.suffix if n else 0
    rows = max(1, SLOT_BYTES // max(width, 1))
    if n <= rows:
        yield chunk
        return
    for lo in range(0, n, rows):
        yield take_rows(chunk, slice(lo, lo + rows))


def _rotated_name(path: Path, i: int) -> Path:
    return path if i == 0 else path.with_name(path.name + str(i))


def _append_rotating(f: _File, rotate: Callable[[], _File], slots: np.ndarray, reclen: np.ndarray,
                     max_file_size: int | None, holes: Holes | None = None,
                     rows: np.ndarray | None = None) -> _File:
    """Append records ``slots``/``reclen`` (``rows`` of ``slots`` when given, ``holes`` theirs) to
    ``f``; before a file would grow past
    ``max_file_size`` bytes, close it and go on in ``rotate()`` (a record larger than the limit
    gets a file of its own). Returns the file written last."""
    n = len(reclen)
    lo = 0
    while lo < n:
        hi = n
        if max_file_size is not None:
            cum = np.cumsum(reclen[lo:])
            hi = lo + int(np.searchsorted(cum, max_file_size - f.size, side="right"))
            if hi == lo:
                if f.packets == 0:
                    hi = lo + 1
                else:
                    f.close()
                    f = rotate()
                    continue
        h = None if holes is None else (holes[0][lo:hi], holes[1][lo:hi])
        if rows is None:
            f.write(slots[lo:hi], reclen[lo:hi], h)
        else:
            f.write(slots, reclen[lo:hi], h, rows[lo:hi])
        lo = hi
    return f


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under ``taskset``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def write_stream(path: str | Path, packet_chunks: Iterable[dict], fmt: Format,
                 max_file_size: int | None = None,
                 progress: Callable[[int], None] | None = None) -> dict:
    """Write all chunks into one capture (rotating at ``max_file_size`` bytes when given).

    Returns
    -------
    dict: ``packets``, ``bytes`` (file bytes), ``files`` (paths written, in order).
    """
    path = Path(path)
    header = fmt.file_header()
    if max_file_size is not None and max_file_size <= len(header):
        raise WiretraceError(f"--max-file-size {max_file_size} is smaller than the {fmt.name} file header")
    files: list[_File] = []
    to_stdout = str(path) == STDOUT
    if to_stdout and max_file_size is not None:
        raise WiretraceError("--max-file-size: standard output (-o -) is one stream; rotation needs files")

    def put(slots: np.ndarray, reclen: np.ndarray, holes: Holes | None, iov: np.ndarray | None) -> None:
        """Append one chunk's records (runs on the I/O thread, one chunk after another); ``iov``:
        the records' iovecs, already built (no rotation)."""
        if iov is not None:
            files[-1].write_iov(iov, len(reclen))
            return

        def rotate() -> _File:
            files.append(_File(_rotated_name(path, len(files)), header))
            return files[-1]

        _append_rotating(files[-1], rotate, slots, reclen, max_file_size, holes)

    # Three stages overlap: the caller's generator (packetize, Parquet) on this thread, rendering
    # on one worker, os.writev on another (NumPy loops and writev release the GIL); with one
    # usable CPU all three run on this thread. Three slot buffers circulate between renderer and
    # writer and at most two chunks wait for rendering, so memory stays bounded.
    free: queue.Queue = queue.Queue()
    for _ in range(3):
        free.put(None)
    writes: list[Future] = []

    def write_and_release(slots, reclen, holes, iov, flat) -> None:
        try:
            put(slots, reclen, holes, iov)
        finally:
            free.put(flat)

    def render(chunk: dict) -> None:
        for part in _byte_bounded(chunk, fmt):
            flat = free.get()
            try:
                slots, reclen, holes = _records(fmt, part, flat)
            except BaseException:
                free.put(flat)
                raise
            if flat is None or flat.size < slots.size:
                flat = slots.reshape(-1)
            iov = None
            if holes is not None and max_file_size is None:
                # the iovecs are built here, so the I/O thread only calls writev
                iov = _hole_iovecs(slots, np.arange(len(reclen)), reclen, holes)
            if inline:                              # one CPU: nothing to overlap the write with
                write_and_release(slots, reclen, holes, iov, flat)
            else:
                writes.append(writer.submit(write_and_release, slots, reclen, holes, iov, flat))

    inflight: list[Future] = []
    packets = 0
    # With one CPU to run on, the threads only add GIL hand-offs and keep more slot buffers in
    # use: render and write on the caller's thread, one chunk after another.
    inline = usable_cpus() < 2
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="wiretrace-write") as writer, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="wiretrace-render") as renderer:
        try:
            files.append(_Stdout(header) if to_stdout else _File(_rotated_name(path, 0), header))
            for chunk in packet_chunks:
                n = len(chunk["ts_ns"])
                if n == 0:
                    continue
                if inline:
                    render(chunk)
                else:
                    while len(inflight) >= 2:
                        inflight.pop(0).result()
                    inflight.append(renderer.submit(render, chunk))
                packets += n
                if progress:
                    progress(packets)
                while writes and writes[0].done():
                    writes.pop(0).result()       # surface a failed write early
            for f in inflight:
                f.result()
            for f in list(writes):
                f.result()
            for f in files:
                f.commit()
        except BaseException:
            for f in inflight:
                f.cancel()
            renderer.shutdown(wait=True)
            for f in list(writes):
                f.cancel()
            writer.shutdown(wait=True)
            for f in files:
                f.abort()
            raise
    return {"packets": packets, "bytes": sum(f.size for f in files), "files": [str(f.path) for f in files]}


def write_split_nic(directory: str | Path, packet_chunks: Iterable[dict], fmt: Format,
                    max_file_size: int | None = None,
                    progress: Callable[[int], None] | None = None) -> dict:
    """One capture per NIC in ``directory``, holding the frames that NIC sends, named after the
    NIC (``node0-mlx5_1.pcap``); a pcapng file declares that NIC's interface only. Each file is
    streamed like :func:`write_stream`; with ``max_file_size`` each NIC's capture rotates on its
    own, like ``tcpdump -C`` (``node0-mlx5_1.pcap``, ``node0-mlx5_1.pcap1``, ...)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ext = fmt.suffixes[0]
    fmt.single_interface = True                    # records name interface 0: their file's NIC
    writers: dict[int, _File] = {}
    lru: dict[int, _File] = {}                     # open files, least recently written first
    headers: dict[int, bytes] = {}
    buf: list[np.ndarray | None] = [None]
    count: dict[int, int] = {}                     # files opened per NIC
    all_files: list[_File] = []

    def open_file(nic: int) -> _File:
        if nic not in headers:
            headers[nic] = fmt.file_header(np.array([nic]))
            if max_file_size is not None and max_file_size <= len(headers[nic]):
                raise WiretraceError(f"--max-file-size {max_file_size} is smaller than the {fmt.name} "
                                     f"file header")
        i = count.get(nic, 0)
        count[nic] = i + 1
        name = fmt.topo.nic_name(nic).replace("/", "-")
        f = _File(_rotated_name(directory / f"{name}{ext}", i), headers[nic])
        all_files.append(f)
        return f

    def put(chunk: dict) -> None:
        # the chunk's rows grouped by NIC (in time order within a NIC) before rendering, so that
        # each NIC's records are one run of rows: a few iovecs per NIC, not one per record
        src = np.asarray(chunk["src_nic"], dtype=np.int64)
        order = np.argsort(src, kind="stable")
        s = src[order]
        if (order != np.arange(len(order))).any():
            chunk = take_rows(chunk, order)
        slots, reclen, holes = _records(fmt, chunk, buf[0])
        if buf[0] is None or buf[0].size < slots.size:
            buf[0] = slots.reshape(-1)
        bounds = np.flatnonzero(np.r_[True, s[1:] != s[:-1], True])
        for i in range(len(bounds) - 1):      # one iteration per NIC present in the chunk
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            nic = int(s[lo])
            f = writers.get(nic)
            if f is None:
                f = open_file(nic)
            h = None if holes is None else (holes[0][lo:hi], holes[1][lo:hi])
            f = _append_rotating(f, lambda nic=nic: open_file(nic), slots[lo:hi], reclen[lo:hi], max_file_size, h)
            writers[nic] = f
            lru.pop(nic, None)
            lru[nic] = f
            if len(lru) > MAX_OPEN_FILES:       # close the least recently written file
                oldest = next(iter(lru))
                lru.pop(oldest).close()

    packets = 0
    try:
        for chunk in packet_chunks:
            n = len(chunk["ts_ns"])
            if n == 0:
                continue
            for part in _byte_bounded(chunk, fmt):
                put(part)
            packets += n
            if progress:
                progress(packets)
        for f in all_files:
            f.commit()
    except BaseException:
        for f in all_files:
            f.abort()
        raise
    return {"packets": packets, "bytes": sum(f.size for f in all_files),
            "files": [str(f.path) for f in all_files]}


FORMATS = ("pcap", "pcapng", "erf")
SUFFIX_FORMATS = {".pcapng": "pcapng", ".erf": "erf", ".pcap": "pcap", ".cap": "pcap"}
"""Capture format of each file suffix wiretrace knows (others get pcap)."""


def format_for(path: str | Path, fmt: str | None = None) -> str:
    """Capture format from ``fmt`` or the file suffix (.pcap, .pcapng, .erf; default pcap)."""
    if fmt:
        if fmt not in FORMATS:
            raise WiretraceError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
        return fmt
    return SUFFIX_FORMATS.get(Path(path).suffix.lower(), "pcap")


def make_format(name: str, topo: Topology, plan: Plan, snaplen: int) -> Format:
    if snaplen < 0:
        raise WiretraceError(f"--snaplen {snaplen}: expected 0 (whole frames) or a positive byte count")
    if name == "pcap":
        from .pcap import Pcap
        return Pcap(topo, plan, snaplen)
    if name == "pcapng":
        from .pcapng import Pcapng
        return Pcapng(topo, plan, snaplen)
    if name == "erf":
        from .erf import Erf
        return Erf(topo, plan, snaplen)
    raise WiretraceError(f"unknown capture format {name!r}; expected one of {', '.join(FORMATS)}")


def write_capture(path: str | Path, packet_chunks: Iterable[dict], topo: Topology, plan: Plan,
                  snaplen: int = 128, fmt: str | None = None, split: str | None = None,
                  max_file_size: int | None = None,
                  progress: Callable[[int], None] | None = None) -> dict:
    """Write packets as a capture file (or files).

    Parameters
    ----------
    path : output file; with ``split="nic"`` a directory that receives one file per NIC.
    packet_chunks : iterable of packets-table column dicts, time-ordered (as
        :func:`wiretrace.transport.packetize` yields them).
    topo, plan : addresses and transport settings used to render frames.
    snaplen : bytes kept per frame; 0 keeps whole frames. The original length is always recorded.
    fmt : ``"pcap"`` (nanosecond pcap), ``"pcapng"`` or ``"erf"``; default from the suffix.
    split : None, or ``"nic"``.
    max_file_size : rotate to a new file before a file would exceed this many bytes.
    progress : called with the number of packets written so far after each chunk.

    Returns
    -------
    dict with ``packets``, ``bytes`` and ``files`` (every path written).

    Raises
    ------
    WiretraceError : unknown format or split mode, negative snaplen, a size limit below the file
        header. Nothing is left behind on any error.
    """
    name = format_for(path, fmt)
    f = make_format(name, topo, plan, snaplen)
    if split not in (None, "nic"):
        raise WiretraceError(f"--split {split!r}: expected nic")
    if split == "nic":
        return write_split_nic(path, packet_chunks, f, max_file_size, progress)
    return write_stream(path, packet_chunks, f, max_file_size, progress)


def chunks_of(packets: dict, size: int = 1 << 19) -> Iterator[dict]:
    """Cut one packets table into chunks of ``size`` rows (for writing an in-memory table)."""
    n = len(packets["ts_ns"])
    for lo in range(0, n, size):
        yield {k: np.asarray(v)[lo:lo + size] for k, v in packets.items()}
