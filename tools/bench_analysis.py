"""Benchmark of `wiretrace summarize`: throughput and peak memory against capture size.

Generates captures of one plan with whole frames (``--snaplen 0``) for growing time windows of
the iteration, summarizes each in a fresh process and prints packets/s, MB/s of capture and the
peak resident set size. Memory must stay flat as the capture grows (the summary streams).

    .venv/bin/python tools/bench_analysis.py [--plan samples/plans/gpt2-small-2x4.json]
        [--windows 5ms:5.5ms,5ms:6ms,4ms:8ms] [--snaplen 0] [--keep DIR]

A multi-GB run: --plan samples/plans/llama3-8b-4x8.json --windows 0:1s --snaplen 128
(34 million frames, about 5 GB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, resource, sys, time
from wiretrace.analysis import summarize
t = time.perf_counter()
doc = summarize(sys.argv[1])
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "packets": doc["totals"]["packets"],
                  "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=str(ROOT / "samples" / "plans" / "gpt2-small-2x4.json"))
    ap.add_argument("--windows", default="5ms:5.5ms,5ms:6ms,4ms:8ms,0:1s",
                    help="comma-separated generate --window values (growing)")
    ap.add_argument("--snaplen", default="0", help="generate --snaplen (0: whole frames)")
    ap.add_argument("--max-packets", default="100000000", help="generate --max-packets")
    ap.add_argument("--keep", help="directory to keep the captures in (default: a temporary one)")
    args = ap.parse_args()
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="wiretrace-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{'window':>14} {'capture MB':>11} {'packets':>10} {'seconds':>8} {'pkt/s':>10} {'MB/s':>8} {'peak RSS MB':>12}")
    for i, window in enumerate(args.windows.split(",")):
        cap = out / f"w{i}.pcap"
        subprocess.run([sys.executable, "-m", "wiretrace.cli", "generate", "--plan", args.plan, "-o", str(cap),
                        "--window", window, "--snaplen", args.snaplen, "--max-packets", args.max_packets,
                        "--no-parquet", "--force", "-q"], check=True)
        size_mb = cap.stat().st_size / 1e6
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", _CHILD, str(cap)], check=True, capture_output=True, text=True)
        res = json.loads(r.stdout)
        wall = time.perf_counter() - t
        print(f"{window:>14} {size_mb:11.1f} {res['packets']:10,} {res['seconds']:8.2f} "
              f"{res['packets'] / res['seconds']:10,.0f} {size_mb / res['seconds']:8.1f} "
              f"{res['max_rss_kib'] / 1024:12.1f}   (process {wall:.2f} s)")
        if not args.keep:
            cap.unlink()
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
