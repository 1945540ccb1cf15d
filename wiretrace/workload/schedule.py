"""The analytical collective schedule of one training iteration.

:func:`build_collectives` turns a plan into the collectives table (``schemas/collectives.schema.json``):
one row per collective call per communicator. The schedule of each pipeline stage is computed once
as a *template* (what is exchanged, how big, when) and replicated over every communicator of that
stage with NumPy, so a 16,384-GPU plan costs no more Python work than a 16-GPU one.

What each parallelism exchanges (sources in the function docstrings):

* **TP** (Megatron-LM ``megatron/core/tensor_parallel/mappings.py``, ``layers.py``): per layer and
  micro-batch an all-reduce of ``b s h`` activations after the attention output projection and after
  the MLP down projection (forward), and of the input gradients of the QKV and MLP up projections
  (backward); the vocabulary-parallel embedding all-reduces its output; the vocabulary-parallel
  cross entropy all-reduces the logit maximum, the target logits and the sum of exponentials
  (``b s`` fp32 each, ``cross_entropy.py``); the output layer all-reduces its input gradient.
* **SP** (Korthikanti et al. 2022; ``mappings.py`` ``_gather_along_first_dim`` /
  ``_reduce_scatter_along_first_dim``): each all-reduce becomes a reduce-scatter (after row-parallel
  layers) or an all-gather (before column-parallel layers); backward mirrors them and all-gathers the
  column-parallel input once more to compute the weight gradient
  (``LinearWithGradAccumulationAndAsyncCommunication.backward``); norm gradients are all-reduced over
  TP after backward (``finalize_model_grads``).
* **PP** (``megatron/core/pipeline_parallel/p2p_communication.py``): each TP rank sends ``b s h``
  (``b s h / tp`` with SP) to its peer of the next stage per micro-batch forward, and the gradient
  back; with tied embeddings the first and last stage all-reduce the embedding gradient
  (``_allreduce_word_embedding_grads``).
* **DP** ``zero: 0``: PyTorch DDP (``torch/nn/parallel/distributed.py``, ``reducer.cpp``): gradient
  buckets of ``dp_bucket_bytes`` (the first one ``dp_first_bucket_bytes``, 1 MiB) filled in reverse
  registration order, a bucket closing when full,
  all-reduced in ``grad_dtype`` as soon as its last gradient is produced in the backward pass of
  the last micro-batch. ``zero: 1|2``: Megatron-LM distributed optimizer
  (``megatron/core/distributed/param_and_grad_buffer.py``, ``distrib_optimizer.py``): the same
  buckets reduce-scattered in ``grad_dtype`` (padded to a multiple of the DP size), parameters
  all-gathered in ``param_dtype`` after the optimizer step (buckets padded as Megatron-LM pads them,
  :func:`distributed_optimizer_bucket_numel`). ``zero: 3``: PyTorch FSDP FULL_SHARD
  (``torch/distributed/fsdp``; one flat parameter per wrapped layer) or DeepSpeed ZeRO-3
  (``deepspeed/runtime/zero/partitioned_param_coordinator.py``; parameter by parameter, parameters
  under ``stage3_param_persistence_threshold`` = 1e5 elements kept whole): all-gather before each
  layer's forward and again before its backward (FSDP keeps the root unit — embeddings, final norm,
  output layer — gathered between forward and backward), gradient reduce-scatter after its
  backward, every micro-batch. The DP communicator is Megatron's ``dp-cp`` group.
* **CP** ring attention (TransformerEngine ``AttnFuncWithCPAndKVP2P``): per layer and micro-batch,
  ``cp - 1`` forward steps in which each rank sends its current K/V block to the next rank of the CP
  ring; backward ``cp - 1`` K/V steps and ``cp`` dK/dV steps. ``cp_algorithm: all_gather``
  (``AttnFuncWithCPAndKVAllGather``): all-gather of K/V forward, again backward, reduce-scatter of
  dK/dV.
* **EP** (``megatron/core/transformer/moe/token_dispatcher.py``, all-to-all dispatcher): per MoE layer
  and micro-batch an all-to-all dispatch and combine forward and both again backward, each rank
  sending ``tokens x top-k x h`` elements (padded to ``capacity_factor`` x the even share per expert);
  with TP (and SP, which Megatron-LM requires for MoE with TP) the dispatcher all-gathers the
  received tokens over TP and reduce-scatters them before the combine, in place of the MLP's own
  all-gather / reduce-scatter. Expert gradients are reduced over the expert data-parallel group.
* **Recompute** ``full`` replays each layer's forward collectives at the start of its backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..errors import PlanError
from ..models import ParamTensor, padded_vocab_size, param_tensors, stage_layers
from ..plan import DTYPE_BYTES, Plan
from ..tables import to_arrow
from .compute import comm_ns, gpu_flops_per_ns, head_flops, layer_flops
from .groups import Groups, build_groups
from .pipeline import Timeline, simulate, stage_order

PHASES = ("init", "forward", "backward", "optimizer")

#: DeepSpeed ZeRO-3 ``stage3_param_persistence_threshold`` default (elements): smaller parameters
#: stay whole on every rank and are never all-gathered (DeepSpeed config documentation).
ZERO3_PERSISTENCE_THRESHOLD = 100_000


@dataclass
class Template:
    """Calls of one communicator family on one pipeline stage, before replication over groups."""

    t: list = field(default_factory=list)
    op: list = field(default_factory=list)
    par: list = field(default_factory=list)
    tensor: list = field(default_factory=list)
    bg: list = field(default_factory=list)
    bpr: list = field(default_factory=list)
    dtype: list = field(default_factory=list)
    phase: list = field(default_factory=list)
    layer: list = field(default_factory=list)
    mb: list = field(default_factory=list)
    stage: list = field(default_factory=list)

    def add(self, t, op, par, tensor, bg, bpr, dtype, phase, layer=-1, mb=-1, stage=-1):
        self.t.append(t); self.op.append(op); self.par.append(par); self.tensor.append(tensor)
        self.bg.append(int(bg)); self.bpr.append(int(bpr)); self.dtype.append(dtype)
        self.phase.append(phase); self.layer.append(layer); self.mb.append(mb); self.stage.append(stage)

    def __len__(self) -> int:
        return len(self.t)


@dataclass
class PassPlan:
    """Events of one forward or backward pass of one model chunk (offsets from the pass start).

    ``events`` are ``(offset_ns, family, op, par, tensor, bytes_global, bytes_per_rank, dtype,
    layer)``; ``grad_ready`` maps a layer (or ``"first"``/``"last"``) to the offset at which its
    gradients exist (backward passes).
    """

    duration: float
    compute: float
    events: list
    grad_ready: dict


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


class Workload:
    """Everything the schedule needs about a plan: dimensions, groups, costs and the timeline.

    Built once per plan and shared by :func:`build_collectives`,
    :func:`~wiretrace.workload.iteration_estimate` and ``wiretrace explain``.

    Attributes
    ----------
    groups : :class:`~wiretrace.workload.groups.Groups`, every communicator.
    layers : global layer indices of each virtual pipeline stage.
    timeline : :class:`~wiretrace.workload.pipeline.Timeline` of every forward/backward pass (ns).
    b, s, s_local : micro-batch size, sequence length, tokens per CP rank.
    mbs : micro-batches per iteration per DP replica.
    v, nvs : model chunks per pipeline rank and virtual stages in all.
    sp : sequence parallelism in effect (tp > 1).

    Raises
    ------
    PlanError : the plan has no model, or its layers cannot be split over the pipeline.
    """

    def __init__(self, plan: Plan):
        if plan.model is None:
            raise PlanError("plan: the analytical workload needs a model section")
        self.plan = plan
        m, t, p = plan.model, plan.training, plan.parallelism
        self.m = m
        self.tp, self.pp, self.dp, self.cp, self.ep = p.tp, p.pp, p.dp, p.cp, p.ep
        self.v = p.virtual_stages if p.pp_schedule == "interleaved" else 1
        self.nvs = self.pp * self.v
        self.sp = p.sequence_parallel and p.tp > 1
        self.b, self.s = t.micro_batch_size, t.seq_length
        self.s_local = t.seq_length // p.cp
        self.mbs = plan.num_microbatches
        self.act_dtype, self.grad_dtype, self.param_dtype = t.activation_dtype, t.grad_dtype, t.param_dtype
        self.act_b = DTYPE_BYTES[t.activation_dtype]
        self.grad_b = DTYPE_BYTES[t.grad_dtype]
        self.param_b = DTYPE_BYTES[t.param_dtype]
        self.groups: Groups = build_groups(p.tp, p.cp, p.dp, p.pp, p.ep, p.order)
        self.layers = stage_layers(m.num_hidden_layers, p.pp, self.v,
                                   p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)
        self.vocab_pad = padded_vocab_size(m.vocab_size, p.tp)
        self.flops_ns = gpu_flops_per_ns(plan)
        self._link: dict[str, tuple[float, float]] = {}
        self.tensors = param_tensors(m)
        self._pass_cache: dict = {}
        self.timeline = self._simulate()

    # -- links and communication times ------------------------------------------------------
    def link(self, family: str) -> tuple[float, float]:
        """(rate bits/s, latency ns) of a communicator family: NVLink when every group of the
        family stays inside one node, else the NIC."""
        if family not in self._link:
            g = self.groups.family({"pp_pair": "pp", "cp_ring": "cp"}.get(family, family))
            nodes = g // self.plan.cluster.gpus_per_node
            intra = bool(np.all(nodes == nodes[:, :1]))
            c = self.plan.cluster
            self._link[family] = (c.nvlink_rate_bps, c.nvlink_latency_ns) if intra else (c.nic_rate_bps, c.latency_ns)
        return self._link[family]

    def comm(self, family: str, op: str, bytes_global: float, n: int) -> float:
        """Estimated time (ns) of one call; ``bytes_global`` as in the collectives table (for
        all_to_all the sum of all ranks' inputs, of which each rank sends its own share)."""
        rate, lat = self.link(family)
        if op in ("all_to_all", "all_to_allv"):
            bytes_global = bytes_global / n
        return comm_ns(op, bytes_global, n, rate, lat)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def act_bytes(self) -> int:
        """``b x s/cp x h`` activations of one micro-batch in the activation dtype, bytes."""
        return self.b * self.s_local * self.m.hidden_size * self.act_b

    @property
    def kv_block_bytes(self) -> int:
        """K and V of one rank's sequence chunk for its TP share of KV heads, bytes."""
        kv_heads = max(self.m.num_key_value_heads // self.tp, 1)
        return 2 * self.b * self.s_local * kv_heads * self.m.head_dim * self.act_b

    @property
    def p2p_bytes(self) -> int:
        """Pipeline send of one micro-batch: ``b s h`` (divided by tp with SP), bytes."""
        return self.act_bytes // (self.tp if self.sp else 1)

    def a2a_bytes_per_rank(self) -> int:
        """All-to-all input of one rank for one MoE layer: routed tokens x h, bytes.

        Tokens per rank are ``b s / cp`` (divided by tp with SP); each is sent to ``top-k``
        experts; with a capacity factor every expert receives
        ``ceil(capacity_factor x tokens x top-k / experts)`` slots (Megatron-LM
        ``moe_expert_capacity_factor`` with ``moe_pad_expert_input_to_capacity``).
        """
        m = self.m
        tokens = self.b * self.s_local // (self.tp if self.sp else 1)
        cap = math.ceil(m.capacity_factor * tokens * m.num_experts_per_tok / m.num_local_experts)
        return cap * m.num_local_experts * m.hidden_size * self.act_b

    def shard(self, t: ParamTensor) -> int:
        return t.shard_numel(self.tp, self.vocab_pad)

    # -- tensors per model chunk ---------------------------------------------------------------
    def chunk_tensors(self, vs: int) -> list[ParamTensor]:
        """Parameter tensors held by virtual stage ``vs`` (local experts of EP rank 0 only)."""
        layers = set(self.layers[vs])
        per_ep = max(self.m.num_local_experts // self.ep, 1)
        out = []
        for t in self.tensors:
            if t.expert >= per_ep:
                continue
            if t.layer in layers or (t.where == "first" and vs == 0) or (t.where == "last" and vs == self.nvs - 1):
                out.append(t)
        if self.m.tie_word_embeddings and self.pp > 1 and vs == self.nvs - 1:
            emb = self.tensors[0]
            out.append(ParamTensor("lm_head.weight", emb.shape, -1, "vocab", where="last"))
        return out

    # -- one pass ------------------------------------------------------------------------------
    def pass_plan(self, stage: int, kind: str, chunk: int) -> PassPlan:
        key = (stage, kind, chunk)
        if key not in self._pass_cache:
            self._pass_cache[key] = self._build_pass(stage, kind, chunk)
        return self._pass_cache[key]

    def _build_pass(self, stage: int, kind: str, chunk: int) -> PassPlan:
        vs = chunk * self.pp + stage
        m, tp, sp = self.m, self.tp, self.sp
        first, last = vs == 0, vs == self.nvs - 1
        f_ns = self.flops_ns * tp * self.cp      # layer FLOPs are whole-layer; one GPU does 1/(tp cp)
        act = self.act_bytes
        ad = self.act_dtype
        ev: list = []
        clock = [0.0]
        compute = [0.0]
        zero3 = self.plan.parallelism.zero == 3 and self.dp * self.cp > 1
        recompute = self.plan.training.recompute

        def work(ns: float) -> None:
            clock[0] += ns; compute[0] += ns

        def coll(family: str, op: str, par: str, tensor: str, bg: int, bpr: int, dtype: str,
                 layer: int, n: int, wait: bool = True) -> None:
            ev.append((clock[0], family, op, par, tensor, bg, bpr, dtype, layer))
            if wait:
                clock[0] += self.comm(family, op, bg, n)

        def tp_reduce(tensor: str, layer: int) -> None:
            """After a row-parallel layer: all-reduce, or reduce-scatter with SP."""
            if tp == 1:
                return
            if sp:
                coll("tp", "reduce_scatter", "sp", tensor, act, act // tp, ad, layer, tp)
            else:
                coll("tp", "all_reduce", "tp", tensor, act, act, ad, layer, tp)

        def sp_gather(tensor: str, layer: int, wait: bool = True) -> None:
            if sp:
                coll("tp", "all_gather", "sp", tensor, act, act // tp, ad, layer, tp, wait)

        prefetch = [0.0]      # start of the previous unit: when the next all-gather is issued

        def zero3_units(layer_key, phase_kind: str) -> None:
            """FSDP / ZeRO-3 all-gather (or gradient reduce-scatter) of one layer's parameters.

            All-gathers are issued one unit ahead (FSDP ``forward_prefetch`` / ``BACKWARD_PRE``,
            DeepSpeed's prefetch), at the start of the previous unit's compute; the layer waits
            for them, so only what outlasts that compute is exposed. Reduce-scatters run
            behind the next layer's backward.
            """
            if not zero3:
                return
            if phase_kind == "gather":
                now = clock[0]
                clock[0] = min(prefetch[0], now)
                _zero3_emit(layer_key, phase_kind)
                clock[0] = max(now, clock[0])
                prefetch[0] = clock[0]
            else:
                _zero3_emit(layer_key, phase_kind)

        def _zero3_emit(layer_key, phase_kind: str) -> None:
            tensors = [t for t in self.chunk_tensors(vs)
                       if (t.layer == layer_key if isinstance(layer_key, int) else (t.layer < 0 and t.where == layer_key))]
            units: list[tuple[str, list[ParamTensor]]]
            if self.plan.parallelism.zero3_granularity == "tensor":
                # DeepSpeed keeps parameters below stage3_param_persistence_threshold unpartitioned:
                # they are never gathered (their gradients are still reduce-scattered)
                units = [(t.name, [t]) for t in tensors
                         if phase_kind != "gather" or self.shard(t) >= ZERO3_PERSISTENCE_THRESHOLD]
            else:
                name = f"layers.{layer_key}" if isinstance(layer_key, int) else ("embed" if layer_key == "first" else "head")
                units = [(name, tensors)]
            lay = layer_key if isinstance(layer_key, int) else -1
            for name, ts in units:
                for fam, sel, n in (("dp", [t for t in ts if t.expert < 0], self.dp * self.cp),
                                    ("edp", [t for t in ts if t.expert >= 0], self.dp * self.cp // self.ep)):
                    numel = sum(self.shard(t) for t in sel)
                    if not numel or n == 1:
                        continue
                    padded = _ceil_to(numel, n)
                    if phase_kind == "gather":     # issued back to back on the DP communicator
                        coll(fam, "all_gather", "dp", f"param.{name}", padded * self.param_b,
                             padded // n * self.param_b, self.param_dtype, lay, n, wait=True)
                    else:
                        coll(fam, "reduce_scatter", "dp", f"grad.{name}", padded * self.grad_b,
                             padded // n * self.grad_b, self.grad_dtype, lay, n, wait=False)

        def layer_forward(layer: int, prefix: str = "") -> None:
            fl = layer_flops(m, self.b, self.s, layer)
            proj = fl["attn_proj"] / f_ns
            qkv_frac = (m.q_size + 2 * m.kv_size) / (2 * m.q_size + 2 * m.kv_size)
            sp_gather(prefix + "attn.qkv_proj.input", layer)
            work(proj * qkv_frac)
            self._cp_forward(coll, fl["attn_core"] / f_ns, layer, prefix, clock, compute)
            work(proj * (1 - qkv_frac))
            tp_reduce(prefix + "attn.out_proj.activation", layer)
            moe_ep = m.is_moe_layer(layer) and self.ep > 1
            if moe_ep:
                # token dispatcher: all-to-all over EP of the s/tp tokens of this rank, then (SP)
                # all-gather over TP of what arrived; mirror image on the way back
                a2a = self.a2a_bytes_per_rank()
                coll("ep", "all_to_all", "ep", prefix + "moe.dispatch", a2a * self.ep, a2a, ad, layer, self.ep)
                if sp:
                    coll("tp", "all_gather", "sp", prefix + "moe.dispatch.tp_gather", a2a * tp, a2a, ad, layer, tp)
                work(fl["mlp"] / f_ns)
                if sp:
                    coll("tp", "reduce_scatter", "sp", prefix + "moe.combine.tp_scatter", a2a * tp, a2a, ad, layer, tp)
                coll("ep", "all_to_all", "ep", prefix + "moe.combine", a2a * self.ep, a2a, ad, layer, self.ep)
                if not sp:
                    tp_reduce(prefix + "mlp.down_proj.activation", layer)
            else:
                sp_gather(prefix + "mlp.up_proj.input", layer)
                work(fl["mlp"] / f_ns)
                tp_reduce(prefix + "mlp.down_proj.activation", layer)

        grad_ready: dict = {}
        if kind == "F":
            if first:
                zero3_units("first", "gather")
                tp_reduce("embed_tokens.activation", -1)
            for layer in self.layers[vs]:
                zero3_units(layer, "gather")
                layer_forward(layer)
            if last:
                zero3_units("last", "gather")
                sp_gather("lm_head.input", -1)
                work(head_flops(m, self.b, self.s_local) / (self.flops_ns * tp))
                if tp > 1:
                    ce = self.b * self.s_local * 4
                    for nm in ("loss.logits_max", "loss.predicted_logits", "loss.sum_exp_logits"):
                        coll("tp", "all_reduce", "tp", nm, ce, ce, "fp32", -1, tp)
        else:
            if last:
                if self.plan.parallelism.zero3_granularity == "tensor":
                    zero3_units("last", "gather")   # FSDP keeps the root unit gathered for backward
                sp_gather("lm_head.input", -1, wait=False)
                work(2 * head_flops(m, self.b, self.s_local) / (self.flops_ns * tp))
                if tp > 1:
                    if sp:
                        coll("tp", "reduce_scatter", "sp", "lm_head.input_grad", act, act // tp, ad, -1, tp)
                    else:
                        coll("tp", "all_reduce", "tp", "lm_head.input_grad", act, act, ad, -1, tp)
                grad_ready["last"] = clock[0]
                zero3_units("last", "scatter")
            for layer in reversed(self.layers[vs]):
                fl = layer_flops(m, self.b, self.s, layer)
                zero3_units(layer, "gather")
                if recompute == "full":
                    layer_forward(layer, prefix="recompute.")
                elif recompute == "selective":
                    work(fl["attn_core"] / f_ns)
                proj = fl["attn_proj"] / f_ns
                # MLP backward
                if m.is_moe_layer(layer) and self.ep > 1:
                    a2a = self.a2a_bytes_per_rank()
                    coll("ep", "all_to_all", "ep", "moe.combine_grad", a2a * self.ep, a2a, ad, layer, self.ep)
                    if sp:
                        coll("tp", "all_gather", "sp", "moe.combine_grad.tp_gather", a2a * tp, a2a, ad, layer, tp)
                    work(2 * fl["mlp"] / f_ns)
                    if sp:
                        coll("tp", "reduce_scatter", "sp", "moe.dispatch_grad.tp_scatter", a2a * tp, a2a, ad, layer, tp)
                    coll("ep", "all_to_all", "ep", "moe.dispatch_grad", a2a * self.ep, a2a, ad, layer, self.ep)
                    if not sp:
                        tp_reduce("mlp.up_proj.input_grad", layer)
                else:
                    sp_gather("mlp.down_proj.activation_grad", layer)
                    sp_gather("mlp.up_proj.input", layer, wait=False)
                    work(2 * fl["mlp"] / f_ns)
                    tp_reduce("mlp.up_proj.input_grad", layer)
                # attention backward
                sp_gather("attn.out_proj.activation_grad", layer)
                qkv_frac = (m.q_size + 2 * m.kv_size) / (2 * m.q_size + 2 * m.kv_size)
                work(2 * proj * (1 - qkv_frac))
                self._cp_backward(coll, 2 * fl["attn_core"] / f_ns, layer, clock, compute)
                sp_gather("attn.qkv_proj.input", layer, wait=False)
                work(2 * proj * qkv_frac)
                tp_reduce("attn.qkv_proj.input_grad", layer)
                grad_ready[layer] = clock[0]
                zero3_units(layer, "scatter")
            if first:
                grad_ready["first"] = clock[0]
                zero3_units("first", "scatter")
        return PassPlan(duration=clock[0], compute=compute[0], events=ev, grad_ready=grad_ready)

    def _cp_forward(self, coll, core_ns: float, layer: int, prefix: str, clock, compute) -> None:
        cp = self.cp
        if cp > 1 and self.plan.parallelism.cp_algorithm == "ring":
            kvb = self.kv_block_bytes
            t0 = clock[0]
            for step in range(cp - 1):
                clock[0] = t0 + step * core_ns / cp
                coll("cp_ring", "send_recv", "cp", prefix + "attn.kv", kvb, kvb, self.act_dtype, layer, 2, wait=False)
            clock[0] = t0
        elif cp > 1:
            kvb = self.kv_block_bytes
            coll("cp", "all_gather", "cp", prefix + "attn.kv", kvb * cp, kvb, self.act_dtype, layer, cp)
        clock[0] += core_ns; compute[0] += core_ns

    def _cp_backward(self, coll, core_ns: float, layer: int, clock, compute) -> None:
        cp = self.cp
        kvb = self.kv_block_bytes
        if cp > 1 and self.plan.parallelism.cp_algorithm == "ring":
            t0 = clock[0]
            for step in range(cp):
                clock[0] = t0 + step * core_ns / cp
                if step < cp - 1:
                    coll("cp_ring", "send_recv", "cp", "attn.kv", kvb, kvb, self.act_dtype, layer, 2, wait=False)
                clock[0] = t0 + (step + 1) * core_ns / cp
                coll("cp_ring", "send_recv", "cp", "attn.dkv", kvb, kvb, self.act_dtype, layer, 2, wait=False)
            clock[0] = t0 + core_ns
            compute[0] += core_ns
            return
        if cp > 1:
            coll("cp", "all_gather", "cp", "attn.kv", kvb * cp, kvb, self.act_dtype, layer, cp)
        clock[0] += core_ns; compute[0] += core_ns
        if cp > 1:
            coll("cp", "reduce_scatter", "cp", "attn.dkv", kvb * cp, kvb, self.act_dtype, layer, cp)

    # -- timeline --------------------------------------------------------------------------------
    def _simulate(self) -> Timeline:
        sched = self.plan.parallelism.pp_schedule
        order = [stage_order(sched, self.pp, s, self.mbs, self.v) for s in range(self.pp)]
        p2p = self.comm("pp", "send_recv", self.p2p_bytes, 2) if self.pp > 1 else 0.0
        self.p2p_ns = p2p
        return simulate(order, self.pp, self.v, lambda s, k, c: self.pass_plan(s, k, c).duration, p2p)


# ---------------------------------------------------------------------------------------------
# Templates per (family, stage)
# ---------------------------------------------------------------------------------------------

def _buckets(w: Workload, tensors: list[ParamTensor], cap_bytes: int, elem_bytes: int,
             first_cap_bytes: int | None = None) -> list[list[ParamTensor]]:
    """PyTorch DDP bucketing of one iteration after the first (``Reducer::rebuild_buckets`` in
    ``torch/csrc/distributed/c10d/reducer.cpp``): tensors in the order their gradients become
    ready (here: reverse registration order), a bucket closes once it holds its cap or more
    (``compute_bucket_assignment_by_size``; tensors are never split); the first bucket's cap is
    ``first_cap_bytes`` (``first_bucket_bytes_cap``, 1 MiB by default), the others ``cap_bytes``."""
    out: list[list[ParamTensor]] = []
    cur: list[ParamTensor] = []
    size = 0
    limit = min(first_cap_bytes, cap_bytes) if first_cap_bytes else cap_bytes
    for t in reversed(tensors):
        cur.append(t)
        size += w.shard(t) * elem_bytes
        if size >= limit:
            out.append(cur); cur = []; size = 0
            limit = cap_bytes
    if cur:
        out.append(cur)
    return out


def distributed_optimizer_bucket_numel(numels: list[int], dp: int) -> int:
    """Elements of one Megatron-LM distributed-optimizer bucket holding tensors of ``numels``.

    ``megatron/core/distributed/param_and_grad_buffer.py``: each parameter starts at a multiple of
    64 elements (``_pad_start_of_param_if_needed``) and the bucket ends at a multiple of
    ``lcm(dp, 128)`` (``_pad_end_of_bucket_if_needed``), so every rank owns an equal,
    aligned shard.
    """
    idx = 0
    for n in numels:
        idx = _ceil_to(idx, 64) + n
    return _ceil_to(idx, math.lcm(dp, 128))


def _templates(w: Workload) -> dict[tuple[str, int, int], Template]:
    """Templates keyed by (family, stage, peer stage) — peer stage only for pipeline pairs."""
    tl = w.timeline
    p = w.plan.parallelism
    temps: dict[tuple[str, int, int], Template] = {}

    def tmpl(family: str, stage: int, peer: int = -1) -> Template:
        return temps.setdefault((family, stage, peer), Template())

    for s in range(w.pp):
        for (kind, mb, c) in tl.order[s]:
            t0 = tl.start[(s, kind, mb, c)]
            plan_ = w.pass_plan(s, kind, c)
            phase = "forward" if kind == "F" else "backward"
            for (off, fam, op, par, tensor, bg, bpr, dtype, layer) in plan_.events:
                tmpl(fam, s).add(t0 + off, op, par, tensor, bg, bpr, dtype, phase, layer, mb, s)
            vs = c * w.pp + s
            if w.pp > 1:
                t1 = tl.end[(s, kind, mb, c)]
                if kind == "F" and vs < w.nvs - 1:
                    tmpl("pp_pair", s, (s + 1) % w.pp).add(t1, "send_recv", "pp", "pp.activation", w.p2p_bytes,
                                                           w.p2p_bytes, w.act_dtype, "forward", -1, mb, s)
                if kind == "B" and vs > 0:
                    tmpl("pp_pair", s, (s - 1) % w.pp).add(t1, "send_recv", "pp", "pp.activation_grad", w.p2p_bytes,
                                                           w.p2p_bytes, w.act_dtype, "backward", -1, mb, s)

    # gradient reduction of the last micro-batch (zero 0/1/2) and the end of each stage's backward
    last_mb = w.mbs - 1
    stage_end = [max(tl.end[(s, k, mb, c)] for (k, mb, c) in tl.order[s]) for s in range(w.pp)]
    ndp = w.dp * w.cp
    nedp = ndp // w.ep
    for s in range(w.pp):
        # SP: norm gradients all-reduced over TP (Megatron-LM finalize_model_grads)
        if w.sp:
            numel = sum(w.shard(t) for c in range(w.v) for t in w.chunk_tensors(c * w.pp + s)
                        if t.split == "replicated" and ("norm" in t.name))
            if numel:
                nb = numel * w.grad_b
                tmpl("tp", s).add(stage_end[s], "all_reduce", "tp", "grad.layernorm", nb, nb, w.grad_dtype,
                                  "backward", -1, -1, s)
        if p.zero == 3:
            continue
        for c in range(w.v):
            vs = c * w.pp + s
            key = (s, "B", last_mb, c)
            t0 = tl.start[key]
            ready = w.pass_plan(s, "B", c).grad_ready
            tensors = w.chunk_tensors(vs)
            prefix = f"chunk{c}." if w.v > 1 else ""
            for fam, sel, n, label in (("dp", [t for t in tensors if t.expert < 0], ndp, "bucket"),
                                       ("edp", [t for t in tensors if t.expert >= 0], nedp, "expert_bucket")):
                if n == 1 or not sel:
                    continue
                first_cap = w.plan.training.dp_first_bucket_bytes if p.zero == 0 else None
                for k, bucket in enumerate(_buckets(w, sel, w.plan.training.dp_bucket_bytes, w.grad_b, first_cap)):
                    tr = max(t0 + ready[t.layer if t.layer >= 0 else t.where] for t in bucket)
                    numel = sum(w.shard(t) for t in bucket)
                    if p.zero == 0:
                        nb = numel * w.grad_b
                        tmpl(fam, s).add(tr, "all_reduce", "dp", f"grad.{prefix}{label}{k}", nb, nb, w.grad_dtype,
                                         "backward", -1, -1, s)
                    else:
                        padded = distributed_optimizer_bucket_numel([w.shard(t) for t in bucket], n)
                        tmpl(fam, s).add(tr, "reduce_scatter", "dp", f"grad.{prefix}{label}{k}", padded * w.grad_b,
                                         padded // n * w.grad_b, w.grad_dtype, "backward", -1, -1, s)
                        tmpl(fam + "_opt", s).add(0.0, "all_gather", "dp", f"param.{prefix}{label}{k}",
                                                  padded * w.param_b, padded // n * w.param_b, w.param_dtype,
                                                  "optimizer", -1, -1, s)
    # optimizer all-gathers start once the stage's reduce-scatters are done
    for fam in ("dp", "edp"):
        for s in range(w.pp):
            opt = temps.get((fam + "_opt", s, -1))
            if opt is None:
                continue
            n = ndp if fam == "dp" else nedp
            rs = temps[(fam, s, -1)]
            end = stage_end[s]
            for i in np.argsort(rs.t, kind="stable"):
                if rs.op[i] == "reduce_scatter" and rs.phase[i] == "backward" and rs.tensor[i].startswith("grad."):
                    end = max(end, rs.t[i]) + w.comm(fam, "reduce_scatter", rs.bg[i], n)
            opt.t = [end] * len(opt)
            for k, v in vars(opt).items():
                getattr(rs, k).extend(v)
            del temps[(fam + "_opt", s, -1)]
    # tied embeddings: first and last stage all-reduce the embedding gradient
    if w.m.tie_word_embeddings and w.pp > 1:
        nb = w.shard(w.tensors[0]) * w.grad_b
        tmpl("embedding", -1).add(max(stage_end[0], stage_end[-1]), "all_reduce", "pp",
                                  "grad.embed_tokens.tied", nb, nb, w.grad_dtype, "backward", -1, -1, -1)
    return temps


# ---------------------------------------------------------------------------------------------
# Replication over communicators and the Arrow table
# ---------------------------------------------------------------------------------------------

def _family_groups(w: Workload, family: str, stage: int, peer: int) -> tuple[np.ndarray, np.ndarray]:
    """(ranks (G, S), communicator ids (G,)) of ``family`` restricted to pipeline ``stage``."""
    g = w.groups
    if family == "pp_pair":
        pairs = np.stack([g.pp[:, stage], g.pp[:, peer]], axis=1)
        return pairs, g.group_ids("pp")
    if family == "cp_ring":
        cpg = g.cp
        ids = g.group_ids("cp")
        keep = g.stage[cpg[:, 0]] == stage
        cpg, ids = cpg[keep], ids[keep]
        n = cpg.shape[1]
        pairs = np.stack([cpg, np.roll(cpg, -1, axis=1)], axis=2).reshape(-1, 2)
        return pairs, np.repeat(ids, n)
    ranks = g.family(family)
    ids = g.group_ids(family)
    if stage >= 0:
        keep = g.stage[ranks[:, 0]] == stage
        ranks, ids = ranks[keep], ids[keep]
    return ranks, ids


class _Interner:
    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def codes(self, values: list[str]) -> np.ndarray:
        return np.fromiter((self.index.setdefault(v, len(self.index)) for v in values), dtype=np.int32,
                           count=len(values))

    def dictionary(self, codes: np.ndarray) -> pa.DictionaryArray:
        vocab = pa.array(list(self.index), type=pa.string())
        return pa.DictionaryArray.from_arrays(pa.array(codes, type=pa.int32()), vocab)


def _algorithm(plan: Plan, op: str) -> str:
    """Algorithm name for ``op``: ``collectives.algorithm`` (a name or per-op mapping, "auto" kept).

    Point-to-point operations (send_recv) and all-to-all are direct exchanges in NCCL
    (``src/device/sendrecv.h``, ``alltoall`` as grouped send/recv) unless the mapping names them.
    """
    alg = plan.collectives.algorithm
    if op in ("send_recv", "all_to_all", "all_to_allv") and not (isinstance(alg, dict) and op in alg):
        return "direct"
    return plan.collectives.algorithm_for(op)


def build_collectives(plan: Plan, workload: Workload | None = None) -> pa.Table:
    """The collectives table of one iteration of ``plan`` (``schemas/collectives.schema.json``).

    One row per collective call per communicator, sorted by ``t_ready_ns`` (ties: template order,
    then communicator); ``op_id`` is 0..n-1 in that order. ``ranks`` lists the communicator's global
    ranks in Megatron-LM group order (``[src, dst]`` for send_recv); ``group`` is the communicator id
    (see :class:`~wiretrace.workload.groups.Groups`); ``t_ready_ns`` comes from the compute model and
    the pipeline timeline; ``source`` is ``analytical``.

    Raises
    ------
    PlanError : the plan has no model, or its layers cannot be split over the pipeline.
    """
    w = workload or Workload(plan)
    temps = _templates(w)
    I = {k: _Interner() for k in ("op", "par", "tensor", "dtype", "phase", "algorithm")}
    cols: dict[str, list] = {k: [] for k in ("t", "op", "par", "tensor", "dtype", "phase", "bg", "bpr",
                                             "layer", "mb", "stage", "group", "gsize", "src", "dst",
                                             "block", "tidx", "gidx")}
    rank_arrays: list[pa.Array] = []
    algo_of: dict[str, str] = {}
    for bno, (key, tm) in enumerate(sorted(temps.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2]))):
        family, stage, peer = key
        if not len(tm):
            continue
        ranks, ids = _family_groups(w, family, stage, peer)
        G, S = ranks.shape
        T = len(tm)
        if G == 0:
            continue
        ti = np.repeat(np.arange(T, dtype=np.int64), G)
        gi = np.tile(np.arange(G, dtype=np.int64), T)

        def rep(values, dtype):
            return np.asarray(values, dtype=dtype)[ti]

        cols["t"].append(np.rint(np.asarray(tm.t, dtype=np.float64)).astype(np.int64)[ti])
        for col, src in (("op", tm.op), ("par", tm.par), ("tensor", tm.tensor), ("dtype", tm.dtype),
                         ("phase", tm.phase)):
            cols[col].append(I[col].codes(src)[ti])
        cols["bg"].append(rep(tm.bg, np.int64)); cols["bpr"].append(rep(tm.bpr, np.int64))
        cols["layer"].append(rep(tm.layer, np.int32)); cols["mb"].append(rep(tm.mb, np.int32))
        cols["stage"].append(rep(tm.stage, np.int32))
        cols["group"].append(ids[gi]); cols["gsize"].append(np.full(T * G, S, dtype=np.int32))
        if family in ("pp_pair", "cp_ring"):
            cols["src"].append(ranks[gi, 0].astype(np.int32)); cols["dst"].append(ranks[gi, 1].astype(np.int32))
        else:
            cols["src"].append(np.full(T * G, -1, np.int32)); cols["dst"].append(np.full(T * G, -1, np.int32))
        cols["block"].append(np.full(T * G, bno, np.int32))
        cols["tidx"].append(ti); cols["gidx"].append(gi)
        flat = np.tile(ranks.astype(np.int32).ravel(), T)
        offsets = np.arange(0, T * G * S + 1, S, dtype=np.int32)
        rank_arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)))
        for op in set(tm.op):
            algo_of.setdefault(op, _algorithm(plan, op))

    if not rank_arrays:
        from ..tables import empty
        return empty("collectives")
    c = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.lexsort((c["gidx"], c["tidx"], c["block"], c["t"]))
    n = len(order)
    op_codes = c["op"][order]
    op_names = list(I["op"].index)
    algo_codes = I["algorithm"].codes([algo_of[o] for o in op_names])[op_codes]
    ranks = pa.concat_arrays(rank_arrays).take(pa.array(order))
    columns = {
        "op_id": np.arange(n, dtype=np.int64),
        "iteration": np.zeros(n, dtype=np.int32),
        "op": I["op"].dictionary(op_codes),
        "parallelism": I["par"].dictionary(c["par"][order]),
        "group": c["group"][order],
        "ranks": ranks,
        "group_size": c["gsize"][order],
        "bytes_global": c["bg"][order],
        "bytes_per_rank": c["bpr"][order],
        "dtype": I["dtype"].dictionary(c["dtype"][order]),
        "phase": I["phase"].dictionary(c["phase"][order]),
        "layer": c["layer"][order],
        "microbatch": c["mb"][order],
        "stage": c["stage"][order],
        "tensor": I["tensor"].dictionary(c["tensor"][order]),
        "src": c["src"][order],
        "dst": c["dst"][order],
        "algorithm": I["algorithm"].dictionary(algo_codes),
        "t_ready_ns": c["t"][order],
        "source": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)),
                                                 pa.array(["analytical"])),
    }
    return to_arrow("collectives", columns)
