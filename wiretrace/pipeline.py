"""The main job, stage by stage: plan (or measured schedule) -> collectives -> messages -> packets.

:func:`run_generate` is what ``wiretrace generate`` calls. It wires the stages in the order of the
pipeline and owns only the plumbing: shards, selection (``--ranks``, ``--parallelism``,
``--window``), the packet-count estimate, and atomic output (temporary names renamed at the end,
nothing left behind on error).

Shards: the collectives table is small; its messages are not. Calls whose communicator spans nodes
are lowered and timed together (so that their messages share NICs first come, first served);
NVLink-only communicators are lowered in shards of whole communicators. Network messages are far
fewer than packets (one per 512 KiB slice at most) and are kept for the transport stage, which
produces packets in bounded, time-ordered chunks.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import tables, timing, topology
from .errors import WiretraceError
from .io.parquet import TableWriter
from .plan import Plan

NVLINK_SHARD_MESSAGES = 2_000_000
"""Target number of messages per NVLink-only shard."""

WINDOW_LOOKAHEAD_NS = 1_000_000
"""With --window, network messages that start up to this long after the window's end still go
to the transport (an RDMA READ's request leaves before its data), so that the frames inside the
window are exactly those of the whole iteration's capture."""

CNP_OPCODE = 0x81
"""BTH opcode of a RoCEv2 CNP: its 16 reserved bytes are not payload."""


@dataclass(frozen=True)
class Selection:
    """What part of the iteration to keep: ranks (either end), parallelisms, time window (ns)."""

    ranks: frozenset[int] | None = None
    parallelism: frozenset[str] | None = None
    window: tuple[int, int] | None = None


@dataclass
class Summary:
    """Headline numbers of one generate run (printed by the CLI)."""

    collectives: int = 0
    messages: int = 0
    network_messages: int = 0
    nvlink_messages: int = 0
    packets: int = 0
    network_bytes: int = 0            # IB payload bytes of the frames written
    wire_bytes: int = 0               # bytes of all frames (frame_len)
    iteration_ns: int = 0
    last_message_ns: int = 0
    outputs: list[str] = field(default_factory=list)
    estimate: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    tcp_messages: int = 0
    ce_marked: int = -1               # data packets marked CE (-1: no ECN marking in the plan)
    cnps: int = -1                    # CNPs sent (-1: no ECN marking in the plan)


# ---------------------------------------------------------------------------- selection


def parse_ranks(text: str | None) -> frozenset[int] | None:
    """``"0-3,8,12-13"`` -> {0,1,2,3,8,12,13}; raises WiretraceError on bad syntax."""
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise WiretraceError(f"--ranks: expected ranks like 0-3,8 but got {part!r}") from None
    return frozenset(out)


PARALLELISMS = ("dp", "tp", "sp", "pp", "cp", "ep", "other")


def parse_parallelism(text: str | None) -> frozenset[str] | None:
    if not text:
        return None
    names = {p.strip() for p in text.split(",") if p.strip()}
    bad = sorted(names - set(PARALLELISMS))
    if bad:
        raise WiretraceError(f"--parallelism: unknown {', '.join(bad)}; expected some of {','.join(PARALLELISMS)}")
    return frozenset(names)


def parse_window(text: str | None) -> tuple[int, int] | None:
    """``"START:END"`` in ns, or with units (``"1ms:2.5ms"``); END may be empty (to the end)."""
    if not text:
        return None
    from .plan import parse_duration_ns

    if ":" not in text:
        raise WiretraceError(f"--window: expected START:END (ns or with units), got {text!r}")
    a, b = text.split(":", 1)

    def one(v: str, default: int) -> int:
        v = v.strip()
        if not v:
            return default
        if v.isdigit():
            return int(v)
        try:
            return parse_duration_ns(v, "--window")
        except WiretraceError:
            raise WiretraceError(f"--window: expected START:END in ns (e.g. 0:5000000 or 0:5ms), got {text!r}") from None

    lo, hi = one(a, 0), one(b, np.iinfo(np.int64).max)
    if hi <= lo:
        raise WiretraceError(f"--window: END ({hi}) must be after START ({lo})")
    return lo, hi


# ---------------------------------------------------------------------------- schedule


@dataclass
class Measured:
    """A measured schedule ready for lowering.

    ``rings``: complete ring orders read from an NCCL log (channel -> ranks), followed by the
    lowering; ``tcp_pairs``: (src, dst) rank pairs that NCCL connected over ``NET/Socket`` (TCP,
    not RDMA): their messages stay in the messages table but are not rendered as RoCEv2;
    ``tcp_network``: the run's network was NET/Socket (every connection the log shows over a
    network is, none over NET/IB, or NCCL said "Using network Socket"): NCCL runs one network
    module for all of a process's connections, so every network message was TCP, logged or not;
    ``notes``: what was dropped and why.
    """

    table: pa.Table
    rings: dict = field(default_factory=dict)
    tcp_pairs: frozenset = frozenset()
    tcp_network: bool = False
    notes: list = field(default_factory=list)

    def over_tcp(self, msgs: dict, is_net: np.ndarray) -> np.ndarray:
        """Which of the network messages ``msgs`` (``is_net`` marks them) NCCL sent over TCP."""
        if self.tcp_network:
            return is_net.copy()
        if not self.tcp_pairs or not is_net.any():
            return np.zeros(len(is_net), dtype=bool)
        tcp = np.asarray(sorted(self.tcp_pairs), dtype=np.int64).reshape(-1, 2)
        pair = msgs["src_rank"].astype(np.int64) * (1 << 32) + msgs["dst_rank"]
        return is_net & np.isin(pair, tcp[:, 0] * (1 << 32) + tcp[:, 1])


def load_schedule(path: Path, world_size: int | None = None) -> Measured:
    """A measured schedule: a directory or file written by ``wiretrace schedule``, or any log/trace
    that :mod:`wiretrace.ingest` reads (with the cluster's ``world_size`` for traces that do not
    name their ranks).

    Calls whose size or communicator the file does not give (``bytes_per_rank`` or
    ``group_size`` -1) cannot be lowered: they are dropped and named in ``notes``.
    """
    from .io.parquet import read_table

    path = Path(path)
    got = None
    if path.is_dir():
        f = path / "collectives.parquet"
        if not f.is_file():
            raise WiretraceError(f"--schedule: {path} holds no collectives.parquet")
        table = read_table(f, "collectives")
    elif path.suffix == ".parquet":
        table = read_table(path, "collectives")
    else:
        from . import ingest

        got = ingest.read_schedule([path], world_size=world_size)
        table = got.table
    m = Measured(table=table)
    if got is not None:
        m.rings = got.complete_rings()
        m.tcp_pairs = frozenset(k for k, v in got.transports.items() if "Socket" in v)
        nets = {v for v in got.transports.values() if v.startswith("NET/")}
        said = set(got.report.get("network") or ())
        m.tcp_network = (bool(nets) and all("Socket" in v for v in nets)) or said == {"Socket"}
    sizes = table.column("bytes_per_rank").to_numpy()
    gsize = table.column("group_size").to_numpy()
    bad = (sizes < 0) | (gsize < 1)
    if bad.any():
        src = table.column("source").to_pylist()
        first = [src[i] for i in np.flatnonzero(bad)[:3]]
        m.notes.append(f"{int(bad.sum())} call(s) of unknown size or communicator skipped "
                       f"(e.g. {', '.join(map(str, first))})")
        m.table = table.filter(pa.array(~bad))
    if m.table.num_rows == 0:
        if (gsize < 1).any():
            raise WiretraceError(
                f"--schedule: the calls in {path} do not name their communicator's ranks (Chakra traces "
                "do not); give the trace file itself to --schedule, and the plan's whole cluster is "
                "taken as the communicator")
        if not table.num_rows:
            raise WiretraceError(f"--schedule: {path} holds no collective call (rings, trees or transports "
                                 "only?): nothing to lower")
        raise WiretraceError(f"--schedule: {path} has no call wiretrace can lower (sizes unknown)")
    return m


def build_collectives(plan: Plan, schedule: Path | None = None) -> Measured:
    """The collectives table from the plan's workload, or from a measured schedule."""
    if schedule is not None:
        return load_schedule(schedule, world_size=plan.cluster.world_size)
    from . import workload

    return Measured(table=workload.build_collectives(plan))


def select_collectives(coll: pa.Table, sel: Selection) -> pa.Table:
    if sel.parallelism is not None:
        mask = pc.is_in(coll.column("parallelism").cast(pa.string()), pa.array(sorted(sel.parallelism)))
        coll = coll.filter(mask)
    if sel.ranks is not None:
        flat = pc.list_flatten(coll.column("ranks")).to_numpy()
        lens = pc.list_value_length(coll.column("ranks")).to_numpy()
        hit = np.isin(flat, np.fromiter(sel.ranks, dtype=np.int64))
        owner = np.repeat(np.arange(coll.num_rows), lens)
        keep = np.zeros(coll.num_rows, dtype=bool)
        keep[owner[hit]] = True
        coll = coll.filter(pa.array(keep))
    return coll


def _spans_nodes(coll: pa.Table, topo: topology.Topology) -> np.ndarray:
    """True for each call whose communicator has ranks on more than one node."""
    lens = pc.list_value_length(coll.column("ranks")).to_numpy()
    flat = pc.list_flatten(coll.column("ranks")).to_numpy().astype(np.int64)
    if len(flat) and flat.max() >= topo.world_size:
        raise WiretraceError(f"schedule names rank {int(flat.max())} but the cluster has {topo.world_size} GPUs")
    nodes = topo.rank_node[flat]
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    if len(flat) == 0:
        return np.zeros(coll.num_rows, dtype=bool)
    mn = np.minimum.reduceat(nodes, starts) if len(starts) else np.zeros(0)
    mx = np.maximum.reduceat(nodes, starts) if len(starts) else np.zeros(0)
    return np.where(lens > 0, mn != mx, False)


def rough_messages(coll: pa.Table, step_bytes: int) -> np.ndarray:
    """A rough count of the messages each call lowers to (a ring moves 2(n-1) slices of at most
    ``step_bytes`` per rank); the lowering gives up to a few times more (channels, CTS)."""
    n = coll.column("group_size").to_numpy().astype(np.int64)
    b = np.maximum(coll.column("bytes_per_rank").to_numpy(), 1)
    return n * 2 * np.maximum(1, n - 1) * np.maximum(1, b // (step_bytes * np.maximum(1, n)))


BYTES_PER_MESSAGE = 800
"""Peak bytes of memory per message of a run: lowering and timing a shard (measured 566-581 B
on the sample plans at several step sizes), then the messages kept for packetize and its
per-message state (740-750 B over whole runs of 8 to 16 M messages)."""

ROUGH_FACTOR = 2
"""Messages the lowering makes per :func:`rough_messages` (measured 1.3 on llama3-8b-4x8's
network calls, 2.0 on the demo's: clear-to-send credits and channels)."""


def memory_available() -> int:
    """Bytes of memory this machine can give without swapping (``MemAvailable`` of
    /proc/meminfo; the physical memory where that is not readable)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_shard_fits(rough: int, what: str, step_bytes: int) -> None:
    """Raise WiretraceError when a shard of ``rough`` (:func:`rough_messages`) messages would take
    more than half the memory available (:data:`BYTES_PER_MESSAGE`): a shard is lowered and timed
    at once, and the network messages are kept for packetize."""
    need = rough * ROUGH_FACTOR * BYTES_PER_MESSAGE
    avail = memory_available()
    if need > avail // 2:
        raise WiretraceError(
            f"{what} would lower to about {rough * ROUGH_FACTOR:,} messages with collectives.step_bytes "
            f"{step_bytes:,} B, about {human_bytes(need)} to hold at once, more than half of the "
            f"{human_bytes(avail)} this machine has available; raise step_bytes (NCCL's steps are 512 KiB "
            f"by default) or keep fewer calls with --parallelism")


def shards(coll: pa.Table, topo: topology.Topology, step_bytes: int = 512 * 1024) -> Iterator[pa.Table]:
    """Split calls into shards: every network-spanning call together, then NVLink-only
    communicators grouped into shards of about NVLINK_SHARD_MESSAGES messages (whole
    communicators: the calls of one run one after another).

    Raises
    ------
    WiretraceError : the network-spanning calls, or one NVLink communicator's, would lower to
        more messages than fit in memory (:func:`check_shard_fits`; a small
        ``collectives.step_bytes``). Checked before anything is lowered."""
    if coll.num_rows == 0:
        return
    net = _spans_nodes(coll, topo)
    local = coll.filter(pa.array(~net))
    if local.num_rows:
        groups = local.column("group").to_numpy()
        est = rough_messages(local, step_bytes)
        ids, of_row = np.unique(groups, return_inverse=True)
        per_group = np.bincount(of_row.reshape(-1), weights=est)
        worst = int(np.argmax(per_group))
        check_shard_fits(int(per_group[worst]), f"the NVLink calls of communicator {int(ids[worst])}",
                         step_bytes)
    if net.any():
        sub = coll.filter(pa.array(net))
        check_shard_fits(int(rough_messages(sub, step_bytes).sum()), "the network calls", step_bytes)
        yield sub
    if local.num_rows == 0:
        return
    order = np.argsort(groups, kind="stable")
    g_sorted = groups[order]
    bounds = np.flatnonzero(np.diff(g_sorted)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(order)]])
    acc: list[np.ndarray] = []
    acc_est = 0
    for s, e in zip(starts, ends):
        rows = order[s:e]
        acc.append(rows)
        acc_est += int(est[rows].sum())
        if acc_est >= NVLINK_SHARD_MESSAGES:
            yield local.take(pa.array(np.sort(np.concatenate(acc))))
            acc, acc_est = [], 0
    if acc:
        yield local.take(pa.array(np.sort(np.concatenate(acc))))


def lower_and_time(coll: pa.Table, topo: topology.Topology, plan: Plan, sel: Selection,
                   rings: dict | None = None) -> Iterator[dict]:
    """Yield timed messages (columns dict) shard by shard, with QPs assigned to network rows."""
    from . import collectives, transport

    next_id = 0
    for shard in shards(coll, topo, plan.collectives.step_bytes):
        msgs = collectives.lower(shard, topo, plan, rings=rings) if rings else collectives.lower(shard, topo, plan)
        if len(msgs["msg_id"]) == 0:
            continue
        timing.schedule(msgs, shard, topo, plan)
        if sel.ranks is not None:
            r = np.fromiter(sel.ranks, dtype=np.int64)
            keep = np.isin(msgs["src_rank"], r) | np.isin(msgs["dst_rank"], r)
            msgs = {k: np.asarray(v)[keep] for k, v in msgs.items()}
        msgs["msg_id"] = np.arange(next_id, next_id + len(msgs["msg_id"]), dtype=np.int64)
        next_id += len(msgs["msg_id"])
        msgs = transport.assign_qps(msgs, topo, plan)
        yield msgs


def estimate_packets(net: dict, plan: Plan, snaplen: int) -> dict:
    """Packets and capture bytes the network messages will produce (before writing them).

    Data packets: ceil(wire_bytes / path MTU) per message (at least 1); one ACK per message;
    capture bytes: 16-byte pcap record header plus min(snaplen, frame) per packet.
    """
    wire = np.asarray(net.get("wire_bytes", np.zeros(0)), dtype=np.int64)
    mtu = plan.transport.path_mtu
    data = int(np.maximum(1, -(-wire // mtu)).sum()) if len(wire) else 0
    acks = len(wire)
    packets = data + acks
    frame = mtu + 100                                   # payload plus the longest headers
    per = 16 + (min(snaplen, frame) if snaplen else frame)
    return {"packets": packets, "data_packets": data, "ack_packets": acks,
            "capture_bytes": packets * per}


def _concat(chunks: list[dict]) -> dict:
    if not chunks:
        return {}
    return {k: np.concatenate([np.asarray(c[k]) for c in chunks]) for k in chunks[0]}


EARLY_STOP_MESSAGES = 1_000_000
"""Network messages beyond which a run over ``--max-packets`` stops while lowering, before
the packet estimate (which names the packets and bytes) is reached."""


COMMITTED: list[Path] = []
"""Outputs this process has renamed into place (complete): a signal after that does not remove
them, and the command line says so."""


TABLE_FILES = frozenset({"packets.parquet", "messages.parquet", "collectives.parquet", "plan.json"})
"""Files wiretrace writes into a tables directory."""
_CAPTURE_FILE = re.compile(r"node\d+-mlx5_\d+\.(pcap|pcapng|erf)\d*")


def table_file(p: Path) -> bool:
    """Whether ``p`` is a file wiretrace writes into a tables directory (:data:`TABLE_FILES`)."""
    return p.name in TABLE_FILES and p.is_file() and not p.is_symlink()


def capture_file(p: Path) -> bool:
    """Whether ``p`` is a capture file as ``--split nic`` writes them, named after its NIC
    (``node0-mlx5_1.pcap``, rotated ``node0-mlx5_1.pcap1`` ...)."""
    return bool(_CAPTURE_FILE.fullmatch(p.name)) and p.is_file() and not p.is_symlink()


def rotated_names(output: Path) -> list[Path]:
    """Existing files at ``output``'s rotation names (``iter.pcap1``, ``iter.pcap2``, ...), in
    rotation order."""
    if not output.parent.is_dir():
        return []
    found = [q for q in output.parent.glob(glob.escape(output.name) + "[0-9]*")
             if q.name[len(output.name):].isdigit()]
    return sorted(found, key=lambda q: int(q.name[len(output.name):]))


def special_file(p: Path) -> str | None:
    """What ``p`` is when it exists but is neither a regular file nor a directory (following
    symbolic links): ``"character device"``, ``"block device"``, ``"named pipe"`` or ``"socket"``;
    None otherwise."""
    try:
        mode = p.stat().st_mode
    except OSError:
        return None
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return None


def refuse_special(p: Path) -> None:
    """Raise WiretraceError when the output ``p`` is a device, named pipe or socket: outputs are
    written under a temporary name and renamed, which would replace it (``--force`` or not)."""
    kind = special_file(Path(p))
    if kind:
        raise WiretraceError(f"{p} is a {kind}, not a regular file; wiretrace writes its outputs as files "
                             f"(written whole, then renamed into place), and does not replace a {kind}")


class _Staging:
    """Temporary output names beside the final ones; renamed on commit, removed on failure
    (with the directories made for them)."""

    def __init__(self, force: bool):
        self.force = force
        self.pairs: list[tuple[Path, Path]] = []
        self.committed: list[tuple[Path, Path]] = []
        self.stale: list[Path] = []
        self.made: list[Path] = []          # directories created for the outputs, deepest last

    def claim(self, final: Path, is_dir: bool = False, owns: Callable[[Path], bool] | None = None) -> Path:
        """A temporary name for the output ``final`` (a directory when ``is_dir``). An existing
        ``final`` is replaced only with ``--force``, and a directory only when every entry in it
        is one wiretrace writes there (``owns``; without it, only an empty one): ``--force``
        never deletes files wiretrace did not write.

        Raises
        ------
        WiretraceError : ``final`` exists without ``--force``; it is a directory where a file is
            written, or holds other files; it cannot be created.
        """
        final = Path(final)
        refuse_special(final)
        if final.is_dir() and not final.is_symlink() and not is_dir:
            raise WiretraceError(f"{final} is a directory; expected a file name for the capture "
                                 f"(--split nic writes one file per NIC into a directory)")
        if is_dir and (final.is_file() or final.is_symlink()):
            raise WiretraceError(f"{final} is a file; expected a directory (--force replaces a "
                                 f"directory of wiretrace's own outputs, not a file)")
        bad_parent = next((q for q in final.parents if q.exists() and not q.is_dir()), None)
        if bad_parent is not None:
            raise WiretraceError(f"cannot write {final}: {bad_parent} is not a directory")
        if final.exists() and not self.force:
            raise WiretraceError(f"{final} exists; pass --force to overwrite it")
        if final.is_dir() and not final.is_symlink():
            foreign = sorted(e.name for e in final.iterdir() if owns is None or not owns(e))
            if foreign:
                more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
                raise WiretraceError(f"{final} holds files wiretrace does not write there "
                                     f"({', '.join(foreign[:3])}{more}); --force replaces only wiretrace's "
                                     f"own outputs: move them or choose another directory")
        try:
            missing = []
            up = final.parent
            while not up.exists():
                missing.append(up)
                up = up.parent
            final.parent.mkdir(parents=True, exist_ok=True)
            self.made.extend(reversed(missing))
            if is_dir:
                tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
            else:
                fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
                os.close(fd)
                tmp = Path(name)
        except OSError as e:
            raise WiretraceError(f"cannot write {final}: {e.strerror or e}") from None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, (0o777 if is_dir else 0o666) & ~umask)
        self.pairs.append((tmp, final))
        return tmp

    def adopt(self, pairs: list[tuple[Path, Path]]) -> None:
        """Add files written under temporary names, ``(temporary, final)`` (all removed on abort
        from now on); refuses to replace a file without force, and a directory at all."""
        self.pairs.extend(pairs)
        for _, final in pairs:
            refuse_special(final)
            if final.is_dir() and not final.is_symlink():
                raise WiretraceError(f"{final} is a directory; a rotated capture file goes there")
            if final.exists() and not self.force:
                raise WiretraceError(f"{final} exists; pass --force to overwrite it")

    def remove_on_commit(self, path: Path) -> None:
        """Delete ``path`` (a file an earlier run left, which this run replaces) when committing."""
        self.stale.append(Path(path))

    def commit(self) -> None:
        """Rename every temporary output into place (and remove the stale files), with SIGTERM
        and SIGINT held back meanwhile so that a signal cannot leave half a set renamed; the
        final names are added to :data:`COMMITTED`."""
        main = threading.current_thread() is threading.main_thread()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT}) if main else None
        try:
            self.committed = list(self.pairs)
            for tmp, final in self.pairs:
                if final.is_dir() and not final.is_symlink():
                    shutil.rmtree(final)
                elif final.exists():
                    final.unlink()
                os.replace(tmp, final)
            for path in self.stale:
                path.unlink(missing_ok=True)
            COMMITTED.extend(final for _, final in self.committed)
            self.pairs, self.stale, self.made = [], [], []
        finally:
            if held is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def abort(self) -> None:
        for tmp, _ in self.pairs:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        self.pairs = []
        for d in reversed(self.made):           # deepest first; only if nothing else is in it
            with contextlib.suppress(OSError):
                d.rmdir()
        self.made = []


def largest_frame(plan: Plan) -> int:
    """Bytes of the longest frame the transport stage can write for ``plan``: the headers through
    the BTH (and a GRH for native IB), the longest extension headers of an RC opcode or a CNP,
    one path MTU of payload when the opcode carries payload, and the ICRC (and VCRC)."""
    from .transport import headers as H, layout

    ops = np.r_[np.arange(0x20), CNP_OPCODE]
    body = H.EXT_LEN[ops].astype(np.int64) + np.where(H.HAS_PAYLOAD[ops], plan.transport.path_mtu, 0)
    t = plan.transport
    grh = H.GRH.length if t.kind == "ib" and (t.grh or plan.cluster.subnets > 1) else 0
    return layout.base_header_len(plan) + grh + int(body.max()) + layout.trailer_len(plan)


def min_file_size(plan: Plan, topo: topology.Topology, output: Path, *, snaplen: int,
                  fmt: str | None = None, split: str | None = None) -> dict:
    """The smallest ``--max-file-size`` that keeps every rotated file within the limit: the
    capture's file header plus one record (record header, the largest frame cut to the snap
    length, record trailer and padding). Below it a file could not hold a single frame.

    Returns a dict with ``bytes`` (the minimum), ``format``, ``file_header``, ``record_header``
    (header and trailer bytes of one record) and ``frame`` (captured bytes of the largest frame).
    """
    from .io import write as wio

    name = wio.format_for(output, fmt)
    f = wio.make_format(name, topo, plan, snaplen)
    if split == "nic":
        header = max(len(f.file_header(np.array([nic]))) for nic in range(topo.num_nics))
    else:
        header = len(f.file_header())
    frame = largest_frame(plan)
    if snaplen:
        frame = min(frame, snaplen)
    record = f.prefix + f.suffix
    return {"bytes": header + record + frame, "format": name, "file_header": header,
            "record_header": record, "frame": frame}


def run_generate(plan: Plan, output: Path, *, parquet_dir: Path | None = None,
                 write_parquet: bool = True, schedule: Path | None = None,
                 snaplen: int = 128, fmt: str | None = None, split: str | None = None,
                 max_file_size: int | None = None, max_packets: int = 50_000_000,
                 selection: Selection = Selection(), force: bool = False,
                 progress: Callable[[str, int, int | None], None] | None = None) -> Summary:
    """Run the whole pipeline and write the capture (and Parquet tables).

    Parameters
    ----------
    plan : validated plan (cluster-only when ``schedule`` is given).
    output : capture path; its suffix chooses pcap / pcapng / erf unless ``fmt`` is given.
        ``-`` streams the capture to standard output (pcap unless ``fmt``; no split or
        rotation; tables only with ``parquet_dir``; a failed run leaves what was streamed).
    parquet_dir : directory for collectives/messages/packets.parquet; default ``<stem>.parquet``
        beside the capture.
    snaplen : bytes kept per frame (0 keeps whole frames); the original length is always recorded.
    max_packets : refuse (WiretraceError) when the estimate exceeds it.
    progress : callback ``(stage, done, total)``.

    Raises
    ------
    WiretraceError : invalid selection, an existing output without ``force``, too many packets,
        inconsistent schedule. Nothing is left behind on error.
    """
    from . import collectives as coll_stage
    from . import io as wio
    from .io.write import STDOUT, SUFFIX_FORMATS, format_for
    from . import transport

    def tick(stage: str, done: int, total: int | None = None) -> None:
        if progress:
            progress(stage, done, total)

    t0 = time.perf_counter()
    summary = Summary()
    topo = topology.build(plan)
    output = Path(output)
    to_stdout = str(output) == STDOUT
    if to_stdout:
        if split is not None or max_file_size is not None:
            raise WiretraceError(f"{'--split' if split is not None else '--max-file-size'}: standard output "
                                 "(-o -) is one stream; splitting and rotation need files")
        if parquet_dir is None:
            write_parquet = False               # tables only where --parquet DIR says
    if max_file_size is not None:
        least = min_file_size(plan, topo, output, snaplen=snaplen, fmt=fmt, split=split)
        if max_file_size < least["bytes"]:
            cut = f" at --snaplen {snaplen}" if snaplen and least["frame"] == snaplen else ""
            raise WiretraceError(
                f"--max-file-size {max_file_size:,}: expected at least {least['bytes']:,} bytes for this "
                f"{least['format']} capture, its file header ({least['file_header']:,} bytes) plus one "
                f"record of the largest frame ({least['record_header']} + {least['frame']:,} bytes{cut})")
    if parquet_dir is None:
        parquet_dir = output.with_name(output.stem + ".parquet")
    if write_parquet and not to_stdout:
        a, b = Path(os.path.abspath(output)), Path(os.path.abspath(parquet_dir))
        if a == b or a in b.parents or b in a.parents:
            raise WiretraceError(f"--parquet {parquet_dir} and -o {output}: the tables directory and the capture "
                                 f"must not be the same path or inside each other")
    if split is None and max_file_size is not None:
        taken = rotated_names(output)
        for q in taken:
            refuse_special(q)               # never replaced, --force or not: say so first
        if taken and not force:
            raise WiretraceError(f"{taken[0]} exists (a rotated file of {output.name}); pass --force "
                                 f"to overwrite it")
    staging = _Staging(force)
    try:
        cap_tmp = output if to_stdout else staging.claim(output, is_dir=(split == "nic"), owns=capture_file)
        pq_tmp = staging.claim(Path(parquet_dir), is_dir=True, owns=table_file) if write_parquet else None

        tick("schedule", 0)
        measured = build_collectives(plan, schedule)
        summary.notes.extend(measured.notes)
        from .transport import layout

        from .transport import headers as H

        through_bth = layout.base_header_len(plan)
        if plan.transport.kind == "ib" and (plan.transport.grh or plan.cluster.subnets > 1):
            through_bth += H.GRH.length                 # frames with a GRH: the longest headers
        if 0 < snaplen < through_bth:
            summary.notes.append(f"--snaplen {snaplen} cuts every frame before the end of its BTH (this plan's "
                                 f"headers through the BTH take {through_bth} bytes), so `wiretrace validate` "
                                 f"can check nothing; 128 keeps every header")
        elif 0 < snaplen < through_bth + H.RETH.length:
            summary.notes.append(f"--snaplen {snaplen} cuts the RETH of FIRST and ONLY packets (headers through it "
                                 f"take {through_bth + H.RETH.length} bytes), so `wiretrace validate` checks no DMA "
                                 f"lengths{' or MSNs' if snaplen < through_bth + H.AETH.length else ''}; 128 keeps "
                                 f"every header")
        suffix_fmt = SUFFIX_FORMATS.get(Path(output).suffix.lower())
        if fmt and split is None and suffix_fmt and suffix_fmt != fmt.lower():
            summary.notes.append(f"{Path(output).name} holds {fmt.lower()} records (--format), not what its "
                                 f"{Path(output).suffix} suffix suggests")
        elif not fmt and split is None and suffix_fmt is None and not to_stdout:
            summary.notes.append(f"{Path(output).name}: no .pcap, .pcapng or .erf suffix; writing pcap "
                                 f"(choose with --format)")
        if selection.ranks is not None and max(selection.ranks) >= topo.world_size:
            raise WiretraceError(f"--ranks: rank {max(selection.ranks)} is outside the plan's "
                                 f"{topo.world_size} GPUs (0-{topo.world_size - 1})")
        coll = select_collectives(measured.table, selection)
        coll = coll_stage.resolve_algorithms(coll, topo, plan)
        summary.collectives = coll.num_rows
        tick("schedule", coll.num_rows, coll.num_rows)

        msg_writer = TableWriter(pq_tmp / "messages.parquet", "messages") if pq_tmp else None
        net_chunks: list[dict] = []
        done = 0
        window = selection.window
        span = [np.iinfo(np.int64).max, -1]       # network traffic: first start, last end (ns), from
                                                  # the messages and the packets made (ACKs after them)
        kept_ops: set[int] = set()
        for msgs in lower_and_time(coll, topo, plan, selection, rings=measured.rings or None):
            if window is not None:
                on_net = msgs["link"] == "network"
                if on_net.any():                    # the traffic's span, for an empty window
                    span[0] = min(span[0], int(msgs["t_start_ns"][on_net].min()))
                    span[1] = max(span[1], int(msgs["t_end_ns"][on_net].max()))
                # the tables keep what overlaps the window; the transport still sees every
                # earlier network message, so that PSNs match the whole iteration's capture
                inside = (msgs["t_start_ns"] < window[1]) & (msgs["t_end_ns"] > window[0])
                early = msgs["link"] == "network"
                early &= ~measured.over_tcp(msgs, early)
                early &= msgs["t_start_ns"] < window[1] + WINDOW_LOOKAHEAD_NS
                for_packets = {k: v[early & ~inside] for k, v in msgs.items()}
                if len(for_packets["msg_id"]):
                    net_chunks.append(for_packets)
                msgs = {k: v[inside] for k, v in msgs.items()}
            kept_ops.update(np.unique(msgs["op_id"]).tolist())
            is_net = msgs["link"] == "network"
            summary.messages += len(is_net)
            summary.network_messages += int(is_net.sum())
            # each network message is a packet at least: stop a run that cannot pass --max-packets
            # before its messages fill the memory (small ones reach the estimate below)
            if summary.network_messages > max(max_packets, EARLY_STOP_MESSAGES):
                raise WiretraceError(
                    f"this run has at least {summary.network_messages:,} network messages, so more "
                    f"packets than --max-packets {max_packets:,}; narrow it with --ranks, --parallelism "
                    f"or --window START:END (ns), or raise --max-packets")
            summary.nvlink_messages += int((~is_net).sum())
            if len(is_net):
                summary.last_message_ns = max(summary.last_message_ns, int(msgs["t_end_ns"].max()))
            if msg_writer:
                msg_writer.write(msgs)
            over_tcp = measured.over_tcp(msgs, is_net)
            summary.tcp_messages += int(over_tcp.sum())
            is_net = is_net & ~over_tcp
            if is_net.any():
                net_chunks.append({k: v[is_net] for k, v in msgs.items()})
            done += len(is_net)
            tick("messages", done, None)
        if msg_writer:
            msg_writer.close()
        net = _concat(net_chunks)
        if not net:
            net = {k: np.zeros(0, dtype=tables.numpy_dtype("messages", k)) for k in tables.column_names("messages")}
        order = np.argsort(net["t_start_ns"], kind="stable")
        net = {k: v[order] for k, v in net.items()}
        if window is not None:
            overlap = (net["t_start_ns"] < window[1]) & (net["t_end_ns"] > window[0])
            est = estimate_packets({k: v[overlap] for k, v in net.items()}, plan, snaplen)
        else:
            est = estimate_packets(net, plan, snaplen)
        summary.estimate = est
        if est["packets"] > max_packets:
            raise WiretraceError(
                f"this run would write about {est['packets']:,} packets (~{human_bytes(est['capture_bytes'])}), "
                f"more than --max-packets {max_packets:,}; narrow it with --ranks, --parallelism dp,tp,pp,... "
                f"or --window START:END (ns), or raise --max-packets")
        free = float("inf") if to_stdout else shutil.disk_usage(cap_tmp.parent).free
        if est["capture_bytes"] > free:
            raise WiretraceError(
                f"this run would write about {human_bytes(est['capture_bytes'])} of capture "
                f"({est['packets']:,} packets) but {cap_tmp.parent} has {human_bytes(free)} free; "
                + ("cut frames with --snaplen (128 keeps every header), or narrow" if not 0 < snaplen <= 128
                   else "narrow") + " it with --ranks, --parallelism or --window")

        pkt_writer = TableWriter(pq_tmp / "packets.parquet", "packets") if pq_tmp else None

        marking = bool(plan.transport.ecn_marking)
        if marking:
            summary.ce_marked = summary.cnps = 0

        def packet_chunks() -> Iterator[dict]:
            written = 0
            for chunk in transport.packetize(net, topo, plan):
                if window is not None:
                    ts = chunk["ts_ns"]
                    if len(ts):                     # chunks are in time order
                        span[0] = min(span[0], int(ts[0]))
                        span[1] = max(span[1], int(ts[-1]))
                    keep = (ts >= window[0]) & (ts < window[1])
                    if not keep.all():
                        chunk = {k: np.asarray(v)[keep] for k, v in chunk.items()}
                n = len(chunk["ts_ns"])
                if n == 0:
                    continue
                summary.packets += n
                summary.wire_bytes += int(np.asarray(chunk["frame_len"], dtype=np.int64).sum())
                carries_data = np.asarray(chunk["opcode"]) != CNP_OPCODE
                summary.network_bytes += int(np.asarray(chunk["payload_len"], dtype=np.int64)[carries_data].sum())
                if marking:
                    summary.cnps += int(n - carries_data.sum())
                    summary.ce_marked += int((carries_data & (np.asarray(chunk["ecn"]) == 3)).sum())
                if pkt_writer:
                    pkt_writer.write(chunk)
                written += n
                tick("packets", written, est["packets"])
                yield chunk

        stats = wio.write_capture(cap_tmp, packet_chunks(), topo, plan, snaplen=snaplen,
                                  fmt=format_for(output, fmt), split=split,
                                  max_file_size=max_file_size)
        if split is None and not to_stdout:
            # rotated files (tcpdump -C naming): <tmp>1, <tmp>2 ... become <output>1, <output>2 ...
            staging.adopt([(f, output.with_name(output.name + f.name[len(cap_tmp.name):]))
                           for f in map(Path, stats.get("files", []))
                           if f != cap_tmp and f.name.startswith(cap_tmp.name)])
            # with --force, rotated files of an earlier run past the last one written go too, so
            # the set on disk is this run's
            # (only those that continue the numbering: a file past a gap may not be an earlier run's)
            k = max(1, len(stats.get("files", [])))
            while force and output.with_name(f"{output.name}{k}").is_file():
                staging.remove_on_commit(output.with_name(f"{output.name}{k}"))
                k += 1
        if pkt_writer:
            pkt_writer.close()
        if window is not None and summary.packets == 0:
            where = (f"this run's network traffic spans {span[0]:,} to {span[1]:,} ns" if span[1] >= 0
                     else "this run has no network traffic")
            summary.notes.append(f"--window {window[0]:,}:{window[1]:,} ns holds no packet; {where}")
        if window is not None:
            # a window keeps the calls whose messages overlap it, whether or not tables are written
            coll = coll.filter(pc.is_in(coll.column("op_id"), pa.array(sorted(kept_ops), type=pa.int64())))
            summary.collectives = coll.num_rows
        if pq_tmp:
            from .io.parquet import write_table

            write_table(pq_tmp / "collectives.parquet", "collectives", coll)
            if plan.raw:
                (pq_tmp / "plan.json").write_text(json.dumps(plan.raw, indent=2) + "\n")
        try:
            from . import workload

            if schedule is None:
                summary.iteration_ns = int(workload.iteration_estimate(plan)["total_ns"])
        except (ImportError, AttributeError, KeyError):
            summary.iteration_ns = 0
        if summary.tcp_messages:
            why = (" (the log shows NET/Socket as the run's network, and NCCL sends every connection over "
                   "the one network module)" if measured.tcp_network else "")
            summary.notes.append(f"{summary.tcp_messages:,} network messages went over NET/Socket (TCP) in the "
                                 f"measured run{why}: kept in messages.parquet, not rendered as RoCEv2 packets")
        staging.commit()
        summary.outputs = [str(output)] if to_stdout else []
        summary.outputs += [str(final) for _, final in staging.committed if final != Path(parquet_dir)]
        summary.outputs += [str(parquet_dir)] if write_parquet else []
    except BaseException:
        staging.abort()
        raise
    summary.elapsed_s = time.perf_counter() - t0  # type: ignore[attr-defined]
    return summary


def lowered_bus_factor(op: str, n: int, size: int, elem_bytes: int = 4) -> float:
    """Bytes the busiest rank sends, over the nccl-tests size ``S``, when wiretrace lowers one
    ``op`` of ``size`` bytes over ``n`` ranks with the ring (direct for all_to_all) algorithm.

    nccl-tests (doc/PERFORMANCE.md) defines busbw = algbw x this factor: 2(n-1)/n for
    all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast, reduce
    and send/recv; computing it from the messages checks the lowering against that definition.
    """
    from . import collectives, plan as plan_mod, tables

    cluster = plan_mod.from_dict({"cluster": {"nodes": n, "gpus_per_node": 1},
                                  "collectives": {"cts": False}}, require_model=False)
    topo = topology.build(cluster)
    per_rank = {"all_gather": size // n, "reduce_scatter": size // n}.get(op, size)
    alg = "direct" if op in ("all_to_all", "all_to_allv", "send_recv") else "ring"
    row = tables.to_arrow("collectives", dict(
        op_id=[0], iteration=[0], op=[op], parallelism=["other"], group=[0], ranks=[list(range(n))],
        group_size=[n], bytes_global=[size], bytes_per_rank=[per_rank], dtype=["fp32"], phase=["unknown"],
        layer=[-1], microbatch=[-1], stage=[-1], tensor=[""], src=[0 if op == "send_recv" else -1],
        dst=[1 if op == "send_recv" else -1], algorithm=[alg], t_ready_ns=[0], source=["busbw"]))
    m = collectives.lower(row, topo, cluster)
    sent = np.bincount(m["src_rank"], weights=m["bytes"], minlength=n)
    return float(sent.max()) / size if size else 0.0


def human_bytes(n: float) -> str:
    """``1018404864`` -> ``"1.02 GB"`` (SI units, two decimals; whole bytes below 1 kB)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000.0
    return f"{n:,.2f} TB"

