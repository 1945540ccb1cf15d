"""Benchmark of the main job: `wiretrace generate` on the demo plan, against its peers.

Measured in one run on this machine:

* wiretrace: end-to-end ``generate`` (plan -> capture + Parquet) in a subprocess: wall time,
  packets per second, peak RSS (``getrusage(RUSAGE_CHILDREN)``);
* dpkt: writing the same number of frames with ``dpkt.pcap.Writer(nano=True)`` from prebuilt bytes
  (the frames of wiretrace's own capture, read back), i.e. the cost of a pcap writer alone;
* scapy: building the same kind of frames (Ether/IP/UDP/BTH + 4 KiB payload, with ICRC; scapy has
  no RETH layer) packet by packet; timed on a
  sample and reported as a rate, since a full run would take minutes.

Usage: ``python tools/bench_generate.py [--plan PLAN] [--snaplen 128] [--scapy-sample 20000]``.
Prints a Markdown table (the README shows the latest one).
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_generate(plan: Path, out: Path, snaplen: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "wiretrace.cli", "generate", "--plan", str(plan), "-o", str(out),
                    "--snaplen", str(snaplen), "--quiet", "--force"], check=True)
    wall = time.perf_counter() - t0
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, rss_kib * 1024


def read_frames(path: Path):
    import dpkt

    with open(path, "rb") as f:
        r = dpkt.pcap.Reader(f)
        return [(ts, buf) for ts, buf in r]


def bench_dpkt(frames) -> float:
    import dpkt

    sink = io.BytesIO()
    t0 = time.perf_counter()
    w = dpkt.pcap.Writer(sink, snaplen=65535, nano=True)
    for ts, buf in frames:
        w.writepkt(buf, ts=ts)
    return time.perf_counter() - t0


def bench_scapy(n: int) -> float:
    from scapy.contrib.roce import BTH, opcode
    from scapy.packet import Raw
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    payload = bytes(4096)
    t0 = time.perf_counter()
    for i in range(n):
        p = (Ether(src="02:00:00:00:00:00", dst="02:00:00:00:01:00")
             / IP(src="10.0.0.1", dst="10.0.0.2", tos=0x6A, flags="DF", ttl=64)
             / UDP(sport=49153, dport=4791, chksum=0)
             / BTH(opcode=opcode("RC", "RDMA_WRITE_MIDDLE")[0], dqpn=0x100, psn=i & 0xFFFFFF)
             / Raw(payload))
        bytes(p)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", type=Path, default=ROOT / "samples" / "plans" / "gpt2-small-2x4.json")
    ap.add_argument("--snaplen", type=int, default=128)
    ap.add_argument("--scapy-sample", type=int, default=20000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "iter.pcap"
        wall, rss = run_generate(args.plan, out, args.snaplen)
        frames = read_frames(out)
        n = len(frames)
        t_dpkt = bench_dpkt(frames)
        t_scapy = bench_scapy(args.scapy_sample) * n / args.scapy_sample
        size = out.stat().st_size
    print(f"plan {args.plan.name}, snaplen {args.snaplen}: {n:,} packets, capture {size / 1e6:.1f} MB, "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs\n")
    print("| tool | what | time (s) | packets/s | vs wiretrace |")
    print("|---|---|---:|---:|---:|")
    print(f"| wiretrace | generate end to end (plan -> pcap + Parquet), peak RSS {rss / 2**20:.0f} MiB "
          f"| {wall:.2f} | {n / wall:,.0f} | 1.00 |")
    print(f"| dpkt | pcap writer alone, prebuilt frames | {t_dpkt:.2f} | {n / t_dpkt:,.0f} | {t_dpkt / wall:.2f} |")
    print(f"| scapy | build RoCEv2 frames (sample of {args.scapy_sample:,}, extrapolated) | {t_scapy:.2f} "
          f"| {n / t_scapy:,.0f} | {t_scapy / wall:.2f} |")


if __name__ == "__main__":
    main()
