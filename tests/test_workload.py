"""The analytical schedule: every parallelism's collective sizes and counts against the published
formulas and the frameworks' source (cited per test)."""

from __future__ import annotations

import collections

import pytest

from wiretrace import plan as P
from wiretrace.tables import check
from wiretrace.workload import build_collectives, build_groups, iteration_estimate, rank_groups
from wiretrace.workload.compute import iteration_flops
from wiretrace.workload.pipeline import simulate, stage_order

# A small dense model: 4 layers, h 256, 8 heads of 32, SwiGLU 1024, vocab 1024 (a multiple of
# Megatron's 128 x tp padding, so shards need no padding), untied.
SMALL = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8,
         "num_key_value_heads": 8, "vocab_size": 1024, "tie_word_embeddings": False}
B, S, H = 2, 128, 256
ACT = B * S * H * 2          # b s h bf16 activations, bytes


def mkplan(par: dict, model: dict | None = None, training: dict | None = None, nodes: int = 1,
           gpus: int = 8, collectives: dict | None = None) -> P.Plan:
    tr = {"seq_length": S, "micro_batch_size": B, "global_batch_size": 8}
    tr.update(training or {})
    doc = {"model": dict(model or SMALL), "training": tr, "parallelism": par,
           "cluster": {"nodes": nodes, "gpus_per_node": gpus}}
    if collectives:
        doc["collectives"] = collectives
    return P.from_dict(doc)


def rows(table, **where):
    d = table.to_pydict()
    keep = [i for i in range(table.num_rows) if all(d[k][i] == v for k, v in where.items())]
    return [{k: d[k][i] for k in d} for i in keep]


def count(table, **where) -> int:
    return len(rows(table, **where))


# ---------------------------------------------------------------------------------------------
# process groups
# ---------------------------------------------------------------------------------------------

def test_groups_match_megatron_docstring_examples():
    """Megatron-LM ``initialize_model_parallel`` docstring (megatron/core/parallel_state.py): 16 GPUs,
    tp 2, pp 4 -> 8 data-parallel groups [g0, g2], [g1, g3], [g4, g6]..., 8 tensor groups [g0, g1]...,
    4 pipeline groups [g0, g4, g8, g12]...; and the ``generate_masked_orthogonal_rank_groups``
    example: sizes [tp 2, dp 3, pp 4], dp groups [0, 2, 4], [1, 3, 5], ..., [19, 21, 23]."""
    g = build_groups(tp=2, cp=1, dp=2, pp=4, ep=1, order="tp-cp-ep-dp-pp")
    assert g.dp.tolist() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.tp.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g.pp.tolist() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g.embedding.tolist() == [[0, 12], [1, 13], [2, 14], [3, 15]]
    dp = rank_groups({"tp": 2, "dp": 3, "pp": 4}, "tp-dp-pp", "dp")
    assert dp[0].tolist() == [0, 2, 4] and dp[1].tolist() == [1, 3, 5] and dp[7].tolist() == [19, 21, 23]


def test_groups_context_and_expert_parallel():
    """CP groups from the ``context_parallel_size`` docstring (8 GPUs, tp 4, cp 2: [0, 4], [1, 5],
    [2, 6], [3, 7]); the dense gradient group is ``dp-cp``; the expert generator uses cp = 1 and
    dp = dp*cp/ep, so with tp 1, dp 4, ep 2 EP groups are [0, 1], [2, 3] and expert-DP groups
    [0, 2], [1, 3]."""
    g = build_groups(tp=4, cp=2, dp=1, pp=1, ep=1, order="tp-cp-ep-dp-pp")
    assert g.cp.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.dp.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    e = build_groups(tp=1, cp=1, dp=4, pp=1, ep=2, order="tp-cp-ep-dp-pp")
    assert e.ep.tolist() == [[0, 1], [2, 3]] and e.edp.tolist() == [[0, 2], [1, 3]]
    assert e.dp.tolist() == [[0, 1, 2, 3]]


def test_order_dp_first():
    """``order: dp-tp-pp`` makes DP fastest: DP groups are consecutive ranks, TP strided."""
    g = build_groups(tp=2, cp=1, dp=4, pp=1, ep=1, order="dp-tp-pp")
    assert g.dp.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and g.tp.tolist()[0] == [0, 4]


# ---------------------------------------------------------------------------------------------
# TP and SP
# ---------------------------------------------------------------------------------------------

def test_tp_all_reduces_per_layer_and_microbatch():
    """Megatron-LM (Shoeybi et al. 2019, fig. 3; ``tensor_parallel/mappings.py``): operators g
    (forward all-reduce after attention and MLP) and f (backward all-reduce of the input gradient)
    give 2 forward + 2 backward all-reduces of b x s x h per layer per micro-batch; plus the
    vocabulary-parallel embedding's forward all-reduce, the output layer's backward input-gradient
    all-reduce and the vocabulary-parallel cross entropy's three fp32 all-reduces of b x s
    (``cross_entropy.py``: max logit, predicted logit, sum of exponentials)."""
    plan = mkplan({"tp": 4, "dp": 2})
    t = build_collectives(plan)
    m = plan.num_microbatches
    assert m == 2
    tp_rows = rows(t, parallelism="tp")
    per_group = collections.Counter(r["group"] for r in tp_rows)
    assert len(per_group) == 2
    acts = [r for r in tp_rows if r["dtype"] == "bf16"]
    assert all(r["op"] == "all_reduce" and r["bytes_global"] == r["bytes_per_rank"] == ACT for r in acts)
    assert len(acts) == 2 * (4 * 4 * m + m + m)
    by_tensor = collections.Counter((r["tensor"], r["phase"]) for r in acts)
    assert by_tensor[("attn.out_proj.activation", "forward")] == 2 * 4 * m
    assert by_tensor[("mlp.down_proj.activation", "forward")] == 2 * 4 * m
    assert by_tensor[("mlp.up_proj.input_grad", "backward")] == 2 * 4 * m
    assert by_tensor[("attn.qkv_proj.input_grad", "backward")] == 2 * 4 * m
    ce = [r for r in tp_rows if r["dtype"] == "fp32"]
    assert len(ce) == 2 * 3 * m and {r["bytes_global"] for r in ce} == {B * S * 4}
    assert {tuple(r["ranks"]) for r in tp_rows} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert all(r["group_size"] == 4 for r in tp_rows)


def test_sequence_parallel_turns_all_reduces_into_rs_and_ag():
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    sec. 4.2.2): with sequence parallelism each all-reduce becomes a reduce-scatter plus an
    all-gather of b x s x h, each rank holding s/tp. Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication.backward`` all-gathers the column-parallel
    input once more for the weight gradient: per layer and micro-batch 2 AG + 2 RS forward,
    4 AG + 2 RS backward, and no activation all-reduce left."""
    plan = mkplan({"tp": 4, "dp": 2, "sequence_parallel": True})
    t = build_collectives(plan)
    m = plan.num_microbatches
    layer_rows = [r for r in rows(t, group=0) if r["layer"] >= 0]
    assert not [r for r in layer_rows if r["op"] == "all_reduce"]
    c = collections.Counter((r["phase"], r["op"]) for r in layer_rows)
    assert c[("forward", "all_gather")] == 2 * 4 * m and c[("forward", "reduce_scatter")] == 2 * 4 * m
    assert c[("backward", "all_gather")] == 4 * 4 * m and c[("backward", "reduce_scatter")] == 2 * 4 * m
    assert all(r["parallelism"] == "sp" and r["bytes_global"] == ACT and r["bytes_per_rank"] == ACT // 4
               for r in layer_rows)
    # norm gradients all-reduced over TP once per iteration (finalize_model_grads): 2 norms x 4
    # layers + final norm, fp32
    ln = rows(t, tensor="grad.layernorm", group=0)
    assert len(ln) == 1 and ln[0]["bytes_global"] == (2 * 4 + 1) * H * 4


# ---------------------------------------------------------------------------------------------
# PP
# ---------------------------------------------------------------------------------------------

def test_pipeline_orders():
    """Megatron-LM ``schedules.py``: 1F1B warm-up of pp - rank - 1 forwards; interleaved warm-up
    (pp - rank - 1) * 2 + (v - 1) * pp with chunk (k // pp) % v."""
    assert stage_order("1f1b", 4, 0, 8)[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0),
                                                 ("B", 0, 0), ("F", 4, 0)]
    assert stage_order("1f1b", 4, 3, 8)[:4] == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    inter = stage_order("interleaved", 4, 0, 8, 2)
    assert inter[:10] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("F", 0, 1), ("F", 1, 1),
                          ("F", 2, 1), ("F", 3, 1), ("F", 4, 0), ("F", 5, 0)]
    # warm-up is (4 - 0 - 1) * 2 + (2 - 1) * 4 = 10 forwards, then one forward, one backward
    assert inter[10:14] == [("F", 6, 0), ("B", 0, 1), ("F", 7, 0), ("B", 1, 1)]
    g = stage_order("gpipe", 2, 1, 3)
    assert g == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("B", 1, 0), ("B", 2, 0)]


@pytest.mark.parametrize("sched,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
def test_pipeline_bubble_matches_published_formula(sched, v):
    """Narayanan et al. 2021 (sec. 2.2): with forward t_f and backward t_b per micro-batch and stage,
    GPipe and 1F1B take (m + p - 1)(t_f + t_b); the interleaved schedule with v chunks
    (m + (p - 1)/v)(t_f + t_b)."""
    p, m, tf, tb = 4, 8, 3.0, 6.0
    order = [stage_order(sched, p, s, m, v) for s in range(p)]
    tl = simulate(order, p, v, lambda s, k, c: (tf if k == "F" else tb) / v, 0.0)
    assert tl.makespan == pytest.approx((m + (p - 1) / v) * (tf + tb))


@pytest.mark.parametrize("sched,v,boundaries", [("1f1b", 1, 3), ("gpipe", 1, 3), ("interleaved", 2, 7)])
def test_pp_send_recv_counts(sched, v, boundaries):
    """Megatron-LM ``p2p_communication.py``: every TP rank sends b x s x h to its peer in the next
    (virtual) stage per micro-batch forward and the gradient back: 2 x boundaries x m x (tp dp)
    sends per iteration; interleaving adds the chunk wrap-around boundaries (p v - 1 in all)."""
    plan = mkplan({"tp": 1, "pp": 4, "dp": 2, "pp_schedule": sched, "virtual_stages": v},
                  model=dict(SMALL, num_hidden_layers=8), training={"global_batch_size": 16})
    t = build_collectives(plan)
    m = plan.num_microbatches
    sends = rows(t, op="send_recv")
    assert len(sends) == 2 * boundaries * m * 2
    assert all(r["bytes_global"] == r["bytes_per_rank"] == ACT and r["group_size"] == 2 for r in sends)
    assert all(r["ranks"] == [r["src"], r["dst"]] for r in sends)
    fwd = [r for r in sends if r["tensor"] == "pp.activation"]
    assert {(r["src"], r["dst"]) for r in fwd if r["stage"] == 0} == {(0, 2), (1, 3)}
    if v > 1:
        assert {(r["src"], r["dst"]) for r in fwd if r["stage"] == 3} == {(6, 0), (7, 1)}
    # every micro-batch leaves stage 0 once per chunk, in micro-batch order in time
    s0 = sorted((r["t_ready_ns"], r["microbatch"]) for r in fwd if r["src"] == 0)
    assert len(s0) == m * v


def test_tied_embedding_gradient_all_reduce():
    """Megatron-LM ``_allreduce_word_embedding_grads`` (finalize_model_grads.py): with tied
    embeddings and pp > 1 the first and last stage all-reduce the embedding gradient (their
    vocabulary shard, vocab/tp x h) over the embedding group [first, last] of each pipeline group."""
    plan = mkplan({"tp": 2, "pp": 2, "dp": 2}, model=dict(SMALL, tie_word_embeddings=True))
    t = build_collectives(plan)
    emb = rows(t, tensor="grad.embed_tokens.tied")
    assert len(emb) == 4
    assert sorted(tuple(r["ranks"]) for r in emb) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert {r["bytes_global"] for r in emb} == {1024 // 2 * H * 4}
    assert not rows(build_collectives(mkplan({"tp": 2, "pp": 2, "dp": 2})), tensor="grad.embed_tokens.tied")


# ---------------------------------------------------------------------------------------------
# DP and ZeRO
# ---------------------------------------------------------------------------------------------

# Reverse registration order of SMALL with 2 layers (fp32 gradient bytes): lm_head 1,048,576,
# final norm 1,024, then per layer down/up/gate 1,048,576 each, post-attention norm 1,024, o/v/k/q
# 262,144 each, input norm 1,024, and last the embedding 1,048,576. With a 1 MiB cap and "close
# when >= cap": [lm_head] [norm, down1] [up1] [gate1] [post1, o1, v1, k1, q1] [in1, down0] [up0]
# [gate0] [post0, o0, v0, k0, q0] [in0, embed].
MIB = 1048576
DDP_BUCKETS = [MIB, 1024 + MIB, MIB, MIB, 1024 + 4 * 262144, 1024 + MIB, MIB, MIB, 1024 + 4 * 262144, 1024 + MIB]
TWO_LAYERS = dict(SMALL, num_hidden_layers=2)


def test_ddp_buckets_reverse_order_close_when_full():
    """PyTorch DDP (``torch/csrc/distributed/c10d/reducer.cpp``
    ``compute_bucket_assignment_by_size``, parameters reversed by ``distributed.py``): a tensor is
    appended to the open bucket, which closes once its size reaches the cap; tensors are never
    split. One all-reduce per bucket in the gradient dtype, in backward, on the last micro-batch
    only (``no_sync`` for the others), on each DP group."""
    plan = mkplan({"dp": 8}, model=TWO_LAYERS, training={"dp_bucket_bytes": "1MiB", "global_batch_size": 16})
    t = build_collectives(plan)
    dp = rows(t, parallelism="dp")
    assert [r["bytes_global"] for r in sorted(dp, key=lambda r: int(r["tensor"][len("grad.bucket"):]))] == DDP_BUCKETS
    assert all(r["op"] == "all_reduce" and r["dtype"] == "fp32" and r["phase"] == "backward"
               and r["ranks"] == list(range(8)) for r in dp)
    assert sum(DDP_BUCKETS) == 4 * (2 * 1024 * 256 + 2 * (4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256) + 256)
    ready = [r["t_ready_ns"] for r in sorted(dp, key=lambda r: int(r["tensor"][len("grad.bucket"):]))]
    assert ready == sorted(ready) and ready[-1] > ready[0]


def test_ddp_first_bucket_cap():
    """``Reducer::rebuild_buckets`` caps the first bucket (in gradient-ready order) at
    ``first_bucket_bytes_cap`` (1 MiB, ``dist._DEFAULT_FIRST_BUCKET_BYTES``), the rest at
    ``bucket_cap_mb``. With a 2 MiB cap: [lm_head] then 2 MiB buckets; without the small first cap
    the lm_head shares the first bucket."""
    def sizes(**tr):
        t = build_collectives(mkplan({"dp": 8}, model=TWO_LAYERS, training=dict(tr, global_batch_size=16)))
        dp = rows(t, parallelism="dp")
        return [r["bytes_global"] for r in sorted(dp, key=lambda r: int(r["tensor"][len("grad.bucket"):]))]

    two = 2 * MIB + 1024
    assert sizes(dp_bucket_bytes="2MiB") == [MIB, two, two, two, two, 1024 + MIB]
    assert sizes(dp_bucket_bytes="2MiB", dp_first_bucket_bytes="2MiB") == [
        two, 2 * MIB, 2 * MIB + 2048, 2 * MIB, 2 * MIB + 2048]


def test_distributed_optimizer_reduce_scatter_and_all_gather():
    """Megatron-LM distributed optimizer (``zero: 1``/``2``; ``param_and_grad_buffer.py``): each
    bucket's gradients are reduce-scattered in grad_dtype (each rank receives 1/dp) and, after the
    optimizer step, the updated parameters all-gathered in param_dtype (each rank sends 1/dp)."""
    for zero in (1, 2):
        t = build_collectives(mkplan({"dp": 8, "zero": zero}, model=TWO_LAYERS, training={"dp_bucket_bytes": "1MiB", "global_batch_size": 16}))
        rs = rows(t, op="reduce_scatter")
        ag = rows(t, op="all_gather")
        assert sorted(r["bytes_global"] for r in rs) == sorted(DDP_BUCKETS)
        assert all(r["bytes_per_rank"] * 8 == r["bytes_global"] and r["dtype"] == "fp32" for r in rs)
        assert sorted(r["bytes_global"] for r in ag) == sorted(b // 2 for b in DDP_BUCKETS)
        assert all(r["phase"] == "optimizer" and r["dtype"] == "bf16" for r in ag)
        assert min(r["t_ready_ns"] for r in ag) >= max(r["t_ready_ns"] for r in rs)
        assert not rows(t, op="all_reduce", parallelism="dp")


def test_distributed_optimizer_bucket_padding():
    """Megatron-LM ``param_and_grad_buffer.py``: parameters start at multiples of 64 elements, the
    bucket ends at a multiple of lcm(dp, 128)."""
    from wiretrace.workload.schedule import distributed_optimizer_bucket_numel as f

    assert f([100, 1000], 8) == 1152            # 100 -> 128 + 1000 = 1128 -> 9 x 128
    assert f([10, 10], 6) == 384                # 10 -> 64 + 10 = 74 -> lcm(6, 128) = 384
    assert f([262144], 8) == 262144
    t = build_collectives(mkplan({"dp": 6, "zero": 1}, model=dict(TWO_LAYERS, hidden_size=96, intermediate_size=200,
                                                                 num_attention_heads=4, num_key_value_heads=4),
                                 training={"global_batch_size": 12, "dp_bucket_bytes": "4MiB"}, nodes=1, gpus=6))
    rs = rows(t, op="reduce_scatter")
    assert all(r["bytes_global"] % (4 * 384) == 0 and r["bytes_per_rank"] * 6 == r["bytes_global"] for r in rs)
    # everything fits one 4 MiB bucket: 2 layers + norm + embedding + output layer, each aligned to 64
    numels = [1024 * 96, 96] + [96 * 200, 200 * 96, 200 * 96, 96, 96 * 96, 96 * 96, 96 * 96, 96 * 96, 96] * 2 + [1024 * 96]
    assert sum(r["bytes_global"] for r in rs) == 4 * f(numels, 6)


def test_zero3_per_tensor_all_gather_sizes_equal_parameter_shapes():
    """DeepSpeed ZeRO-3 (``partitioned_param_coordinator.py``) gathers parameter by parameter: every
    all-gather moves one tensor (its element count x param bytes) before the forward and again
    before the backward of its layer, every micro-batch; gradients are reduce-scattered per tensor
    after the backward (Rajbhandari et al. 2020, sec. 5.3: 1.5x the DDP volume per step).
    Parameters under ``stage3_param_persistence_threshold`` (1e5 elements: the norms here) are
    never gathered."""
    model = dict(TWO_LAYERS, hidden_size=512)
    plan = mkplan({"dp": 8, "zero": 3, "zero3_granularity": "tensor"}, model=model, training={"global_batch_size": 16})
    t = build_collectives(plan)
    m = plan.num_microbatches
    shapes = {"self_attn.q_proj.weight": 512 * 512, "self_attn.k_proj.weight": 512 * 512,
              "self_attn.v_proj.weight": 512 * 512, "self_attn.o_proj.weight": 512 * 512,
              "mlp.gate_proj.weight": 1024 * 512, "mlp.up_proj.weight": 1024 * 512,
              "mlp.down_proj.weight": 512 * 1024, "input_layernorm.weight": 512,
              "post_attention_layernorm.weight": 512}
    ag = rows(t, op="all_gather")
    for layer in (0, 1):
        for name, numel in shapes.items():
            got = [r for r in ag if r["tensor"] == f"param.layers.{layer}.{name}"]
            rs = rows(t, op="reduce_scatter", tensor=f"grad.layers.{layer}.{name}")
            assert len(rs) == m and rs[0]["bytes_global"] == numel * 4
            if numel < 100_000:
                assert not got, name
                continue
            assert len(got) == 2 * m, name
            assert {r["bytes_global"] for r in got} == {numel * 2}
            assert {r["bytes_per_rank"] for r in got} == {numel * 2 // 8}
    emb = [r for r in ag if r["tensor"] == "param.embed_tokens.weight"]
    assert {r["bytes_global"] for r in emb} == {1024 * 512 * 2}


def test_zero3_layer_granularity():
    """PyTorch FSDP FULL_SHARD with one unit per transformer layer: one all-gather of the layer's
    flat parameter forward and one backward, one reduce-scatter of its gradient, per micro-batch."""
    plan = mkplan({"dp": 8, "zero": 3}, model=TWO_LAYERS, training={"global_batch_size": 16})
    t = build_collectives(plan)
    m = plan.num_microbatches
    layer_numel = 4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256
    ag = rows(t, op="all_gather", tensor="param.layers.1")
    assert len(ag) == 2 * m and {r["bytes_global"] for r in ag} == {layer_numel * 2}
    rs = rows(t, op="reduce_scatter", tensor="grad.layers.1")
    assert len(rs) == m and {r["bytes_global"] for r in rs} == {layer_numel * 4}
    # the root unit (final norm + output layer) stays gathered from forward to backward
    head = rows(t, op="all_gather", tensor="param.head")
    assert len(head) == m and {r["phase"] for r in head} == {"forward"}


# ---------------------------------------------------------------------------------------------
# CP and EP
# ---------------------------------------------------------------------------------------------

def test_cp_ring_attention_kv_blocks():
    """Ring attention (Liu et al. 2023; TransformerEngine ``AttnFuncWithCPAndKVP2P`` used by
    Megatron-LM ``cp_comm_type: p2p``): each rank keeps s/cp tokens and passes its K/V block
    (2 x b x s/cp x kv_heads/tp x head_dim) to the next rank of the CP ring, cp - 1 times per layer
    forward; backward passes K/V cp - 1 times and the dK/dV accumulators cp times."""
    cp, tp = 4, 2
    plan = mkplan({"tp": tp, "cp": cp}, training={"global_batch_size": 2})
    t = build_collectives(plan)
    kvb = 2 * B * (S // cp) * (8 // tp) * 32 * 2
    ring = rows(t, parallelism="cp")
    assert {r["bytes_global"] for r in ring} == {kvb}
    g0 = [r for r in ring if r["group"] == rows(t, parallelism="cp")[0]["group"]]
    assert {(r["src"], r["dst"]) for r in g0} == {(0, 2), (2, 4), (4, 6), (6, 0)}
    c = collections.Counter((r["phase"], r["tensor"]) for r in g0 if r["layer"] == 0)
    assert c[("forward", "attn.kv")] == (cp - 1) * cp
    assert c[("backward", "attn.kv")] == (cp - 1) * cp and c[("backward", "attn.dkv")] == cp * cp
    # TP activations hold s/cp tokens
    assert {r["bytes_global"] for r in rows(t, tensor="attn.out_proj.activation")} == {ACT // cp}


def test_cp_all_gather_variant():
    """TransformerEngine ``AttnFuncWithCPAndKVAllGather``: K/V all-gathered per layer forward and
    again in backward, dK/dV reduce-scattered."""
    plan = mkplan({"tp": 2, "cp": 4, "cp_algorithm": "all_gather"}, training={"global_batch_size": 2})
    t = build_collectives(plan)
    kvb = 2 * B * (S // 4) * 4 * 32 * 2
    ag = rows(t, parallelism="cp", op="all_gather", layer=0, group=rows(t, parallelism="cp")[0]["group"])
    assert len(ag) == 2 and {(r["bytes_global"], r["bytes_per_rank"]) for r in ag} == {(4 * kvb, kvb)}
    rs = rows(t, parallelism="cp", op="reduce_scatter", layer=0)
    assert len(rs) == 2 and rs[0]["tensor"] == "attn.dkv"


MOE = dict(SMALL, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=512)


def test_ep_all_to_all_sizes_and_counts():
    """Megatron-LM all-to-all token dispatcher (``moe/token_dispatcher.py``): per MoE layer and
    micro-batch, dispatch and combine forward and their gradients backward (4 all-to-alls); each rank
    sends tokens x top-k x h elements; with a capacity factor c each expert receives
    ceil(c x tokens x top-k / E) slots (padded to capacity)."""
    plan = mkplan({"dp": 4, "ep": 4}, model=MOE, nodes=1, gpus=4)
    t = build_collectives(plan)
    m = plan.num_microbatches
    a2a = rows(t, op="all_to_all")
    tokens = B * S
    assert {r["bytes_per_rank"] for r in a2a} == {tokens * 2 * H * 2}
    assert {r["bytes_global"] for r in a2a} == {4 * tokens * 2 * H * 2}
    assert len(a2a) == 4 * 4 * m
    assert collections.Counter(r["tensor"] for r in a2a) == {
        "moe.dispatch": 4 * m, "moe.combine": 4 * m, "moe.combine_grad": 4 * m, "moe.dispatch_grad": 4 * m}
    plan = mkplan({"dp": 4, "ep": 4}, model=dict(MOE, capacity_factor=1.25), nodes=1, gpus=4)
    cap = -(-int(1.25 * tokens * 2) // 4)
    assert {r["bytes_per_rank"] for r in rows(build_collectives(plan), op="all_to_all")} == {cap * 4 * H * 2}


def test_expert_gradients_reduced_over_expert_data_parallel_group():
    """Megatron-LM reduces expert gradients over the expert data-parallel group (dp*cp/ep ranks),
    dense gradients over the whole dp-cp group."""
    plan = mkplan({"dp": 4, "ep": 2}, model=MOE, nodes=1, gpus=4)
    t = build_collectives(plan)
    exp = [r for r in rows(t, parallelism="dp") if "expert_bucket" in r["tensor"]]
    dense = [r for r in rows(t, parallelism="dp") if "expert_bucket" not in r["tensor"]]
    assert {tuple(r["ranks"]) for r in exp} == {(0, 2), (1, 3)}
    assert {tuple(r["ranks"]) for r in dense} == {(0, 1, 2, 3)}
    # two local experts of 3 x 512 x 256 per MoE layer, 4 layers, fp32
    per_group = sum(r["bytes_global"] for r in exp if r["ranks"] == [0, 2])
    assert per_group == 4 * 2 * 3 * 512 * 256 * 4


# ---------------------------------------------------------------------------------------------
# recompute, table, compute model
# ---------------------------------------------------------------------------------------------

def test_full_recompute_repeats_forward_tp_collectives_in_backward():
    """Megatron-LM ``--recompute-granularity full`` (``tensor_parallel/random.py``
    CheckpointFunction) re-runs each layer's forward, with its TP all-reduces, before its backward."""
    base = build_collectives(mkplan({"tp": 4, "dp": 2}))
    full = build_collectives(mkplan({"tp": 4, "dp": 2}, training={"recompute": "full"}))
    sel = build_collectives(mkplan({"tp": 4, "dp": 2}, training={"recompute": "selective"}))
    fwd = count(base, tensor="attn.out_proj.activation")
    assert count(full, tensor="recompute.attn.out_proj.activation", phase="backward") == fwd
    assert count(full, tensor="recompute.mlp.down_proj.activation", phase="backward") == fwd
    assert full.num_rows == base.num_rows + 2 * fwd
    assert sel.num_rows == base.num_rows


def test_table_schema_order_and_determinism():
    plan = mkplan({"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True},
                  collectives={"algorithm": {"all_reduce": "tree", "default": "auto"}})
    a = build_collectives(plan)
    b = build_collectives(plan)
    check("collectives", a)
    assert a.equals(b)
    d = a.to_pydict()
    assert d["op_id"] == list(range(a.num_rows))
    assert d["t_ready_ns"] == sorted(d["t_ready_ns"])
    alg = dict(zip(d["op"], d["algorithm"]))
    assert alg == {"all_reduce": "tree", "all_gather": "auto", "reduce_scatter": "auto", "send_recv": "direct"}
    assert set(d["source"]) == {"analytical"}
    assert all(len(r) == n for r, n in zip(d["ranks"], d["group_size"]))


def test_iteration_flops_match_narayanan_formula():
    """Narayanan et al. 2021, eq. (3) without recomputation: F = 72 B s l h^2 (1 + s/(6h) +
    V/(12 l h)) for a GPT model (GELU MLP of 4h, multi-head attention, full attention matrix)."""
    from wiretrace.models import resolve
    m = resolve({"preset": "gpt3-175b"})
    Bg, s, l, h, V = 1536, 2048, 96, 12288, 50257
    want = 72 * Bg * s * l * h ** 2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert iteration_flops(m, 1, s, Bg, causal=False) == pytest.approx(want, rel=1e-12)
    # with full recomputation: 96 instead of 72 for the layers (the paper's eq. 3 with recompute)
    want_rc = 96 * Bg * s * l * h ** 2 * (1 + s / (6 * h)) + 6 * Bg * s * h * V
    assert iteration_flops(m, 1, s, Bg, "full", causal=False) == pytest.approx(want_rc, rel=1e-12)


def test_single_gpu_iteration_is_pure_compute():
    """One GPU, no parallelism: the estimate is FLOPs / (peak x mfu), no bubble, no communication."""
    plan = mkplan({}, nodes=1, gpus=1, training={"global_batch_size": 4})
    e = iteration_estimate(plan)
    flops = iteration_flops(plan.model, B, S, 2)
    assert e["bubble_ns"] == 0 and e["exposed_comm_ns"] == 0
    assert e["total_ns"] == pytest.approx(flops / (989e12 * 0.4) * 1e9, rel=1e-6)
    assert build_collectives(plan).num_rows == 0


def test_estimate_pipeline_bubble_and_exposed_dp():
    """With pp 4 and m micro-batches the bubble is about (p - 1)/m of the compute (Narayanan et al.
    2021 sec. 2.2.1); DP gradient all-reduces across nodes expose the part that outlasts backward."""
    big = dict(SMALL, num_hidden_layers=8, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
               num_key_value_heads=16)
    plan = mkplan({"pp": 4, "dp": 2}, model=big, nodes=2, gpus=4,
                  training={"global_batch_size": 32, "seq_length": 2048})
    e = iteration_estimate(plan)
    m = plan.num_microbatches
    assert e["bubble_ns"] / e["compute_ns"] == pytest.approx(3 / m, rel=0.35)
    assert e["total_ns"] == e["compute_ns"] + e["bubble_ns"] + e["exposed_comm_ns"]
    assert e["exposed_comm_ns"] > 0
    assert len(e["stages"]) == 4


def test_uneven_pipeline_layers_from_plan():
    """Megatron-LM ``decoder_first_pipeline_num_layers``/``decoder_last_pipeline_num_layers``: the
    first and last stage hold 1 layer, the two middle stages 3 each (8 layers on pp 4)."""
    plan = mkplan({"pp": 4, "decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 1},
                  model=dict(SMALL, num_hidden_layers=8), gpus=4)
    t = build_collectives(plan)
    assert t.num_rows > 0
    with pytest.raises(Exception, match="not divisible"):
        mkplan({"pp": 4, "decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 2},
               model=dict(SMALL, num_hidden_layers=8), gpus=4)


def test_ep_with_tp_and_sequence_parallel():
    """Megatron-LM ``MoEAlltoAllTokenDispatcher`` with tp > 1 (sequence parallel): the all-to-all
    moves this rank's s/tp tokens, then the received tokens are all-gathered over TP
    (``gather_from_sequence_parallel_region``) and reduce-scattered before the combine
    (``reduce_scatter_to_sequence_parallel_region``); the MoE MLP has no other TP collective."""
    plan = mkplan({"tp": 2, "dp": 4, "ep": 4, "sequence_parallel": True}, model=MOE)
    t = build_collectives(plan)
    m = plan.num_microbatches
    tokens = B * S // 2
    a2a = tokens * 2 * H * 2
    assert {r["bytes_per_rank"] for r in rows(t, op="all_to_all")} == {a2a}
    g0 = [r for r in rows(t, group=0) if r["layer"] == 0 and r["phase"] == "forward"]
    assert [(r["op"], r["tensor"]) for r in g0 if r["microbatch"] == 0] == [
        ("all_gather", "attn.qkv_proj.input"), ("reduce_scatter", "attn.out_proj.activation"),
        ("all_gather", "moe.dispatch.tp_gather"), ("reduce_scatter", "moe.combine.tp_scatter")]
    gath = rows(t, tensor="moe.dispatch.tp_gather")
    assert {(r["bytes_global"], r["bytes_per_rank"]) for r in gath} == {(2 * a2a, a2a)}
    assert len(gath) == 4 * m * 4          # 4 MoE layers, m micro-batches, 4 TP groups
    assert not rows(t, tensor="mlp.down_proj.activation")


def test_comm_time_model():
    """Ring time = latency x steps + S x busbw factor / rate (nccl-tests PERFORMANCE.md: busbw =
    algbw x 2(n-1)/n for all_reduce): 1 GB over 8 ranks at 400 Gb/s, 2 us per hop ->
    14 x 2 us + 1e9 x 1.75 x 8 / 400e9 s. An all_to_all's table size is all ranks' inputs; each rank
    sends (n-1)/n of its own."""
    from wiretrace.workload import Workload
    from wiretrace.workload.compute import comm_ns

    assert comm_ns("all_reduce", 1e9, 8, 400e9, 2000) == pytest.approx(28_000 + 35_000_000)
    assert comm_ns("send_recv", 1e6, 2, 400e9, 2000) == pytest.approx(2000 + 20_000)
    assert comm_ns("all_gather", 1e6, 1, 400e9, 2000) == 0
    w = Workload(mkplan({"dp": 4, "ep": 4}, model=MOE, nodes=2, gpus=2))
    rate, lat = w.link("ep")
    assert (rate, lat) == (400e9, 2000)
    assert w.comm("ep", "all_to_all", 4e6, 4) == pytest.approx(2000 + 1e6 * 0.75 * 8 / 400e9 * 1e9)
    assert w.link("tp") == (450e9 * 8, 1000)       # "900GB/s" counts both directions


@pytest.mark.parametrize("sched,zero,sp,cp_alg,recompute", [
    ("1f1b", 0, False, "ring", "none"), ("gpipe", 1, True, "ring", "full"),
    ("interleaved", 2, True, "all_gather", "selective"), ("interleaved", 3, False, "ring", "full"),
    ("1f1b", 3, True, "all_gather", "none"),
])
def test_invariants_across_combinations(sched, zero, sp, cp_alg, recompute):
    """Every combination builds a valid table: sizes follow the nccl-tests conventions
    (reduce_scatter/all_gather: S = n x per-rank count; all_to_all: S = n x each rank's input;
    all_reduce and send_recv: S = per-rank), ranks match group_size, src/dst only on send_recv,
    and each communicator's ranks are the same on all its rows."""
    plan = mkplan({"tp": 2, "pp": 2, "dp": 2, "cp": 2, "ep": 2, "pp_schedule": sched,
                   "virtual_stages": 2 if sched == "interleaved" else 1,
                   "zero": zero, "sequence_parallel": sp, "cp_algorithm": cp_alg},
                  model=dict(MOE, num_hidden_layers=4, moe_layer_freq=2),
                  training={"global_batch_size": 8, "recompute": recompute}, nodes=2, gpus=8)
    t = build_collectives(plan)
    check("collectives", t)
    d = t.to_pydict()
    members: dict[int, set] = {}
    for i in range(t.num_rows):
        op, n, S, per = d["op"][i], d["group_size"][i], d["bytes_global"][i], d["bytes_per_rank"][i]
        assert len(d["ranks"][i]) == n and len(set(d["ranks"][i])) == n
        if op in ("reduce_scatter", "all_gather", "all_to_all"):
            assert S == n * per, (op, d["tensor"][i])
        else:
            assert S == per
        if op == "send_recv":
            assert d["ranks"][i] == [d["src"][i], d["dst"][i]] and n == 2
        else:
            assert d["src"][i] == d["dst"][i] == -1
            members.setdefault(d["group"][i], set()).add(tuple(d["ranks"][i]))
    assert all(len(v) == 1 for v in members.values())
    assert {"tp", "pp", "dp", "cp", "ep"} <= set(d["parallelism"]) | ({"tp"} if sp else set())
    e = iteration_estimate(plan)
    assert e["total_ns"] >= e["compute_ns"] > 0


def test_mfu_leaves_recomputation_out():
    """MFU counts model FLOPs only (PaLM, Chowdhery et al. 2022, appendix B); full recompute adds
    one more forward of every layer (hardware FLOPs, HFU), not of the output layer."""
    from conftest import SAMPLES
    import json

    base = json.loads((SAMPLES / "gpt2-small-2x4.json").read_text())
    full = json.loads(json.dumps(base))
    full["training"]["recompute"] = "full"
    e0 = iteration_estimate(P.from_dict(base))
    e1 = iteration_estimate(P.from_dict(full))
    m = P.from_dict(base).model
    head_fwd = 2.0 * 4 * 1024 * m.hidden_size * m.vocab_size * (16 // 4)   # b s h V per micro-batch
    assert e1["model_flops"] == e0["model_flops"]
    assert e1["hardware_flops"] == pytest.approx(e0["model_flops"] + (e0["model_flops"] / 3 - head_fwd))
    assert e1["achieved_hfu"] > e1["achieved_mfu"]
