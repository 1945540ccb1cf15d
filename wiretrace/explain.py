"""``wiretrace explain``: the life of a token, from words to bits on the wire, for one plan.

Six sections, each with this plan's numbers:

1. text -> tokens: a byte-level BPE trained on the corpus at the model's vocabulary size (or a
   loaded ``tokenizer.json``); tokens, tokens per word, sequences, iterations per epoch
   (:mod:`wiretrace.tokens`);
2. tokens -> vectors: the embedding lookup on one tensor-parallel rank;
3. one transformer block: every tensor's shape and bytes in forward and backward, and the
   activations kept for backward;
4. parallelism: what each of DP/TP/SP/PP/CP/EP exchanges, between which ranks, how many times per
   iteration, logical payload bytes (from :func:`wiretrace.workload.build_collectives`);
5. collectives -> network: the bytes a ring (nccl-tests bus-bandwidth factors) or a direct
   exchange puts on each link, split into NVLink and network by the cluster placement
   (:func:`wiretrace.topology.build`);
6. time: the compute / bubble / exposed-communication estimate.

:func:`explain` returns the report as a JSON-ready dict; :func:`render` prints it with rich tables.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from .errors import WiretraceError
from .models import count_parameters, stage_parameter_counts
from .plan import DTYPE_BYTES, Plan
from .topology import build as build_topology
from .workload import Workload, build_collectives, iteration_estimate
from .workload.compute import busbw_factor

PARALLELISMS = ("dp", "tp", "sp", "pp", "cp", "ep")
RING_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def _tensor(name: str, shape: list[int], dtype: str, note: str = "") -> dict:
    n = 1
    for d in shape:
        n *= int(d)
    return {"name": name, "shape": [int(d) for d in shape], "dtype": dtype, "bytes": n * DTYPE_BYTES[dtype],
            "note": note}


# ---------------------------------------------------------------------------------------------
# sections 2 and 3: shapes
# ---------------------------------------------------------------------------------------------

def embedding_section(w: Workload) -> dict:
    """Embedding lookup on one TP rank for one micro-batch (Megatron-LM VocabParallelEmbedding:
    each rank looks up the ids inside its vocabulary shard, zeros elsewhere, then the partial
    results are all-reduced, or reduce-scattered along the sequence with SP)."""
    m, p = w.m, w.plan.parallelism
    b, sl, h, tp = w.b, w.s_local, m.hidden_size, w.tp
    ad, pd = w.act_dtype, w.param_dtype
    rows = [
        _tensor("input_ids", [b, sl], "int64", f"micro-batch of {b} x {sl} token ids" + (f" (s/cp, cp {w.cp})" if w.cp > 1 else "")),
        _tensor("embed_tokens.weight (shard)", [w.vocab_pad // tp, h], pd,
                f"vocabulary {m.vocab_size} padded to {w.vocab_pad}, split over tp {tp}" if tp > 1 else
                f"vocabulary {m.vocab_size} padded to {w.vocab_pad}"),
        _tensor("lookup output (partial)" if tp > 1 else "lookup output", [b, sl, h], ad,
                "rows outside this rank's vocabulary shard are zero" if tp > 1 else "one row per token"),
    ]
    if m.position_embedding == "learned":
        rows.append(_tensor("embed_positions.weight", [m.max_position_embeddings, h], pd, "learned positions, added"))
    if tp > 1:
        if w.sp:
            rows.append(_tensor("hidden states after reduce-scatter", [b, sl // tp, h], ad,
                                "sequence parallel: each TP rank keeps s/tp tokens"))
        else:
            rows.append(_tensor("hidden states after all-reduce", [b, sl, h], ad, "replicated on the TP group"))
    per_token = h * DTYPE_BYTES[ad]
    return {"tensors": rows, "bytes_per_token": per_token,
            "note": f"one token becomes {h} numbers of {ad}: {per_token} bytes", "sequence_parallel": bool(p.sequence_parallel)}


def block_section(w: Workload, layer: int | None = None) -> dict:
    """Shapes and bytes of one transformer block on one TP rank for one micro-batch.

    Activations kept for backward assume FlashAttention (softmax statistics instead of the
    ``s x s`` scores) and no dropout; Korthikanti et al. 2022 (table 2) give, for GPT with dropout
    and materialized scores, ``s b h (10 + 24/t + 5 a s/(h t))`` bytes per layer with tensor
    parallelism, ``s b h / t (34 + 5 a s / h)`` with sequence parallelism too, without the
    ``5 a s / h`` term with selective recomputation and ``2 s b h`` with full recomputation:
    shown as ``korthikanti_bytes`` for comparison.
    """
    m = w.m
    if layer is None:
        layer = w.layers[0][0]
    b, sl, h, tp = w.b, w.s_local, m.hidden_size, w.tp
    s_full = w.s
    a = m.num_attention_heads // tp
    g = max(m.num_key_value_heads // tp, 1)
    hd = m.head_dim
    ssp = sl // tp if w.sp else sl
    ad, gd = w.act_dtype, w.grad_dtype
    moe = m.is_moe_layer(layer)
    f = (m.moe_intermediate_size or m.intermediate_size) if moe else m.intermediate_size
    f_local = f // tp
    fwd = [
        _tensor("x (block input)", [b, ssp, h], ad, "residual stream" + (" (s/tp with SP)" if w.sp else "")),
        _tensor("input_layernorm out", [b, sl, h], ad, "all-gathered along s with SP" if w.sp else ""),
        _tensor("Q", [b, sl, a, hd], ad, f"{a} of {m.num_attention_heads} heads on this rank"),
        _tensor("K", [b, sl, g, hd], ad, f"{g} of {m.num_key_value_heads} KV heads (GQA)" if m.num_key_value_heads < m.num_attention_heads else ""),
        _tensor("V", [b, sl, g, hd], ad, ""),
        _tensor("attention scores", [b, a, sl, s_full], ad, "Q K^T / sqrt(d); never stored whole with FlashAttention"),
        _tensor("softmax statistics", [b, a, sl], "fp32", "what FlashAttention keeps for backward"),
        _tensor("context", [b, sl, a * hd], ad, "scores x V"),
        _tensor("o_proj out (partial)" if tp > 1 else "o_proj out", [b, sl, h], ad,
                ("reduce-scattered" if w.sp else "all-reduced") + " over TP" if tp > 1 else ""),
        _tensor("post_attention_layernorm out", [b, sl, h], ad, "all-gathered along s with SP" if w.sp else ""),
    ]
    if moe:
        tokens = b * sl // (tp if w.sp else 1)
        fwd.append(_tensor("router logits", [tokens, m.num_local_experts], "fp32", f"top-{m.num_experts_per_tok} of {m.num_local_experts} experts"))
        fwd.append(_tensor("dispatched tokens", [w.a2a_bytes_per_rank() // (h * DTYPE_BYTES[ad]), h], ad,
                           f"tokens x top-k (capacity factor {m.capacity_factor}), all-to-all over EP {w.ep}"))
    if m.gated_mlp:
        fwd += [_tensor("gate_proj out", [b, sl, f_local], ad, ""), _tensor("up_proj out", [b, sl, f_local], ad, ""),
                _tensor("silu(gate) * up", [b, sl, f_local], ad, "SwiGLU")]
    else:
        fwd += [_tensor("up_proj out", [b, sl, f_local], ad, ""), _tensor("gelu(up)", [b, sl, f_local], ad, "GELU")]
    fwd.append(_tensor("down_proj out (partial)" if tp > 1 else "down_proj out", [b, sl, h], ad,
                       ("reduce-scattered" if w.sp else "all-reduced") + " over TP" if tp > 1 else ""))
    # gradients: the same activations flow back, plus weight gradients
    bwd = [_tensor("d " + t["name"], t["shape"], ad if t["dtype"] != "fp32" else "fp32", "")
           for t in fwd if t["name"] not in ("attention scores", "softmax statistics", "router logits")]
    weights = [t for t in w.tensors if t.layer == layer and t.expert < max(m.num_local_experts // w.ep, 1)]
    for t in weights:
        n = t.shard_numel(tp, w.vocab_pad)
        bwd.append({"name": f"grad {t.name.split('.', 2)[-1]}", "shape": [n], "dtype": gd,
                    "bytes": n * DTYPE_BYTES[gd], "note": f"full {list(t.shape)}, {t.split}"})
    ab = DTYPE_BYTES[ad]
    rc = w.plan.training.recompute
    if rc == "full":
        kept = b * ssp * h * ab
    else:
        kept = (2 * b * ssp * h + (b * sl * h if not w.sp else b * ssp * h) * 2) * ab   # x, norm2 in, norm outs
        kept += b * sl * (a + 2 * g) * hd * ab + b * a * sl * 4 + b * sl * a * hd * ab
        kept += (3 if m.gated_mlp else 2) * b * sl * f_local * ab
    # Korthikanti et al. 2022, table 2 (bytes per layer, 16-bit activations, GPT with dropout):
    # TP: sbh(10 + 24/t + 5as/(ht)); TP+SP: sbh/t (34 + 5as/h); selective: drop the 5as/h term;
    # full recompute: 2sbh
    sbh = w.s_local * b * h
    a_s_h = 5 * m.num_attention_heads * s_full / h
    if rc == "full":
        kor = 2 * sbh
    elif w.sp:
        kor = sbh / tp * (34 + (0 if rc == "selective" else a_s_h))
    else:
        kor = sbh * (10 + 24 / tp + (0 if rc == "selective" else a_s_h / tp))
    # micro-batches whose activations the first pipeline stage holds at once: all of them with
    # GPipe, pp with 1F1B (Narayanan et al. 2021 sec. 2.2), and the interleaved warm-up depth
    # ((pp - 1) * 2 + (v - 1) * pp + 1 passes of 1/v of the layers) with interleaving
    pp, mbs, v = w.pp, w.mbs, w.v
    sched = w.plan.parallelism.pp_schedule
    if sched == "gpipe":
        in_flight = float(mbs)
    elif v > 1:
        in_flight = min((pp - 1) * 2 + (v - 1) * pp + 1, mbs * v) / v
    else:
        in_flight = float(min(pp, mbs))
    stage0_layers = sum(len(w.layers[c * pp]) for c in range(v))
    return {"layer": layer, "moe": moe, "forward": fwd, "backward": bwd,
            "activations_kept_bytes": int(kept), "korthikanti_bytes": int(kor), "recompute": rc,
            "microbatches_in_flight": in_flight, "stage0_layers": stage0_layers,
            "activations_stage0_bytes": int(kept * stage0_layers * in_flight),
            "weight_grad_bytes": int(sum(t["bytes"] for t in bwd if t["name"].startswith("grad ")))}


# ---------------------------------------------------------------------------------------------
# section 4 and 5: from the collectives table
# ---------------------------------------------------------------------------------------------

def _pattern(name: str) -> str:
    return re.sub(r"\d+", "*", name)


def _sent_per_rank(op: str, n: int, size: float) -> float:
    """Bytes one rank sends for a call of nccl-tests size ``size`` (all_to_all: all ranks' inputs)."""
    if op in ("all_to_all", "all_to_allv"):
        return size / n * busbw_factor(op, n)
    return size * busbw_factor(op, n)


def parallelism_section(table: pa.Table, world: int, nvlink: np.ndarray | None = None,
                        network: np.ndarray | None = None) -> dict:
    """Calls, communicators and logical payload per (parallelism, op, tensor pattern, phase).

    With the per-row ``nvlink``/``network`` bytes of :func:`link_bytes`, each row also carries
    their sums, the nccl-tests busbw factor and the bytes one rank sends per call.
    """
    if table.num_rows == 0:
        return {"rows": [], "totals": {}}
    if nvlink is None:
        nvlink = network = np.zeros(table.num_rows)
    tensor = table.column("tensor").combine_chunks()
    dict_vals = [_pattern(v) for v in tensor.dictionary.to_pylist()]
    pat = pa.DictionaryArray.from_arrays(tensor.indices, pa.array(dict_vals)).cast(pa.string())
    src = table.column("src").to_numpy().astype(np.int64)
    dst = table.column("dst").to_numpy().astype(np.int64)
    grp = table.column("group").to_numpy()
    comm = np.where(src >= 0, -(src * world + dst) - 1, grp)
    t = pa.table({"parallelism": table.column("parallelism").cast(pa.string()),
                  "op": table.column("op").cast(pa.string()), "phase": table.column("phase").cast(pa.string()),
                  "tensor": pat, "dtype": table.column("dtype").cast(pa.string()),
                  "bytes": table.column("bytes_global"), "size": table.column("group_size"),
                  "comm": pa.array(comm), "op_id": table.column("op_id"),
                  "nv": pa.array(nvlink), "net": pa.array(network)})
    agg = t.group_by(["parallelism", "op", "phase", "tensor", "dtype"], use_threads=False).aggregate(
        [("op_id", "count"), ("bytes", "sum"), ("bytes", "min"), ("bytes", "max"), ("comm", "count_distinct"),
         ("size", "max"), ("op_id", "min"), ("nv", "sum"), ("net", "sum")])
    first = {int(r): i for i, r in enumerate(table.column("op_id").to_numpy())}
    ranks_col = table.column("ranks")
    out = []
    for r in agg.to_pylist():
        i = first[r["op_id_min"]]
        out.append({"parallelism": r["parallelism"], "op": r["op"], "phase": r["phase"], "tensor": r["tensor"],
                    "dtype": r["dtype"], "calls": r["op_id_count"], "communicators": r["comm_count_distinct"],
                    "calls_per_communicator": r["op_id_count"] // max(r["comm_count_distinct"], 1),
                    "group_size": r["size_max"], "bytes_min": r["bytes_min"], "bytes_max": r["bytes_max"],
                    "bytes_total": r["bytes_sum"], "example_ranks": ranks_col[i].as_py()[:16],
                    "busbw_factor": busbw_factor(r["op"], r["size_max"]),
                    "sent_per_rank_min": int(round(_sent_per_rank(r["op"], r["size_max"], r["bytes_min"]))),
                    "sent_per_rank_max": int(round(_sent_per_rank(r["op"], r["size_max"], r["bytes_max"]))),
                    "nvlink_bytes": int(round(r["nv_sum"])), "network_bytes": int(round(r["net_sum"])),
                    "first_op_id": r["op_id_min"]})
    out.sort(key=lambda r: (PARALLELISMS.index(r["parallelism"]) if r["parallelism"] in PARALLELISMS else 99,
                            r["first_op_id"]))
    totals: dict[str, dict] = {}
    for r in out:
        d = totals.setdefault(r["parallelism"], {"calls": 0, "bytes": 0})
        d["calls"] += r["calls"]; d["bytes"] += r["bytes_total"]
    return {"rows": out, "totals": totals}


def link_bytes(table: pa.Table, gpus_per_node: int, rank_node: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each collective call puts on NVLink and on the network, per row.

    Ring operations (all_reduce, all_gather, reduce_scatter, broadcast, reduce) send ``busbw factor
    x S`` from every rank to its ring successor (``ranks`` order): nccl-tests ``PERFORMANCE.md``
    factors 2(n-1)/n for all_reduce, (n-1)/n for all_gather/reduce_scatter, 1 for broadcast/reduce.
    all_to_all sends ``bytes_per_rank / n`` from every rank to every other rank of the group;
    send_recv sends ``S`` from ``src`` to ``dst``. A hop between GPUs of one node is NVLink, else
    network. Returns ``(nvlink_bytes, network_bytes)`` float64 arrays of length ``num_rows``.
    """
    n_rows = table.num_rows
    nv = np.zeros(n_rows)
    net = np.zeros(n_rows)
    if n_rows == 0:
        return nv, net
    ranks = table.column("ranks").combine_chunks()
    offsets = ranks.offsets.to_numpy().astype(np.int64)
    values = ranks.values.to_numpy().astype(np.int64)
    node = values // gpus_per_node if rank_node is None else rank_node[values]
    sizes = np.diff(offsets)
    op = table.column("op").combine_chunks()
    op_names = op.dictionary.to_pylist()
    op_idx = op.indices.to_numpy()
    S = table.column("bytes_global").to_numpy().astype(np.float64)
    bpr = table.column("bytes_per_rank").to_numpy().astype(np.float64)
    # ring successor of each flat position: the next one, wrapping to the group's first
    succ = np.arange(1, len(values) + 1, dtype=np.int64)
    ends = offsets[1:] - 1
    nonempty = sizes > 0
    succ[ends[nonempty]] = offsets[:-1][nonempty]
    cross = (node != node[succ]).astype(np.int64)
    starts = offsets[:-1]
    cross_per_row = np.add.reduceat(cross, starts) if len(values) else np.zeros(n_rows, np.int64)
    cross_per_row = np.where(nonempty, cross_per_row, 0)
    factor = np.zeros(n_rows)
    for k, name in enumerate(op_names):
        sel = op_idx == k
        if not sel.any():
            continue
        if name in RING_OPS:
            for n in np.unique(sizes[sel]):
                ss = sel & (sizes == n)
                factor[ss] = busbw_factor(name, int(n))
            per_edge = factor[sel] * S[sel]
            net[sel] = per_edge * cross_per_row[sel]
            nv[sel] = per_edge * (sizes[sel] - cross_per_row[sel])
        elif name == "send_recv":
            src = table.column("src").to_numpy().astype(np.int64)[sel]
            dst = table.column("dst").to_numpy().astype(np.int64)[sel]
            srcn = src // gpus_per_node if rank_node is None else rank_node[src]
            dstn = dst // gpus_per_node if rank_node is None else rank_node[dst]
            is_net = srcn != dstn
            net[sel] = np.where(is_net, S[sel], 0.0)
            nv[sel] = np.where(is_net, 0.0, S[sel])
        elif name in ("all_to_all", "all_to_allv"):
            # ordered pairs of ranks on different nodes, once per communicator
            rows_idx = np.flatnonzero(sel)
            groups = table.column("group").to_numpy()[rows_idx]
            uniq, first = np.unique(groups, return_index=True)
            cross_of = {}
            for gid, i in zip(uniq.tolist(), rows_idx[first].tolist()):
                g = node[offsets[i]:offsets[i + 1]]
                _, counts = np.unique(g, return_counts=True)
                cross_of[gid] = len(g) ** 2 - int((counts ** 2).sum())
            cross_pairs = np.array([cross_of[g] for g in groups.tolist()], dtype=np.float64)
            n = sizes[rows_idx].astype(np.float64)
            net[rows_idx] = bpr[rows_idx] / n * cross_pairs
            nv[rows_idx] = bpr[rows_idx] / n * (n * (n - 1) - cross_pairs)
    return nv, net


def network_section(table: pa.Table, plan: Plan, nv: np.ndarray | None = None,
                    net: np.ndarray | None = None) -> dict:
    """Section 5: NVLink and network bytes per parallelism per iteration (all ranks together and
    per GPU), after the ring / direct algorithms (per-row bytes from :func:`link_bytes`, computed
    here when not given)."""
    if nv is None or net is None:
        topo = build_topology(plan)
        nv, net = link_bytes(table, plan.cluster.gpus_per_node, topo.rank_node.astype(np.int64))
    par = table.column("parallelism").combine_chunks()
    names = par.dictionary.to_pylist() if table.num_rows else []
    idx = par.indices.to_numpy() if table.num_rows else np.zeros(0, np.int64)
    algs = sorted(set(table.column("algorithm").combine_chunks().dictionary.to_pylist())) if table.num_rows else []
    world = plan.cluster.world_size
    out: dict[str, dict] = {}
    for k, name in enumerate(names):
        sel = idx == k
        out[name] = {"nvlink_bytes": int(round(nv[sel].sum())), "network_bytes": int(round(net[sel].sum())),
                     "network_bytes_per_gpu": int(round(net[sel].sum() / world)),
                     "nvlink_bytes_per_gpu": int(round(nv[sel].sum() / world))}
    tot_net, tot_nv = float(net.sum()), float(nv.sum())
    per_gpu_net = tot_net / world
    return {"per_parallelism": out,
            "total": {"nvlink_bytes": int(round(tot_nv)), "network_bytes": int(round(tot_net)),
                      "network_bytes_per_gpu": int(round(per_gpu_net)),
                      "network_time_per_gpu_ns": int(round(per_gpu_net * 8 / plan.cluster.nic_rate_bps * 1e9)),
                      "nic_rate_bps": plan.cluster.nic_rate_bps, "nvlink_rate_bps": plan.cluster.nvlink_rate_bps},
            "algorithms": algs,
            "note": ("ring bus-bandwidth factors (nccl-tests) for ring/auto/other collective algorithms, "
                     "direct exchange for send_recv and all_to_all; `wiretrace schedule` lowers each call "
                     "to its exact messages")}


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------

def parameters_section(w: Workload) -> dict:
    c = count_parameters(w.m)
    p = w.plan.parallelism
    per_stage = stage_parameter_counts(w.m, w.tp, w.pp, w.ep, w.v, p.decoder_first_pipeline_num_layers,
                                       p.decoder_last_pipeline_num_layers)
    return {"total": c.total, "active": c.active, "embedding": c.embedding, "output": c.output,
            "per_layer": c.per_layer[0] if c.per_layer else 0,
            "per_gpu_by_stage": per_stage, "max_per_gpu": max(per_stage),
            "param_bytes_per_gpu": max(per_stage) * w.param_b, "grad_bytes_per_gpu": max(per_stage) * w.grad_b}


def explain(plan: Plan, corpus: str | Path | None = None, tokenizer: str | Path | None = None,
            table: pa.Table | None = None) -> dict:
    """The six-section report of ``plan`` as a JSON-ready dict.

    Keys: ``plan``, ``parameters`` (``total`` ...), ``tokens`` (None without a corpus),
    ``embedding``, ``block``, ``parallelism`` (``rows``, ``totals``: calls and logical bytes per
    parallelism), ``network`` (``per_parallelism`` NVLink/network bytes, ``total``), ``time``
    (:func:`~wiretrace.workload.iteration_estimate`).

    Raises
    ------
    WiretraceError : ``tokenizer`` without ``corpus``, unreadable corpus or tokenizer, or a plan
        without a model.
    """
    if tokenizer is not None and corpus is None:
        raise WiretraceError("--tokenizer needs --corpus (the text to count tokens of)")
    w = Workload(plan)
    t = plan.training
    tok = None
    if corpus is not None:
        from .tokens import corpus_stats
        tok = corpus_stats(corpus, t.seq_length, t.global_batch_size, plan.model.vocab_size, tokenizer).to_dict()
    if table is None:
        table = build_collectives(plan, w)
    est = iteration_estimate(plan, w)
    p = plan.parallelism
    topo = build_topology(plan)
    nv_rows, net_rows = link_bytes(table, plan.cluster.gpus_per_node, topo.rank_node.astype(np.int64))
    net = network_section(table, plan, nv_rows, net_rows)
    est = dict(est)
    est["tokens_per_second"] = est["tokens"] / (est["total_ns"] * 1e-9) if est["total_ns"] else 0.0
    if tok is not None and est["total_ns"]:
        est["epoch_seconds"] = tok["iterations_per_epoch"] * est["total_ns"] * 1e-9
    return {
        "plan": {"name": plan.name, "model": plan.model.name, "world_size": plan.cluster.world_size,
                 "nodes": plan.cluster.nodes, "gpus_per_node": plan.cluster.gpus_per_node,
                 "tp": p.tp, "pp": p.pp, "dp": p.dp, "cp": p.cp, "ep": p.ep, "zero": p.zero,
                 "sequence_parallel": p.sequence_parallel, "pp_schedule": p.pp_schedule,
                 "virtual_stages": p.virtual_stages, "order": p.order,
                 "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
                 "seq_length": t.seq_length, "microbatches": plan.num_microbatches,
                 "recompute": t.recompute},
        "parameters": parameters_section(w),
        "tokens": tok,
        "embedding": embedding_section(w),
        "block": block_section(w),
        "parallelism": parallelism_section(table, plan.cluster.world_size, nv_rows, net_rows),
        "network": net,
        "time": est,
    }


# ---------------------------------------------------------------------------------------------
# terminal rendering
# ---------------------------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    """Bytes with binary prefixes: ``1.50 MiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"


def human_ns(ns: float) -> str:
    ns = float(ns)
    if ns >= 1e9:
        return f"{ns / 1e9:.3f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns:.0f} ns"


def _ratio(v: float | None) -> str:
    """A ratio to three decimals, or "n/a" when it has no denominator (a corpus without words)."""
    return "n/a" if v is None else f"{v:.3f}"


def render(report: dict, console=None) -> None:
    """Print ``report`` (from :func:`explain`) as rich tables."""
    from rich.console import Console
    from rich.table import Table

    con = console
    if con is None:
        con = Console()
        if not con.is_terminal:          # files and pipes: wide enough for the tables
            con = Console(width=160)
    pl, prm = report["plan"], report["parameters"]
    con.rule(f"[bold]{pl['name']}")
    con.print(f"model {pl['model']}: {prm['total']:,} parameters ({prm['total'] / 1e9:.2f} B"
              + (f", {prm['active']:,} active per token" if prm["active"] != prm["total"] else "") + "); "
              f"{pl['world_size']} GPUs = tp {pl['tp']} x cp {pl['cp']} x dp {pl['dp']} x pp {pl['pp']}"
              + (f", ep {pl['ep']}" if pl["ep"] > 1 else "")
              + f"; {prm['max_per_gpu']:,} parameters on the fullest GPU")

    con.rule("1. text -> tokens")
    tok = report["tokens"]
    if tok is None:
        con.print("no corpus given (--corpus FILE): skipping tokenization")
    else:
        t = Table(show_header=False)
        t.add_column(); t.add_column(justify="right")
        for k, v in (("corpus", tok["corpus"]), ("bytes / characters / words", f"{tok['bytes']:,} / {tok['characters']:,} / {tok['words']:,}"),
                     ("tokenizer", f"{tok['tokenizer']}, vocabulary {tok['vocab_size']:,} (model {tok['vocab_target']:,})"),
                     ("tokens", f"{tok['tokens']:,}"), ("tokens per word", _ratio(tok["tokens_per_word"])),
                     ("bytes per token", _ratio(tok["bytes_per_token"])),
                     (f"sequences of {tok['seq_length']}", f"{tok['sequences']:,}"),
                     (f"iterations per epoch (global batch {tok['global_batch_size']})", f"{tok['iterations_per_epoch']:.4f}")):
            t.add_row(k, str(v))
        con.print(t)
        ex = tok["example"]
        byte_level = any("Ġ" in t or "Ċ" in t for t in ex["tokens"])
        con.print(f"example: {ex['text']!r} -> {len(ex['ids'])} tokens {ex['tokens'][:24]}"
                  + (" (byte-level BPE: Ġ marks a leading space, Ċ a newline)" if byte_level else ""))

    def shape_table(title: str, rows: list[dict]) -> Table:
        t = Table(title=title)
        for c, j in (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("bytes", "right"), ("", "left")):
            t.add_column(c, justify=j)
        for r in rows:
            t.add_row(r["name"], "x".join(map(str, r["shape"])), r["dtype"], human_bytes(r["bytes"]), r["note"])
        return t

    con.rule("2. tokens -> vectors (one TP rank, one micro-batch)")
    con.print(shape_table("embedding", report["embedding"]["tensors"]))
    con.print(report["embedding"]["note"])

    blk = report["block"]
    con.rule(f"3. one transformer block (layer {blk['layer']}{', MoE' if blk['moe'] else ''}; one TP rank, one micro-batch)")
    con.print(shape_table("forward", blk["forward"]))
    con.print(shape_table("backward", blk["backward"]))
    con.print(f"activations kept for backward: {human_bytes(blk['activations_kept_bytes'])} per layer "
              f"(recompute {blk['recompute']}; Korthikanti et al. table 2 for GPT without FlashAttention: "
              f"{human_bytes(blk['korthikanti_bytes'])}); weight gradients {human_bytes(blk['weight_grad_bytes'])}")
    con.print(f"first pipeline stage: {blk['stage0_layers']} layers x {blk['microbatches_in_flight']:g} micro-batches "
              f"in flight = {human_bytes(blk['activations_stage0_bytes'])} of activations per GPU")

    con.rule("4. parallelism: what is exchanged, per iteration")
    t = Table()
    for c in ("par", "op", "phase", "tensor", "dtype", "group", "comms", "calls/comm", "bytes/call", "payload/iter", "e.g. ranks"):
        t.add_column(c, justify="right" if c in ("group", "comms", "calls/comm", "bytes/call", "payload/iter") else "left")
    for r in report["parallelism"]["rows"]:
        bc = human_bytes(r["bytes_min"]) if r["bytes_min"] == r["bytes_max"] else f"{human_bytes(r['bytes_min'])}..{human_bytes(r['bytes_max'])}"
        ranks = r["example_ranks"]
        phase = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}.get(r["phase"], r["phase"])
        t.add_row(r["parallelism"], r["op"], phase, r["tensor"], r["dtype"], str(r["group_size"]),
                  f"{r['communicators']:,}", f"{r['calls_per_communicator']:,}", bc, human_bytes(r["bytes_total"]),
                  ",".join(map(str, ranks[:8])) + ("..." if len(ranks) > 8 else ""))
    con.print(t)

    con.rule("5. collectives -> network (per iteration)")
    net = report["network"]
    t = Table(title="per call: bytes each rank sends (busbw factor x size); per iteration: bytes on each kind of link")
    for c in ("par", "op", "phase", "tensor", "ranks", "busbw", "sent/rank/call", "NVLink/iter", "network/iter"):
        t.add_column(c, justify="left" if c in ("par", "op", "phase", "tensor") else "right")
    for r in report["parallelism"]["rows"]:
        phase = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}.get(r["phase"], r["phase"])
        sent = (human_bytes(r["sent_per_rank_min"]) if r["sent_per_rank_min"] == r["sent_per_rank_max"]
                else f"{human_bytes(r['sent_per_rank_min'])}..{human_bytes(r['sent_per_rank_max'])}")
        t.add_row(r["parallelism"], r["op"], phase, r["tensor"], str(r["group_size"]), f"{r['busbw_factor']:.3f}", sent,
                  human_bytes(r["nvlink_bytes"]), human_bytes(r["network_bytes"]))
    con.print(t)
    t = Table()
    for c in ("parallelism", "logical payload", "NVLink bytes", "network bytes", "network bytes per GPU"):
        t.add_column(c, justify="left" if c == "parallelism" else "right")
    totals = report["parallelism"]["totals"]
    for name, d in net["per_parallelism"].items():
        t.add_row(name, human_bytes(totals.get(name, {}).get("bytes", 0)), human_bytes(d["nvlink_bytes"]),
                  human_bytes(d["network_bytes"]), human_bytes(d["network_bytes_per_gpu"]))
    tt = net["total"]
    t.add_row("[bold]total", "", human_bytes(tt["nvlink_bytes"]), human_bytes(tt["network_bytes"]),
              human_bytes(tt["network_bytes_per_gpu"]))
    con.print(t)
    con.print(f"algorithms: {', '.join(net['algorithms'])}; {net['note']}. At {tt['nic_rate_bps'] / 1e9:g} Gb/s "
              f"per NIC the network bytes of one GPU take {human_ns(tt['network_time_per_gpu_ns'])}.")

    con.rule("6. time (compute model and bandwidths of the plan)")
    tm = report["time"]
    t = Table(show_header=False)
    t.add_column(); t.add_column(justify="right")
    for k, v in (("compute (busiest stage)", human_ns(tm["compute_ns"])), ("pipeline bubble", human_ns(tm["bubble_ns"])),
                 ("exposed communication", human_ns(tm["exposed_comm_ns"])), ("iteration", human_ns(tm["total_ns"])),
                 ("micro-batches per DP replica", str(tm["microbatches"])),
                 ("tokens per second", f"{tm['tokens_per_second']:,.0f}"),
                 ("model FLOPs per iteration", f"{tm['model_flops']:.3e}"),
                 ("achieved MFU", f"{tm['achieved_mfu']:.3f}")):
        t.add_row(k, v)
    if "epoch_seconds" in tm:
        t.add_row("one epoch of the corpus", human_ns(tm["epoch_seconds"] * 1e9))
    con.print(t)
