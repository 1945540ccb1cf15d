"""Benchmark: the full collectives table of a 16,384-GPU Llama-3-405B iteration.

Plan: tp 8, pp 16 (first and last stage one layer short: 7 + 14 x 8 + 7 = 126 layers, as in the
Llama 3 paper), dp 128, seq 8192, global batch 2048 (16 micro-batches of 1 per DP replica), 2048
nodes of 8 H100. Reports rows, wall time and peak RSS; target: < 60 s and < 4 GiB.

Run: ``.venv/bin/python tools/bench_workload.py [--zero N] [--sp]``
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from wiretrace import plan as plan_mod
from wiretrace.workload import Workload, build_collectives, iteration_estimate


def llama405b_plan(zero: int = 0, sp: bool = False) -> plan_mod.Plan:
    doc = {
        "name": "llama3-405b on 2048 x 8 H100 (tp 8, pp 16, dp 128)",
        "model": {"preset": "llama3-405b"},
        "training": {"seq_length": 8192, "micro_batch_size": 1, "global_batch_size": 2048,
                     "param_dtype": "bf16", "grad_dtype": "fp32", "mfu": 0.4},
        "parallelism": {"tp": 8, "pp": 16, "dp": 128, "order": "tp-cp-ep-dp-pp", "zero": zero,
                        "sequence_parallel": sp,
                        "decoder_first_pipeline_num_layers": 7, "decoder_last_pipeline_num_layers": 7},
        "cluster": {"nodes": 2048, "gpus_per_node": 8, "gpu": "H100", "nic_rate": "400Gbps"},
    }
    return plan_mod.from_dict(doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--sp", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    plan = llama405b_plan(args.zero, args.sp)
    w = Workload(plan)
    t1 = time.perf_counter()
    table = build_collectives(plan, w)
    t2 = time.perf_counter()
    est = iteration_estimate(plan, w)
    t3 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB -> GiB
    counts = table.group_by("parallelism").aggregate([("op_id", "count")]).to_pylist()
    print(f"plan: {plan.name}")
    print(f"rows: {table.num_rows:,}  ranks values: {len(table.column('ranks').combine_chunks().values):,}")
    print("rows per parallelism: " + ", ".join(f"{c['parallelism']} {c['op_id_count']:,}" for c in counts))
    print(f"workload setup {t1 - t0:.2f} s, build_collectives {t2 - t1:.2f} s, estimate {t3 - t2:.2f} s, "
          f"total {t3 - t0:.2f} s")
    print(f"peak RSS {rss:.2f} GiB")
    print(f"iteration estimate: total {est['total_ns'] / 1e9:.2f} s (compute {est['compute_ns'] / 1e9:.2f} s, "
          f"bubble {est['bubble_ns'] / 1e9:.2f} s, exposed comm {est['exposed_comm_ns'] / 1e9:.2f} s), "
          f"achieved MFU {est['achieved_mfu']:.3f}")
    ok = (t2 - t0) < 60 and rss < 4
    print("target (< 60 s, < 4 GiB):", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
