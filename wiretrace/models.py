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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 1


_GPT2 = dict(tie_word_embeddings=True, gated_mlp=False, attention_bias=True, mlp_bias=True,
             norm="layernorm", position_embedding="learned", hidden_act="gelu_new", vocab_size=50257)
_LLAMA3 = dict(num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, gated_mlp=True,
               norm="rmsnorm", position_embedding="rope", hidden_act="silu")

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-small": dict(_GPT2, num_hidden_layers=12, hidden_size=768, intermediate_size=3072,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024),
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
    """Read a Hugging Face ``config.json`` (Llama, Mistral/Mixtral, Qwen2, GPT-2 families).

    GPT-2 configs use ``n_layer``/``n_embd``/``n_head``/``n_inner``/``n_positions``; they are mapped
    to the Llama names. Raises :class:`PlanError` naming the file when it cannot be read or lacks
    the dimensions.
    """
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"model.hf_config: cannot read {path}: {e}") from None
    mt = str(cfg.get("model_type", ""))
    if mt == "gpt2" or "n_embd" in cfg:
        d = dict(_GPT2)
        d.update(num_hidden_layers=cfg["n_layer"], hidden_size=cfg["n_embd"],
                 num_attention_heads=cfg["n_head"], num_key_value_heads=cfg["n_head"],
                 intermediate_size=cfg.get("n_inner") or 4 * cfg["n_embd"],
                 vocab_size=cfg.get("vocab_size", 50257),
                 max_position_embeddings=cfg.get("n_positions", 1024),
                 tie_word_embeddings=cfg.get("tie_word_embeddings", True))
        return from_dims(cfg.get("_name_or_path") or Path(path).parent.name or "gpt2", d)
    need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise PlanError(f"model.hf_config: {path} lacks {', '.join(missing)}")
    d = dict(cfg)
    d.setdefault("tie_word_embeddings", False)
    d["gated_mlp"] = True
    d.setdefault("norm", "rmsnorm")
    d.setdefault("position_embedding", "rope")
    if mt == "qwen2":
        d.setdefault("attention_bias", True)  # Qwen2 has q/k/v biases (modeling_qwen2.py)
    if "num_local_experts" in cfg:
        d["moe_intermediate_size"] = cfg.get("intermediate_size")
    return from_dims(cfg.get("_name_or_path") or Path(path).parent.name or mt or "hf", d)


def resolve(spec: Mapping[str, Any], base_dir: Path | None = None) -> ModelConfig:
    """Resolve a plan's ``model`` section (preset, hf_config or dimensions) to a ModelConfig.

    Fields given beside a preset or hf_config override it. Raises :class:`PlanError` for an
    unknown preset (naming the known ones) or an unreadable config.
    """
    spec = dict(spec)
    if "preset" in spec:
        name = spec.pop("preset")
        if name not in PRESETS:
            raise PlanError(f"model.preset: unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        dims = dict(PRESETS[name]); dims.update(spec)
        return from_dims(name, dims)
    if "hf_config" in spec:
        p = Path(spec.pop("hf_config"))
        if base_dir is not None and not p.is_absolute():
            p = base_dir / p
        base = from_hf_config(p)
        return dataclasses.replace(base, **{k: v for k, v in spec.items() if k in _FIELDS})
    return from_dims(spec.get("name", "custom"), spec)
