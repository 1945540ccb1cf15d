"""The compute model: FLOPs per layer and micro-batch, GPU time, and communication time estimates.

FLOPs count 2 per multiply-accumulate of every matrix multiplication (Kaplan et al. 2020; Narayanan
et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
sec. 5.1). Per layer and micro-batch of ``b`` sequences of ``s`` tokens, hidden ``h``, KV width
``kv`` (GQA), MLP width ``f``:

* attention projections: ``2 b s h (2h + 2kv)`` (Q and O are h x h, K and V are kv x h);
* attention core: ``2 b s^2 h`` for Q K^T plus ``2 b s^2 h`` for scores x V, halved for a causal
  mask (FlashAttention skips fully masked blocks; Megatron-LM's ``num_floating_point_operations``
  in ``megatron/training/training.py`` applies the same causal factor);
* MLP: ``2 b s h f`` per matrix, three matrices for SwiGLU, two for GELU; an MoE layer adds the
  router (``2 b s h E``) and runs top-k experts (plus shared experts) per token;
* output layer: ``2 b s h V``.

Backward is twice the forward (gradients with respect to inputs and to weights); full activation
recomputation adds one forward, selective recomputation (Korthikanti et al. 2022) adds the attention
core. A GPU's share is the layer's FLOPs divided by tp x cp, its time FLOPs / (peak x mfu).

With ``causal=False``, no recompute and no GQA, the total per iteration is Narayanan et al.'s
eq. (3) without recomputation: ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` for a GELU MLP of 4h.
"""

from __future__ import annotations

from ..models import ModelConfig
from ..plan import DTYPE_BYTES, Plan

#: nccl-tests bus-bandwidth factors (``nccl-tests/doc/PERFORMANCE.md``): the bytes each rank puts on
#: its busiest link, per byte of the size ``S``, for ring algorithms over ``n`` ranks.
BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_allv": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}

#: Latency steps of a ring over n ranks (one link latency per step).
_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
          "reduce_scatter": lambda n: n - 1, "all_to_all": lambda n: 1, "all_to_allv": lambda n: 1,
          "broadcast": lambda n: n - 1, "reduce": lambda n: n - 1, "send_recv": lambda n: 1}


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests busbw factor of ``op`` over ``n`` ranks (1 for n = 1 send/recv, 0 for other n = 1)."""
    if n <= 1 and op != "send_recv":
        return 0.0
    return BUSBW_FACTOR[op](n)


def layer_flops(m: ModelConfig, b: int, s: int, layer: int, causal: bool = True) -> dict[str, float]:
    """Forward FLOPs of transformer layer ``layer`` for one micro-batch (whole layer, all ranks).

    Returns ``{"attn_proj", "attn_core", "mlp"}`` in FLOPs.
    """
    h, q, kv = m.hidden_size, m.q_size, m.kv_size
    tokens = b * s
    attn_proj = 2.0 * tokens * h * (2 * q + 2 * kv)
    attn_core = 4.0 * b * s * s * q * (0.5 if causal else 1.0)
    nmat = 3 if m.gated_mlp else 2
    if m.is_moe_layer(layer):
        f = m.moe_intermediate_size or m.intermediate_size
        mlp = 2.0 * tokens * h * m.num_local_experts            # router
        mlp += 2.0 * tokens * h * f * nmat * (m.num_experts_per_tok + m.num_shared_experts)
    else:
        mlp = 2.0 * tokens * h * m.intermediate_size * nmat
    return {"attn_proj": attn_proj, "attn_core": attn_core, "mlp": mlp}


def head_flops(m: ModelConfig, b: int, s: int) -> float:
    """Forward FLOPs of the output layer (logits) for one micro-batch."""
    return 2.0 * b * s * m.hidden_size * m.vocab_size


def iteration_flops(m: ModelConfig, b: int, s: int, microbatches_total: int, recompute: str = "none",
                    causal: bool = True) -> float:
    """Model FLOPs of one iteration over all ranks (forward + backward (+ recompute)).

    ``microbatches_total`` is the global number of micro-batches (global batch / micro-batch).
    """
    fwd = head_flops(m, b, s)
    extra = 0.0
    for i in range(m.num_hidden_layers):
        f = layer_flops(m, b, s, i, causal)
        fwd += f["attn_proj"] + f["attn_core"] + f["mlp"]
        if recompute == "full":
            extra += f["attn_proj"] + f["attn_core"] + f["mlp"]
        elif recompute == "selective":
            extra += f["attn_core"]
    return microbatches_total * (3.0 * fwd + extra)


def gpu_flops_per_ns(plan: Plan) -> float:
    """Achieved FLOPs per ns of one GPU: ``peak_tflops * 1e12 * mfu / 1e9``."""
    return plan.cluster.peak_tflops * 1e3 * plan.training.mfu


def comm_ns(op: str, bytes_global: float, n: int, rate_bps: float, latency_ns: float) -> float:
    """Time of one collective on a ring: ``latency x steps + S x busbw factor / link rate``.

    Parameters
    ----------
    op : collective name (see :data:`BUSBW_FACTOR`).
    bytes_global : nccl-tests size ``S`` in bytes (for all_to_all: one rank's whole send buffer).
    n : ranks in the communicator.
    rate_bps : per-rank link rate in bits/s (NVLink inside a node, the NIC rate across nodes).
    latency_ns : per-hop latency in ns.
    """
    if n <= 1 and op != "send_recv":
        return 0.0
    return latency_ns * _STEPS[op](n) + bytes_global * busbw_factor(op, n) * 8.0 / rate_bps * 1e9


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[name]
