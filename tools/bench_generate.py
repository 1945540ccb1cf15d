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


def run_generate(plan: Path, out: Path, snaplen: int, *extra: str) -> tuple[float, float, int]:
    """Wall time, CPU time (user + system) and peak RSS of one `wiretrace generate` subprocess."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "wiretrace.cli", "generate", "--plan", str(plan), "-o", str(out),
                    "--snaplen", str(snaplen), "--quiet", "--force", *extra], check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, after.ru_maxrss * 1024




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
    ap.add_argument("--large", type=Path, default=ROOT / "samples" / "plans" / "llama3-8b-4x8.json",
                    help="a second, larger run (DP traffic only) where start-up costs are amortized")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "iter.pcap"
        wall, cpu, rss = run_generate(args.plan, out, args.snaplen)
        frames = read_frames(out)
        n = len(frames)
        t_dpkt = bench_dpkt(frames)
        t_scapy = bench_scapy(args.scapy_sample) * n / args.scapy_sample
        size = out.stat().st_size
        out = Path(d) / "large.pcap"
        l_wall, l_cpu, l_rss = run_generate(args.large, out, args.snaplen, "--parallelism", "dp")
        l_n = int(subprocess.run([sys.executable, "-c", "import pyarrow.parquet as pq, sys; "
                                  "print(pq.ParquetFile(sys.argv[1]).metadata.num_rows)",
                                  str(Path(d) / "large.parquet" / "packets.parquet")],
                                 capture_output=True, text=True, check=True).stdout)
    print(f"plan {args.plan.name}, snaplen {args.snaplen}: {n:,} packets, capture {size / 1e6:.1f} MB, "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs\n")
    print("| tool | what | time (s) | packets/s | vs wiretrace |")
    print("|---|---|---:|---:|---:|")
    print(f"| wiretrace | generate end to end (plan -> pcap + Parquet), peak RSS {rss / 2**20:.0f} MiB, "
          f"CPU {cpu:.2f} s | {wall:.2f} | {n / wall:,.0f} | 1.00 |")
    print(f"| dpkt | pcap writer alone, prebuilt frames | {t_dpkt:.2f} | {n / t_dpkt:,.0f} | {t_dpkt / wall:.2f} |")
    print(f"| scapy | build RoCEv2 frames (sample of {args.scapy_sample:,}, extrapolated) | {t_scapy:.2f} "
          f"| {n / t_scapy:,.0f} | {t_scapy / wall:.2f} |")
    print(f"\nlarger run: {args.large.name} --parallelism dp: {l_n:,} packets in {l_wall:.2f} s wall, "
          f"{l_cpu:.2f} s CPU: {l_n / l_wall:,.0f} packets/s wall, {l_n / l_cpu:,.0f} per CPU-second; "
          f"peak RSS {l_rss / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
