#!/usr/bin/env python3
"""Benchmark of the packet layer: messages -> packets -> frames -> pcap, end to end.

Runs, in one process:

1. headers-only capture (snap length just past the transport headers: Ethernet + IPv4 + UDP +
   BTH + RETH = 70 bytes) of ``--packets`` packets: wiretrace end to end (packetize, render,
   write) on one core (the process pinned to one CPU, as ``taskset -c``; its rate is the
   target's "packets per second on one core") and on all the CPUs it may use, packetize alone
   on one core (render and write are the rest), then one ``write()`` of the same bytes to a
   file in the same directory; both into the page cache (best of ``--runs``) and both until
   the bytes are on the disk (fsync, once);
2. whole frames (``--whole-packets`` packets, path MTU 4096): the same page-cache timings;
3. dpkt's pcap writer writing the same headers-only frames from prebuilt bytes (a sample);
4. scapy building the same kind of frames (a sample).

Each target of the packet layer is printed with "met" or "NOT met". A write into a warm page
cache is a memory copy (several GB/s), into a cold one or past the kernel's dirty limit it runs
at the disk's rate: the fsync timings say which one the disk gives.

The workload is NCCL-like: 16 NICs (4 nodes x 4), each sending 512 KiB messages (NCCL's Simple
protocol step) to the NIC of the next node back to back at 400 Gb/s, RDMA WRITE ... WRITE WITH
IMMEDIATE plus one ACK per message: 129 packets a message, so the packet count is the largest
multiple of 129 up to the one asked for.

Usage::

    python tools/bench_packets.py                       # default sizes, about a minute
    python tools/bench_packets.py --packets 100000000 --rss-only   # 100M packets, peak RSS

Peak RSS is the process's maximum resident set (``getrusage``), in MiB.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from wiretrace import plan as P
from wiretrace import tables, topology
from wiretrace.io import write_capture
from wiretrace.transport import packetize

HEADERS_SNAPLEN = 14 + 20 + 8 + 12 + 16


def make_setup(nodes: int = 4, nics: int = 4):
    doc = {"name": "bench", "cluster": {"nodes": nodes, "gpus_per_node": nics, "nics_per_node": nics,
                                        "nic_rate": "400Gbps", "latency": "2us"},
           "transport": {"path_mtu": 4096}}
    plan = P.from_dict(doc, require_model=False)
    return plan, topology.build(plan)


def make_messages(plan, topo, packets: int, msg_bytes: int = 512 * 1024) -> dict:
    """Network messages that produce about ``packets`` packets (data + ACKs)."""
    per_msg = -(-msg_bytes // plan.transport.path_mtu) + 1
    n = max(1, packets // per_msg)
    nics = topo.num_nics
    src = (np.arange(n) % nics).astype(np.int32)
    dst = ((src + topo.nics_per_node) % nics).astype(np.int32)
    wire = msg_bytes + (-(-msg_bytes // 4096)) * 82 + 20
    dur = int(np.ceil(wire * 8 / topo.nic_rate_bps * 1e9))
    start = (np.arange(n) // nics).astype(np.int64) * dur
    m = {c: np.zeros(n, dtype=tables.numpy_dtype("messages", c)) for c in tables.column_names("messages")}
    m["msg_id"] = np.arange(n, dtype=np.int64)
    m["src_nic"], m["dst_nic"] = src, dst
    m["link"] = np.full(n, "network", dtype=object)
    m["kind"] = np.full(n, "data", dtype=object)
    m["bytes"][:] = msg_bytes
    m["wire_bytes"][:] = msg_bytes
    m["verb"] = np.full(n, "", dtype=object)
    m["qpn"][:] = -1
    m["udp_sport"][:] = -1
    m["t_start_ns"] = start
    m["t_end_ns"] = start + dur + topo.latency_ns
    return m


def one_write(path: Path, data: np.ndarray, sync: bool = False) -> float:
    """Seconds to write ``data`` to a new file with one write() call (looping on short writes);
    ``sync``: and until the bytes are on the disk (fsync)."""
    if path.exists():
        path.unlink()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    mv = memoryview(data)
    off = 0
    while off < len(mv):
        off += os.write(fd, mv[off:])
    if sync:
        os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_wiretrace(path: Path, plan, topo, messages, snaplen: int, sync: bool = False) -> tuple[float, dict]:
    """Wall seconds of one end-to-end run (``sync``: until the capture is on the disk, fsync);
    ``stats["cpu_s"]`` is the CPU time it used (all threads, user + system), so
    ``packets / cpu_s`` is the rate one core would sustain."""
    if path.exists():
        path.unlink()
    c0, t0 = _cpu(), time.perf_counter()
    stats = write_capture(path, packetize(messages, topo, plan), topo, plan, snaplen=snaplen)
    if sync:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    stats["cpu_s"] = _cpu() - c0
    return time.perf_counter() - t0, stats


def dpkt_sample(path: Path, count: int) -> float:
    """Packets per second of dpkt's pcap Writer writing prebuilt frames (nanosecond pcap)."""
    import dpkt

    frames, stamps = [], []
    with open(path, "rb") as fh:
        for ts, buf in dpkt.pcap.Reader(fh):
            frames.append(bytes(buf))
            stamps.append(float(ts))
            if len(frames) >= count:
                break
    out = path.with_name("dpkt.pcap")
    t0 = time.perf_counter()
    with open(out, "wb") as fh:
        w = dpkt.pcap.Writer(fh, snaplen=HEADERS_SNAPLEN, nano=True)
        for ts, buf in zip(stamps, frames):
            w.writepkt(buf, ts)
    dt = time.perf_counter() - t0
    out.unlink()
    return len(frames) / dt


def scapy_sample(count: int) -> float:
    """Packets per second of scapy building RoCEv2 RDMA WRITE frames (headers + 4 KiB payload)."""
    from scapy.contrib.roce import BTH
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw

    payload = bytes(range(256)) * 16
    t0 = time.perf_counter()
    for i in range(count):
        pkt = (Ether(src="02:00:00:00:00:00", dst="02:00:00:00:01:00")
               / IP(src="10.0.0.1", dst="10.0.0.2", tos=0x6A, flags="DF", id=i & 0xFFFF)
               / UDP(sport=49672, dport=4791, chksum=0)
               / BTH(opcode=0x07, migreq=1, dqpn=0x101, psn=i)
               / Raw(payload))
        bytes(pkt)
    return count / (time.perf_counter() - t0)


def on_one_cpu(fn):
    """``fn()`` with this process pinned to one of its CPUs (threads started meanwhile inherit
    it), as ``taskset -c`` would; the CPU mask is restored afterwards."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        return fn()
    finally:
        os.sched_setaffinity(0, cpus)


def packetize_only(plan, topo, messages) -> tuple[float, dict]:
    """Seconds (and packets) of packetize alone, its chunks dropped as they come."""
    c0, t0 = _cpu(), time.perf_counter()
    n = sum(len(c["ts_ns"]) for c in packetize(messages, topo, plan))
    return time.perf_counter() - t0, {"packets": n, "cpu_s": _cpu() - c0}


def best_of(runs: int, fn):
    """``fn()`` ``runs`` times; the run with the least wall time (the page cache and the
    allocator make first runs slow: every timing here is a best of ``runs``)."""
    return min((fn() for _ in range(runs)), key=lambda r: r[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packets", type=int, default=10_000_000, help="headers-only packets (default 10M)")
    ap.add_argument("--whole-packets", type=int, default=200_000, help="whole-frame packets (default 200k)")
    ap.add_argument("--dir", default=None, help="directory for the captures (default: a temporary one)")
    ap.add_argument("--runs", type=int, default=3,
                    help="timings per measurement; the best is reported (default 3)")
    ap.add_argument("--rss-only", action="store_true",
                    help="only the headers-only run (no baselines): for the 100M-packet memory check")
    ap.add_argument("--dpkt-sample", type=int, default=200_000,
                    help="frames dpkt's writer writes (a rate is reported; default 200k)")
    ap.add_argument("--scapy-sample", type=int, default=2_000,
                    help="frames scapy builds (a rate is reported; default 2k)")
    args = ap.parse_args(argv)

    plan, topo = make_setup()
    tmpdir = tempfile.TemporaryDirectory(prefix="wiretrace-bench-", dir=args.dir)
    d = Path(tmpdir.name)
    rows = []

    msgs = make_messages(plan, topo, args.packets)
    cap = d / "headers.pcap"
    if not args.rss_only:
        print(f"benchmark of the packet layer in {d.parent}: {args.packets:,} headers-only packets (on one core, "
              f"then on all), {args.whole_packets:,} whole frames, each against one write() of the same bytes, "
              f"best of {args.runs}; then dpkt and scapy", flush=True)
        if args.packets < 10_000_000 or args.whole_packets < 200_000:
            print("(smaller than the defaults: fixed costs weigh more, and the targets are stated for the "
                  "defaults)", flush=True)
    if args.rss_only:
        t, st = run_wiretrace(cap, plan, topo, msgs, HEADERS_SNAPLEN)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        n = st["packets"]
        print(f"headers-only: {n:,} packets, {st['bytes'] / 1e6:,.0f} MB in {t:.2f} s = {n / t / 1e6:.2f} Mpps "
              f"({st['cpu_s']:.2f} CPU s: {n / st['cpu_s'] / 1e6:.2f} M packets per CPU-second); peak RSS "
              f"{rss:,.0f} MiB: < 1 GiB {'met' if rss < 1024 else 'NOT met'}")
        tmpdir.cleanup()
        return 0
    t1, st1 = best_of(args.runs, lambda: on_one_cpu(lambda: run_wiretrace(cap, plan, topo, msgs, HEADERS_SNAPLEN)))
    t_pk, _ = best_of(args.runs, lambda: on_one_cpu(lambda: packetize_only(plan, topo, msgs)))
    t, st = best_of(args.runs, lambda: run_wiretrace(cap, plan, topo, msgs, HEADERS_SNAPLEN))
    cpu = min(run_wiretrace(cap, plan, topo, msgs, HEADERS_SNAPLEN)[1]["cpu_s"] for _ in range(args.runs))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n = st["packets"]
    ncpu = len(os.sched_getaffinity(0))
    rows.append(("wiretrace headers-only (snaplen 70), one core", n, st1["bytes"], t1))
    rows.append((f"wiretrace headers-only (snaplen 70), {ncpu} cores", n, st["bytes"], t))
    len_h = st["bytes"]
    print(f"headers-only runs done ({n:,} packets, {t1:.2f} s on one core); whole frames and the peers follow",
          flush=True)
    t_sync, _ = run_wiretrace(cap, plan, topo, msgs, HEADERS_SNAPLEN, sync=True)
    del msgs
    data = np.fromfile(cap, dtype=np.uint8)
    t_w = min(one_write(d / "copy.bin", data) for _ in range(args.runs))
    rows.append(("one write() of the same bytes", n, len(data), t_w))
    t_wsync = one_write(d / "copy.bin", data, sync=True)
    rows.append(("wiretrace headers-only, until on disk (fsync)", n, len(data), t_sync))
    rows.append(("one write() of the same bytes, until on disk (fsync)", n, len(data), t_wsync))
    del data
    dpkt_pps = dpkt_sample(cap, args.dpkt_sample)
    cap.unlink()

    msgs = make_messages(plan, topo, args.whole_packets)
    cap = d / "whole.pcap"
    tw, stw = best_of(args.runs, lambda: run_wiretrace(cap, plan, topo, msgs, 0))
    rows.append(("wiretrace whole frames", stw["packets"], stw["bytes"], tw))
    tw_sync, _ = run_wiretrace(cap, plan, topo, msgs, 0, sync=True)
    data = np.fromfile(cap, dtype=np.uint8)
    tww = min(one_write(d / "copy.bin", data) for _ in range(args.runs))
    rows.append(("one write() of the same bytes", stw["packets"], len(data), tww))
    tww_sync = one_write(d / "copy.bin", data, sync=True)
    rows.append(("wiretrace whole frames, until on disk (fsync)", stw["packets"], len(data), tw_sync))
    rows.append(("one write() of the same bytes, until on disk (fsync)", stw["packets"], len(data), tww_sync))
    del data
    cap.unlink()
    scapy_pps = scapy_sample(args.scapy_sample)
    tmpdir.cleanup()

    print()
    print(f"directory: {d.parent} (page-cache timings the best of {args.runs}, fsync timings one run); "
          f"messages of 128 data packets + 1 ACK, so {n:,} packets for --packets {args.packets:,} and "
          f"{stw['packets']:,} for --whole-packets {args.whole_packets:,}")
    print("| run | packets | bytes | seconds | Mpps | GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, pk, by, sec in rows:
        print(f"| {name} | {pk:,} | {by:,} | {sec:.3f} | {pk / sec / 1e6:.2f} | {by / sec / 1e9:.2f} |")
    ours = n / t

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print()
    print("targets of the packet layer (README, Performance):")
    print(f"headers-only on one core: {t1:.3f} s = {n / t1 / 1e6:.2f} M packets per second (packetize "
          f"{t_pk:.3f} s, render and write {t1 - t_pk:.3f} s): >= 10 M on one core {verdict(n / t1 >= 10e6)}")
    print(f"headers-only on {ncpu} cores: {ours / 1e6:.2f} Mpps wall; CPU {cpu:.2f} s (user + system of all "
          f"threads) = {n / cpu / 1e6:.2f} M packets per CPU-second")
    print(f"headers-only / one write(), page cache: {t / t_w:.2f}x; until on disk: {t_sync / t_wsync:.2f}x "
          f"(disk {len_h / t_wsync / 1e9:.2f} GB/s): within 1.25x {verdict(t / t_w <= 1.25)} in the page cache, "
          f"{verdict(t_sync / t_wsync <= 1.25)} to disk")
    print(f"whole frames / one write(), page cache: {tw / tww:.2f}x (CPU {stw['cpu_s']:.2f} s); until on disk: "
          f"{tw_sync / tww_sync:.2f}x: within 1.25x {verdict(tw / tww <= 1.25)} in the page cache, "
          f"{verdict(tw_sync / tww_sync <= 1.25)} to disk")
    print(f"peak RSS after the headers-only runs: {rss:,.0f} MiB: < 1 GiB {verdict(rss < 1024)} "
          f"(the target is for 100 M packets: --packets 100000000 --rss-only)")
    print()
    print(f"peers, against wiretrace's headers-only rate of {ours / 1e6:.2f} Mpps:")
    print(f"dpkt pcap Writer from prebuilt bytes: {dpkt_pps / 1e6:.3f} Mpps -> wiretrace is {ours / dpkt_pps:.1f}x faster")
    print(f"scapy building frames: {scapy_pps / 1e3:.2f} kpps -> wiretrace is {ours / scapy_pps:,.0f}x faster")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB at the end "
          f"(the write() baselines hold a whole capture in memory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
