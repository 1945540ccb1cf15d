"""Iteration-time estimate: compute, pipeline bubble and communication that cannot overlap.

The estimate walks the same timeline that gives the collectives their ``t_ready_ns``:

* each forward/backward pass lasts its compute (FLOPs / (peak x mfu)) plus the collectives that
  block it (TP/SP all-reduces, reduce-scatters and all-gathers, EP all-to-alls, the CP all-gather
  variant; Megatron-LM runs these on the critical path);
* passes are placed by the pipeline schedule (:mod:`wiretrace.workload.pipeline`), waiting for their
  inputs and the point-to-point transfer between stages;
* gradient buckets (DP) start when their last gradient exists and run one after another on the DP
  communicator, overlapping the rest of the backward pass; what runs past the end of the backward
  pass is exposed, as are the ZeRO-1/2 parameter all-gathers and the tied-embedding all-reduce.

Communication times use the nccl-tests bus-bandwidth model (:func:`~wiretrace.workload.compute.comm_ns`)
at the NVLink rate inside a node and the NIC rate across nodes.
"""

from __future__ import annotations

import numpy as np

from ..plan import Plan
from .compute import iteration_flops
from .schedule import Workload, _templates


def iteration_estimate(plan: Plan, workload: Workload | None = None) -> dict:
    """Time of one iteration of ``plan``, split into compute, bubble and exposed communication.

    Returns
    -------
    dict with (all times in ns, int):
        ``compute_ns`` (pure compute of the busiest pipeline stage), ``bubble_ns`` (time that stage
        waits on the pipeline, including point-to-point transfers), ``exposed_comm_ns`` (blocking
        collectives inside passes plus gradient/parameter communication after the last backward),
        ``total_ns`` = compute + bubble + exposed, ``makespan_ns`` (end of the last pass),
        ``p2p_ns`` (one pipeline transfer), ``microbatches``, ``tokens`` per iteration,
        ``model_flops`` per iteration (without recomputation), ``hardware_flops`` (with it),
        ``achieved_mfu`` (model FLOPs / (GPUs x peak x total)), ``achieved_hfu``,
        and ``stages``: per stage ``compute_ns``, ``busy_ns``, ``passes_end_ns``, ``end_ns``.

    Raises
    ------
    PlanError : the plan has no model.
    """
    w = workload or Workload(plan)
    tl = w.timeline
    temps = _templates(w)
    stages = []
    for s in range(w.pp):
        passes = tl.order[s]
        comp = sum(w.pass_plan(s, k, c).compute for (k, _mb, c) in passes)
        busy = sum(w.pass_plan(s, k, c).duration for (k, _mb, c) in passes)
        pend = max(tl.end[(s, k, mb, c)] for (k, mb, c) in passes)
        end = pend
        for fam, n in (("dp", w.dp * w.cp), ("edp", w.dp * w.cp // w.ep)):
            tm = temps.get((fam, s, -1))
            if tm is None or not len(tm):
                continue
            clock = 0.0
            for i in np.argsort(np.asarray(tm.t), kind="stable"):
                if tm.phase[i] == "forward" or (tm.phase[i] == "backward" and tm.layer[i] >= 0):
                    continue          # ZeRO-3 per-layer traffic overlaps the passes
                clock = max(clock, tm.t[i]) + w.comm(fam, tm.op[i], tm.bg[i], n)
            end = max(end, clock)
        tm = temps.get(("tp", s, -1))
        if tm is not None:
            for i, name in enumerate(tm.tensor):
                if name == "grad.layernorm":
                    end = max(end, tm.t[i] + w.comm("tp", "all_reduce", tm.bg[i], w.tp))
        stages.append({"compute_ns": comp, "busy_ns": busy, "passes_end_ns": pend, "end_ns": end})
    emb = temps.get(("embedding", -1, -1))
    if emb is not None and len(emb):
        t_emb = max(emb.t) + w.comm("embedding", "all_reduce", emb.bg[0], 2)
        for s in (0, w.pp - 1):
            stages[s]["end_ns"] = max(stages[s]["end_ns"], t_emb)
    total = max(st["end_ns"] for st in stages)
    crit = max(range(w.pp), key=lambda s: (stages[s]["busy_ns"], -s))
    compute = stages[crit]["compute_ns"]
    makespan = tl.makespan
    bubble = max(makespan - stages[crit]["busy_ns"], 0.0)
    exposed = max(total - compute - bubble, 0.0)
    t = plan.training
    mb_total = t.global_batch_size // t.micro_batch_size
    # MFU counts the model's FLOPs only (Chowdhery et al. 2022, PaLM, appendix B); what
    # activation recomputation adds is hardware FLOPs (HFU)
    flops = iteration_flops(w.m, w.b, w.s, mb_total, "none")
    hw_flops = iteration_flops(w.m, w.b, w.s, mb_total, t.recompute)
    world = plan.parallelism.world_size
    capacity = world * plan.cluster.peak_tflops * 1e12 * total * 1e-9
    achieved = flops / capacity if total else 0.0
    return {
        "compute_ns": int(round(compute)),
        "bubble_ns": int(round(bubble)),
        "exposed_comm_ns": int(round(exposed)),
        "total_ns": int(round(compute)) + int(round(bubble)) + int(round(exposed)),
        "makespan_ns": int(round(makespan)),
        "p2p_ns": int(round(w.p2p_ns)),
        "microbatches": w.mbs,
        "tokens": t.global_batch_size * t.seq_length,
        "model_flops": flops,
        "hardware_flops": hw_flops,
        "achieved_mfu": achieved,
        "achieved_hfu": hw_flops / capacity if total else 0.0,
        "stages": [{k: int(round(v)) for k, v in st.items()} for st in stages],
    }
