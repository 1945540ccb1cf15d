"""Model presets and dimensions (Hugging Face config names).

A plan's ``model`` section is a preset name, a Hugging Face ``config.json``, or the dimensions
themselves; :func:`resolve` turns any of them into a frozen :class:`ModelConfig`.

Preset dimensions come from the published configs:

* GPT-2 small / XL: OpenAI's ``gpt2`` and ``gpt2-xl`` configs on the Hugging Face hub
  (n_layer, n_embd, n_head, n_positions 1024, vocab 50257, tied embeddings, GELU MLP 4h, biases).
* GPT-3 175B: Brown et al. 2020, "Language Models are Few-Shot Learners", table 2.1
  (96 layers, d_model 12288, 96 heads, context 2048), GPT-2 vocabulary.
* Llama 3 8B / 70B / 405B: Meta's ``config.json`` files for Meta-Llama-3(.1) (hidden, intermediate,
  heads, 8 KV heads, vocab 128256, untied, SwiGLU, RMSNorm, RoPE) and the Llama 3 paper table 3.
* GPT-2 medium / large: OpenAI's ``gpt2-medium`` and ``gpt2-large`` configs (24 x 1024, 36 x 1280).
* Mistral 7B: ``mistralai/Mistral-7B-v0.1`` ``config.json`` (32 layers, 4096, 14336, 8 KV heads,
  vocab 32000).
* Qwen2 7B: ``Qwen/Qwen2-7B`` ``config.json`` (28 layers, 3584, 18944, 28 heads, 4 KV heads, vocab
  152064, q/k/v biases).
* Mixtral 8x7B: Mistral AI's ``config.json`` (32 layers, 4096, 14336, 8 experts, top-2, vocab 32000).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import PlanError


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a decoder-only transformer (Hugging Face names).

    ``gated_mlp`` is True for SwiGLU-style MLPs (three matrices: gate, up, down) and False for the
    GPT-2 GELU MLP (two). ``num_local_experts`` > 1 makes every ``moe_layer_freq``-th layer a
    mixture of experts with ``num_experts_per_tok`` routed experts per token.
    """

    name: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    gated_mlp: bool = True
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    norm: str = "rmsnorm"
    position_embedding: str = "rope"
    max_position_embeddings: int = 0
    hidden_act: str = "silu"
    num_local_experts: int = 1
    num_experts_per_tok: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    moe_layer_freq: int = 1
    capacity_factor: float = 1.0
    first_moe_layer: int = 0
    head_dim: int = 0                   # 0: hidden_size // num_attention_heads

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @property
    def q_size(self) -> int:
        """Width of the Q projection (and input of O): ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 1

    @property
    def kv_size(self) -> int:
        """Width of the K (or V) projection: ``num_key_value_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """True when ``layer`` (0-based) has a mixture-of-experts MLP.

        MoE layers are every ``moe_layer_freq``-th layer from ``first_moe_layer`` on (Mixtral: all;
        Switch/GShard-style ``moe_layer_freq: 2``: every other layer; DeepSeek/Qwen-MoE
        ``first_k_dense_replace`` maps to ``first_moe_layer``).
        """
        return (self.is_moe and layer >= self.first_moe_layer
                and (layer - self.first_moe_layer) % self.moe_layer_freq == 0)


_GPT2 = dict(tie_word_embeddings=True, gated_mlp=False, attention_bias=True, attention_out_bias=True,
             mlp_bias=True,
             norm="layernorm", position_embedding="learned", hidden_act="gelu_new", vocab_size=50257)
_LLAMA3 = dict(num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, gated_mlp=True,
               norm="rmsnorm", position_embedding="rope", hidden_act="silu")

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-small": dict(_GPT2, num_hidden_layers=12, hidden_size=768, intermediate_size=3072,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024),
    "gpt2-medium": dict(_GPT2, num_hidden_layers=24, hidden_size=1024, intermediate_size=4096,
                        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024),
    "gpt2-large": dict(_GPT2, num_hidden_layers=36, hidden_size=1280, intermediate_size=5120,
                       num_attention_heads=20, num_key_value_heads=20, max_position_embeddings=1024),
    "gpt2-xl": dict(_GPT2, num_hidden_layers=48, hidden_size=1600, intermediate_size=6400,
                    num_attention_heads=25, num_key_value_heads=25, max_position_embeddings=1024),
    "gpt3-175b": dict(_GPT2, num_hidden_layers=96, hidden_size=12288, intermediate_size=49152,
                      num_attention_heads=96, num_key_value_heads=96, max_position_embeddings=2048),
    "llama3-8b": dict(_LLAMA3, num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                      num_attention_heads=32, max_position_embeddings=8192),
    "llama3-70b": dict(_LLAMA3, num_hidden_layers=80, hidden_size=8192, intermediate_size=28672,
                       num_attention_heads=64, max_position_embeddings=8192),
    "llama3-405b": dict(_LLAMA3, num_hidden_layers=126, hidden_size=16384, intermediate_size=53248,
                        num_attention_heads=128, max_position_embeddings=131072),
    "mistral-7b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                       tie_word_embeddings=False, gated_mlp=True, norm="rmsnorm",
                       position_embedding="rope", hidden_act="silu", max_position_embeddings=32768),
    "qwen2-7b": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     tie_word_embeddings=False, gated_mlp=True, attention_bias=True,
                     attention_out_bias=False, norm="rmsnorm", position_embedding="rope",
                     hidden_act="silu", max_position_embeddings=131072),
    "mixtral-8x7b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         tie_word_embeddings=False, gated_mlp=True, norm="rmsnorm",
                         position_embedding="rope", hidden_act="silu", max_position_embeddings=32768,
                         num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
}

_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def from_dims(name: str, dims: Mapping[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from a mapping of Hugging Face field names.

    Missing ``num_key_value_heads`` means multi-head attention (= heads); missing
    ``intermediate_size`` means 4 x hidden. Unknown keys are ignored.
    """
    d = {k: v for k, v in dims.items() if k in _FIELDS and k != "name"}
    d.setdefault("num_key_value_heads", d.get("num_attention_heads"))
    d.setdefault("intermediate_size", 4 * d["hidden_size"])
    if d.get("num_local_experts", 1) > 1:
        d.setdefault("moe_intermediate_size", d["intermediate_size"])
    return ModelConfig(name=name, **d)


def from_hf_config(path: Path) -> ModelConfig:
    """Read a Hugging Face ``config.json`` (Llama, Mistral, Mixtral, Qwen2 and GPT-2 families).

    Family conventions follow the ``transformers`` modeling files:

    * ``llama`` / ``mistral`` (``modeling_llama.py``, ``modeling_mistral.py``): SwiGLU MLP, RMSNorm,
      ``attention_bias`` on Q, K, V and O, ``mlp_bias`` on the MLP (Llama), untied unless
      ``tie_word_embeddings``;
    * ``mixtral`` (``modeling_mixtral.py``): every layer's MLP is ``num_local_experts`` SwiGLU experts
      of ``intermediate_size`` with a bias-free router, ``num_experts_per_tok`` routed per token;
    * ``qwen2`` (``modeling_qwen2.py``): biases on Q, K and V only;
    * ``gpt2`` (``modeling_gpt2.py``): ``n_layer``/``n_embd``/``n_head``/``n_inner``/``n_positions``,
      GELU MLP, LayerNorm with biases, learned positions, biases everywhere, tied embeddings.

    Raises
    ------
    PlanError : the file cannot be read or parsed, lacks a dimension, or has an unknown
        ``model_type`` without Llama-style fields.
    """
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"plan $.model.hf_config: cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"plan $.model.hf_config: {path} is not a JSON object")
    mt = str(cfg.get("model_type", ""))
    name = Path(path).parent.name or mt or "hf"
    if mt == "gpt2" or "n_embd" in cfg:
        need = ("n_layer", "n_embd", "n_head")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise PlanError(f"plan $.model.hf_config: {path} (gpt2) lacks {', '.join(missing)}")
        d = dict(_GPT2)
        d.update(num_hidden_layers=cfg["n_layer"], hidden_size=cfg["n_embd"],
                 num_attention_heads=cfg["n_head"], num_key_value_heads=cfg["n_head"],
                 intermediate_size=cfg.get("n_inner") or 4 * cfg["n_embd"],
                 vocab_size=cfg.get("vocab_size", 50257),
                 max_position_embeddings=cfg.get("n_positions", 1024),
                 tie_word_embeddings=cfg.get("tie_word_embeddings", True))
        return from_dims(name, d)
    need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise PlanError(f"plan $.model.hf_config: {path} lacks {', '.join(missing)}")
    if mt and mt not in ("llama", "mistral", "mixtral", "qwen2"):
        raise PlanError(f"plan $.model.hf_config: {path} has model_type {mt!r}; known: gpt2, llama, mistral, mixtral, qwen2")
    d = {k: v for k, v in cfg.items() if v is not None}
    d.setdefault("tie_word_embeddings", False)
    d["gated_mlp"] = True
    d["norm"] = "rmsnorm"
    d["position_embedding"] = "rope"
    if mt == "qwen2":
        d["attention_bias"] = True          # q/k/v biases, o_proj without (modeling_qwen2.py)
        d["attention_out_bias"] = False
        d["mlp_bias"] = False
    elif mt == "mixtral":
        d["attention_bias"] = d["attention_out_bias"] = False
        d["mlp_bias"] = False
    else:
        d["attention_out_bias"] = bool(d.get("attention_bias", False))
    if d.get("num_local_experts", 1) > 1:
        d["moe_intermediate_size"] = cfg.get("intermediate_size")
    return from_dims(name, d)


def resolve(spec: Mapping[str, Any], base_dir: Path | None = None) -> ModelConfig:
    """Resolve a plan's ``model`` section (preset, hf_config or dimensions) to a ModelConfig.

    Fields given beside a preset or hf_config override it. Raises :class:`PlanError` for an
    unknown preset (naming the known ones) or an unreadable config.
    """
    spec = dict(spec)
    if "preset" in spec:
        name = spec.pop("preset")
        if name not in PRESETS:
            raise PlanError(f"plan $.model.preset: unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        dims = dict(PRESETS[name]); dims.update(spec)
        return from_dims(name, dims)
    if "hf_config" in spec:
        p = Path(spec.pop("hf_config"))
        if base_dir is not None and not p.is_absolute():
            p = base_dir / p
        base = from_hf_config(p)
        return dataclasses.replace(base, **{k: v for k, v in spec.items() if k in _FIELDS})
    return from_dims(spec.get("name", "custom"), spec)


# ---------------------------------------------------------------------------------------------
# Parameters: one record per tensor, in registration order, with its tensor-parallel split
# ---------------------------------------------------------------------------------------------

#: How a tensor is split across tensor-parallel ranks (Megatron-LM ``megatron/core/tensor_parallel/
#: layers.py``): ``"column"`` (ColumnParallelLinear: output rows divided by tp), ``"row"``
#: (RowParallelLinear: input columns divided by tp), ``"vocab"`` (VocabParallelEmbedding and the
#: output layer: padded vocabulary rows divided by tp) or ``"replicated"`` (norms, row-parallel
#: biases, the router, learned position embeddings).
TP_SPLITS = ("column", "row", "vocab", "replicated")


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of the model.

    Attributes
    ----------
    name : Hugging Face style name, e.g. ``layers.3.self_attn.q_proj.weight``.
    shape : full (unsharded) shape, PyTorch ``nn.Linear`` convention ``(out, in)``.
    layer : transformer layer index, -1 for embeddings, final norm and output layer.
    split : one of :data:`TP_SPLITS`.
    expert : routed-expert index for MoE expert weights, -1 otherwise. Expert weights are divided
        across expert-parallel ranks (whole experts) and reduced over the expert data-parallel group.
    where : ``"first"`` (input embeddings, first pipeline stage), ``"last"`` (final norm, output
        layer), or ``"layer"``.
    """

    name: str
    shape: tuple[int, ...]
    layer: int
    split: str
    expert: int = -1
    where: str = "layer"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def shard_numel(self, tp: int, padded_vocab: int | None = None) -> int:
        """Elements held by one tensor-parallel rank.

        KV projections with fewer KV heads than ``tp`` are replicated head by head (each rank holds
        one head), as Megatron-LM does for ``num_query_groups < tp``.
        """
        if self.split == "replicated" or tp == 1 and self.split != "vocab":
            return self.numel
        if self.split == "vocab":
            rows = padded_vocab if padded_vocab is not None else self.shape[0]
            return -(-rows // tp) * (self.shape[1] if len(self.shape) > 1 else 1)
        dim = 0 if self.split == "column" else 1
        full = self.shape[dim]
        part = max(full // tp, 1) if full % tp == 0 or full < tp else -(-full // tp)
        rest = self.numel // full
        return part * rest


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Vocabulary padded as Megatron-LM does before splitting it across TP ranks.

    Megatron-LM ``megatron/training/tokenizer/tokenizer.py`` (``_vocab_size_with_padding``) rounds
    the vocabulary up to a multiple of ``make_vocab_size_divisible_by`` (default 128) x tp.
    """
    m = divisible_by * tp
    return -(-vocab_size // m) * m


def param_tensors(m: ModelConfig) -> list[ParamTensor]:
    """Every parameter tensor of ``m`` in registration (``named_parameters``) order.

    The order is the Hugging Face modules' order: input embeddings (and learned positions), then
    per layer input norm, Q, K, V, O projections (with their biases), post-attention norm, MLP
    (router then experts then shared experts for MoE layers), then final norm and output layer
    (absent when embeddings are tied). PyTorch DDP fills gradient buckets in the reverse of this
    order (``torch/nn/parallel/distributed.py``: parameters reversed before
    ``_compute_bucket_assignment_by_size``).
    """
    h, kv, ffn = m.hidden_size, m.kv_size, m.intermediate_size
    out: list[ParamTensor] = [ParamTensor("embed_tokens.weight", (m.vocab_size, h), -1, "vocab", where="first")]
    if m.position_embedding == "learned":
        out.append(ParamTensor("embed_positions.weight", (m.max_position_embeddings or 2048, h), -1,
                               "replicated", where="first"))
    ln = m.norm == "layernorm"

    def norm(prefix: str, layer: int, where: str = "layer") -> list[ParamTensor]:
        r = [ParamTensor(f"{prefix}.weight", (h,), layer, "replicated", where=where)]
        if ln:
            r.append(ParamTensor(f"{prefix}.bias", (h,), layer, "replicated", where=where))
        return r

    def mlp(prefix: str, layer: int, inter: int, expert: int = -1) -> list[ParamTensor]:
        r = []
        names = ("gate_proj", "up_proj") if m.gated_mlp else ("up_proj",)
        for nm in names:
            r.append(ParamTensor(f"{prefix}.{nm}.weight", (inter, h), layer, "column", expert))
            if m.mlp_bias:
                r.append(ParamTensor(f"{prefix}.{nm}.bias", (inter,), layer, "column", expert))
        r.append(ParamTensor(f"{prefix}.down_proj.weight", (h, inter), layer, "row", expert))
        if m.mlp_bias:
            r.append(ParamTensor(f"{prefix}.down_proj.bias", (h,), layer, "replicated", expert))
        return r

    for i in range(m.num_hidden_layers):
        p = f"layers.{i}"
        out += norm(f"{p}.input_layernorm", i)
        for nm, rows in (("q_proj", m.q_size), ("k_proj", kv), ("v_proj", kv)):
            out.append(ParamTensor(f"{p}.self_attn.{nm}.weight", (rows, h), i, "column"))
            if m.attention_bias:
                out.append(ParamTensor(f"{p}.self_attn.{nm}.bias", (rows,), i, "column"))
        out.append(ParamTensor(f"{p}.self_attn.o_proj.weight", (h, m.q_size), i, "row"))
        if m.attention_out_bias:
            out.append(ParamTensor(f"{p}.self_attn.o_proj.bias", (h,), i, "replicated"))
        out += norm(f"{p}.post_attention_layernorm", i)
        if m.is_moe_layer(i):
            inter = m.moe_intermediate_size or ffn
            out.append(ParamTensor(f"{p}.mlp.router.weight", (m.num_local_experts, h), i, "replicated"))
            for e in range(m.num_local_experts):
                out += mlp(f"{p}.mlp.experts.{e}", i, inter, expert=e)
            for e in range(m.num_shared_experts):
                out += mlp(f"{p}.mlp.shared_experts.{e}", i, inter)
        else:
            out += mlp(f"{p}.mlp", i, ffn)
    out += norm("norm", -1, where="last")
    if not m.tie_word_embeddings:
        out.append(ParamTensor("lm_head.weight", (m.vocab_size, h), -1, "vocab", where="last"))
    return out


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model (elements, not bytes).

    ``total`` counts every tensor once (tied embeddings once), as published model cards do;
    ``active`` counts the parameters one token uses (top-k routed experts plus shared ones);
    ``embedding`` the input embedding (and learned positions); ``output`` the untied output layer.
    """

    total: int
    active: int
    embedding: int
    output: int
    per_layer: tuple[int, ...]


def count_parameters(m: ModelConfig) -> ParamCounts:
    """Total, active and per-layer parameter counts of ``m`` (see :class:`ParamCounts`)."""
    per_layer = [0] * m.num_hidden_layers
    total = emb = outp = 0
    expert_numel: dict[int, int] = {}
    for t in param_tensors(m):
        total += t.numel
        if t.layer >= 0:
            per_layer[t.layer] += t.numel
            if t.expert >= 0:
                expert_numel[t.layer] = expert_numel.get(t.layer, 0) + t.numel
        elif t.where == "first":
            emb += t.numel
        elif t.name.startswith("lm_head"):
            outp += t.numel
    inactive = sum(n * (m.num_local_experts - m.num_experts_per_tok) // m.num_local_experts
                   for n in expert_numel.values())
    return ParamCounts(total=total, active=total - inactive, embedding=emb, output=outp,
                       per_layer=tuple(per_layer))


def stage_layers(num_layers: int, pp: int, virtual_stages: int = 1, first: int = 0,
                 last: int = 0) -> list[list[int]]:
    """Global layer indices of each virtual pipeline stage (``pp * virtual_stages`` lists).

    Virtual stage ``c * pp + s`` lives on pipeline rank ``s`` as model chunk ``c`` (Megatron-LM's
    interleaved assignment, ``megatron/core/transformer/transformer_block.py``). ``first``/``last``
    (Megatron-LM ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``; 0 =
    even split) give the first and last pipeline ranks fewer layers, as Llama 3 405B training did
    (one layer fewer on the first and last stage: 126 layers on 16 stages, Llama 3 paper sec. 3.3.2).

    Raises
    ------
    PlanError : layers cannot be split as asked.
    """
    per_rank = [0] * pp
    if pp == 1 and (first or last):
        raise PlanError(f"plan $.parallelism.decoder_first/last_pipeline_num_layers: first/last stage layer counts need pipeline parallelism (pp > 1); "
                        f"with pp = 1 one stage holds every layer")
    if pp == 1:
        per_rank = [num_layers]
    else:
        rest, middle = num_layers, pp
        if first:
            per_rank[0] = first; rest -= first; middle -= 1
        if last:
            per_rank[-1] = last; rest -= last; middle -= 1
        if rest < 0:
            raise PlanError(f"plan $.parallelism.decoder_first/last_pipeline_num_layers: first/last stage layers {first} + {last} exceed num_hidden_layers = {num_layers}")
        if 0 < middle > rest:
            raise PlanError(f"plan $.parallelism.decoder_first/last_pipeline_num_layers: first/last stage layers {first} + {last} leave {rest} of num_hidden_layers = "
                            f"{num_layers} for the {middle} other pipeline stages (at least one each)")
        if middle <= 0 and rest:
            raise PlanError(f"plan $.parallelism.decoder_first/last_pipeline_num_layers: with pp = {pp} the first and last stages hold every layer, so their "
                            f"counts {first} + {last} must add up to num_hidden_layers = {num_layers}")
        if middle and rest % middle:
            raise PlanError(f"plan $.parallelism.decoder_first/last_pipeline_num_layers: num_hidden_layers = {num_layers} minus first/last stage layers "
                            f"({first}/{last}) is not divisible by the {middle} other pipeline stages")
        for s in range(pp):
            if not ((s == 0 and first) or (s == pp - 1 and last)):
                per_rank[s] = rest // middle if middle else 0
    for s, n in enumerate(per_rank):
        if n % virtual_stages or n <= 0:
            raise PlanError(f"plan: pipeline stage {s} has {n} layers, not a positive multiple of "
                            f"virtual_stages = {virtual_stages}")
    # Virtual stages are ordered chunk-major (all ranks' chunk 0, then chunk 1, ...); chunk c of
    # rank s holds per_rank[s] / virtual_stages consecutive layers.
    out: list[list[int]] = []
    acc = 0
    for _chunk in range(virtual_stages):
        for s in range(pp):
            n = per_rank[s] // virtual_stages
            out.append(list(range(acc, acc + n)))
            acc += n
    return out


def stage_parameter_counts(m: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1, virtual_stages: int = 1,
                           first: int = 0, last: int = 0, vocab_divisible_by: int = 128) -> list[int]:
    """Parameters held by one GPU of each pipeline stage (elements), Megatron-LM placement.

    A GPU of stage ``s`` holds the TP shard (:meth:`ParamTensor.shard_numel`, vocabulary padded as
    :func:`padded_vocab_size`) of its layers (all its virtual-stage chunks), of its ``1/ep`` share of
    each MoE layer's routed experts, of the input embeddings on stage 0, and of the final norm and
    output layer on the last stage; with tied embeddings and ``pp > 1`` the last stage keeps its own
    copy of the embedding as output layer (Megatron-LM ``shared_embedding_or_output_weight``).

    Raises
    ------
    PlanError : the layers cannot be split as asked (:func:`stage_layers`).
    """
    layers = stage_layers(m.num_hidden_layers, pp, virtual_stages, first, last)
    vpad = padded_vocab_size(m.vocab_size, tp, vocab_divisible_by)
    per_ep = max(m.num_local_experts // ep, 1)
    owner = {}
    for v, ls in enumerate(layers):
        for layer in ls:
            owner[layer] = v % pp
    out = [0] * pp
    tensors = param_tensors(m)
    for t in tensors:
        if t.expert >= per_ep:
            continue
        n = t.shard_numel(tp, vpad)
        if t.layer >= 0:
            out[owner[t.layer]] += n
        elif t.where == "first":
            out[0] += n
        else:
            out[pp - 1] += n
    if m.tie_word_embeddings and pp > 1:
        out[pp - 1] += tensors[0].shard_numel(tp, vpad)
    return out
