"""Model presets, Hugging Face configs and parameter counts against published figures."""

from __future__ import annotations

import json

import pytest

from wiretrace.errors import PlanError
from wiretrace.models import (PRESETS, count_parameters, padded_vocab_size, param_tensors, resolve,
                              stage_layers, stage_parameter_counts)


def total(name: str) -> int:
    return count_parameters(resolve({"preset": name})).total


def test_gpt2_small_total():
    """GPT-2 small: 124,439,808 parameters (Hugging Face ``gpt2`` model page, "124M params";
    the exact figure is the element count of ``model.safetensors``: wte 50257x768, wpe 1024x768,
    12 x (12 h^2 + 13 h), ln_f)."""
    assert total("gpt2-small") == 124_439_808


def test_gpt2_xl_total():
    """GPT-2 XL: 1,557,611,200 parameters (Hugging Face ``gpt2-xl``, "1.56B params"; Radford et al.
    2019 table 2 rounds it to 1542M counting without positions/biases differently)."""
    assert total("gpt2-xl") == 1_557_611_200


def test_gpt3_175b_total():
    """GPT-3 175B: "175.0B" parameters (Brown et al. 2020, "Language Models are Few-Shot
    Learners", table 2.1: n_params 175.0B, 96 layers, d_model 12288, 96 heads, context 2048)."""
    n = total("gpt3-175b")
    assert round(n / 1e9) == 175
    assert abs(n - 175.0e9) / 175.0e9 < 0.005


def test_llama3_totals():
    """Llama 3: 8,030,261,248 (8B) and 70,553,706,496 (70B) parameters — the element counts of
    Meta's released safetensors (``model.safetensors.index.json`` ``total_size`` / 2 bytes of bf16:
    16,060,522,496 and 141,107,412,992), shown as "8.03B" and "70.6B params" on the Hugging Face
    model pages; 405B is shown there as "406B params" (Llama 3 paper, Dubey et al. 2024, table 3
    calls it 405B)."""
    assert total("llama3-8b") == 8_030_261_248
    assert total("llama3-70b") == 70_553_706_496
    n405 = total("llama3-405b")
    assert round(n405 / 1e9) == 406 and 405e9 <= n405 < 406.5e9


def test_mixtral_total_and_active():
    """Mixtral 8x7B: "46.7B total parameters but only uses 12.9B parameters per token" (Mistral AI,
    "Mixtral of experts", 11 Dec 2023; Jiang et al. 2024, sec. 2)."""
    c = count_parameters(resolve({"preset": "mixtral-8x7b"}))
    assert round(c.total / 1e8) == 467
    assert round(c.active / 1e8) == 129


def test_more_presets_against_published_counts():
    """GPT-2 medium 354,823,168 and large 774,030,080 (Hugging Face ``gpt2-medium`` "355M params",
    ``gpt2-large`` "774M params"); Mistral 7B 7,241,732,096 ("7.24B params" on
    mistralai/Mistral-7B-v0.1); Qwen2-7B 7,615,616,512 ("7.62B params" on Qwen/Qwen2-7B, and
    Qwen2 technical report table 1: 7.6B)."""
    assert total("gpt2-medium") == 354_823_168
    assert total("gpt2-large") == 774_030_080
    assert total("mistral-7b") == 7_241_732_096
    assert total("qwen2-7b") == 7_615_616_512


def test_presets_required_by_the_plan_format():
    for name in ("gpt2-small", "gpt2-xl", "gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b",
                 "mixtral-8x7b"):
        assert name in PRESETS


def test_tensor_shapes_gqa_swiglu():
    """Llama 3 8B layer: q 4096x4096, k/v 1024x4096 (8 KV heads of 128), o 4096x4096, SwiGLU gate/up
    14336x4096 and down 4096x14336, two RMSNorm weights, no biases."""
    ts = {t.name: t for t in param_tensors(resolve({"preset": "llama3-8b"})) if t.layer == 0}
    assert ts["layers.0.self_attn.q_proj.weight"].shape == (4096, 4096)
    assert ts["layers.0.self_attn.k_proj.weight"].shape == (1024, 4096)
    assert ts["layers.0.self_attn.v_proj.weight"].shape == (1024, 4096)
    assert ts["layers.0.mlp.gate_proj.weight"].shape == (14336, 4096)
    assert ts["layers.0.mlp.down_proj.weight"].shape == (4096, 14336)
    assert not any(n.endswith(".bias") for n in ts)
    assert len(ts) == 9


def test_tensor_shapes_gelu_with_biases():
    """GPT-2: GELU MLP of two matrices (4h), biases on attention and MLP, LayerNorm weight+bias."""
    ts = {t.name: t for t in param_tensors(resolve({"preset": "gpt2-small"})) if t.layer == 0}
    assert "layers.0.mlp.gate_proj.weight" not in ts
    assert ts["layers.0.mlp.up_proj.weight"].shape == (3072, 768)
    assert ts["layers.0.mlp.up_proj.bias"].shape == (3072,)
    assert ts["layers.0.self_attn.o_proj.bias"].shape == (768,)
    assert ts["layers.0.input_layernorm.bias"].shape == (768,)
    assert sum(t.numel for t in ts.values()) == 12 * 768 ** 2 + 13 * 768


def test_tp_shards_llama3_8b():
    """Megatron-LM splits column-parallel rows and row-parallel columns by tp; the vocabulary is
    padded to a multiple of 128 x tp (``_vocab_size_with_padding``): 128256 = 125.25 x 1024 becomes
    126 x 1024 = 129024, so the embedding shard is 16128 x 4096."""
    m = resolve({"preset": "llama3-8b"})
    assert padded_vocab_size(m.vocab_size, 8) == 129024
    assert padded_vocab_size(50257, 4) == 50688
    per = {t.name: t.shard_numel(8, 129024) for t in param_tensors(m)}
    assert per["embed_tokens.weight"] == 16128 * 4096
    assert per["layers.0.self_attn.q_proj.weight"] == 512 * 4096
    assert per["layers.0.self_attn.k_proj.weight"] == 128 * 4096
    assert per["layers.0.self_attn.o_proj.weight"] == 4096 * 512
    assert per["layers.0.mlp.up_proj.weight"] == 1792 * 4096
    assert per["layers.0.input_layernorm.weight"] == 4096
    layer = sum(v for k, v in per.items() if k.startswith("layers.0."))
    assert layer == (218_112_000 - 8192) // 8 + 8192


def test_stage_layers_even_uneven_interleaved():
    """Even split, Llama 3 405B's 7 + 14x8 + 7 split, and Megatron-LM's interleaved assignment
    (16 layers, pp 4, 2 chunks: GPU 0 holds layers 1-2 and 9-10, parallel_state.py docstring)."""
    assert stage_layers(32, 2) == [list(range(16)), list(range(16, 32))]
    st = stage_layers(126, 16, 1, 7, 7)
    assert [len(x) for x in st] == [7] + [8] * 14 + [7]
    assert st[-1][-1] == 125
    inter = stage_layers(16, 4, 2)
    assert inter[0] == [0, 1] and inter[4] == [8, 9] and inter[3] == [6, 7] and inter[7] == [14, 15]
    with pytest.raises(PlanError, match="not divisible"):
        stage_layers(126, 16, 1, 7, 6)


def _write(tmp_path, cfg: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_hf_config_llama(tmp_path):
    """Meta-Llama-3-8B ``config.json`` fields give the published 8,030,261,248."""
    p = _write(tmp_path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                          "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                          "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                          "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
                          "attention_bias": False, "max_position_embeddings": 8192, "hidden_act": "silu"})
    m = resolve({"hf_config": str(p)})
    assert count_parameters(m).total == 8_030_261_248


def test_hf_config_mistral(tmp_path):
    """Mistral-7B-v0.1 ``config.json``: 7,241,732,096 parameters ("7.24B params" on its Hugging Face
    page; Jiang et al. 2023 call it 7B)."""
    p = _write(tmp_path, {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                          "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                          "vocab_size": 32000, "sliding_window": 4096, "tie_word_embeddings": False})
    assert count_parameters(resolve({"hf_config": str(p)})).total == 7_241_732_096


def test_hf_config_mixtral(tmp_path):
    """Mixtral-8x7B-v0.1 ``config.json`` (num_local_experts 8, num_experts_per_tok 2): 46.7B total,
    12.9B active (Mistral AI announcement)."""
    p = _write(tmp_path, {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                          "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                          "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
                          "router_aux_loss_coef": 0.02, "tie_word_embeddings": False})
    m = resolve({"hf_config": str(p)})
    c = count_parameters(m)
    assert m.is_moe and m.moe_intermediate_size == 14336
    assert c.total == count_parameters(resolve({"preset": "mixtral-8x7b"})).total == 46_702_792_704
    assert round(c.active / 1e8) == 129


def test_hf_config_qwen2(tmp_path):
    """Qwen2-0.5B ``config.json`` (q/k/v biases, tied embeddings, 2 KV heads of 64): 494,032,768
    parameters ("494M params" on the Hugging Face page of Qwen/Qwen2-0.5B)."""
    p = _write(tmp_path, {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                          "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
                          "vocab_size": 151936, "tie_word_embeddings": True, "max_window_layers": 24})
    m = resolve({"hf_config": str(p)})
    names = {t.name for t in param_tensors(m)}
    assert "layers.0.self_attn.k_proj.bias" in names and "layers.0.self_attn.o_proj.bias" not in names
    assert count_parameters(m).total == 494_032_768


def test_hf_config_gpt2(tmp_path):
    """The ``gpt2`` config.json (n_inner null means 4 x n_embd) gives GPT-2 small's 124,439,808."""
    p = _write(tmp_path, {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                          "n_inner": None, "n_positions": 1024, "vocab_size": 50257,
                          "activation_function": "gelu_new"})
    assert count_parameters(resolve({"hf_config": str(p)})).total == 124_439_808


def test_hf_config_errors(tmp_path):
    with pytest.raises(PlanError, match="lacks num_attention_heads"):
        resolve({"hf_config": str(_write(tmp_path, {"model_type": "llama", "hidden_size": 8,
                                                    "num_hidden_layers": 2, "vocab_size": 10}))})
    with pytest.raises(PlanError, match="model_type 't5'"):
        resolve({"hf_config": str(_write(tmp_path, {"model_type": "t5", "hidden_size": 8, "num_hidden_layers": 2,
                                                    "num_attention_heads": 2, "vocab_size": 10}))})
    with pytest.raises(PlanError, match="cannot read"):
        resolve({"hf_config": str(tmp_path / "missing.json")})
    with pytest.raises(PlanError, match="unknown preset"):
        resolve({"preset": "llama9"})


def test_moe_layer_frequency_and_shared_experts():
    """Every second layer MoE (moe_layer_freq 2) with one shared expert: MoE layers hold
    E + 1 expert MLPs and a router, dense layers one MLP."""
    m = resolve({"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 256,
                 "num_attention_heads": 4, "vocab_size": 100, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "num_shared_experts": 1, "moe_intermediate_size": 128,
                 "moe_layer_freq": 2})
    assert [m.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    c = count_parameters(m)
    attn = 4 * 64 * 64 + 2 * 64
    assert c.per_layer[1] == attn + 3 * 64 * 256
    assert c.per_layer[0] == attn + 4 * 64 + 5 * 3 * 64 * 128
    # active: router + shared + 2 of 4 routed experts
    assert c.total - c.active == 2 * (2 * 3 * 64 * 128)


def test_parameters_per_gpu_tp_pp_ep():
    """Llama 3 8B on tp 8, pp 2 (the llama3-8b-4x8 sample): a layer shard is
    (2 x 4096^2 + 2 x 1024 x 4096 + 3 x 4096 x 14336) / 8 + 2 x 4096 = 27,271,168; stage 0 adds
    the embedding shard 16128 x 4096, stage 1 the final norm and the output-layer shard."""
    m = resolve({"preset": "llama3-8b"})
    layer = (2 * 4096 ** 2 + 2 * 1024 * 4096 + 3 * 4096 * 14336) // 8 + 2 * 4096
    assert layer == 27_271_168
    assert stage_parameter_counts(m, tp=8, pp=2) == [16 * layer + 16128 * 4096, 16 * layer + 4096 + 16128 * 4096]
    # Mixtral with ep 8: one expert per GPU per layer; with ep 1 all eight
    mx = resolve({"preset": "mixtral-8x7b"})
    expert = 3 * 4096 * 14336
    dense_layer = 2 * 4096 ** 2 + 2 * 1024 * 4096 + 8 * 4096 + 2 * 4096
    assert stage_parameter_counts(mx, ep=8)[0] == 32 * (dense_layer + expert) + 2 * 32000 * 4096 + 4096
    assert stage_parameter_counts(mx)[0] == count_parameters(mx).total
    # tied GPT-2 on pp 2: the last stage keeps a copy of the (padded) embedding as output layer
    g = resolve({"preset": "gpt2-small"})
    st = stage_parameter_counts(g, pp=2)
    assert st[1] - st[0] == (2 * 768 + 50304 * 768) - (50304 * 768 + 1024 * 768)
    assert sum(st) == count_parameters(g).total + 50304 * 768 + (50304 - 50257) * 768


def test_plan_with_hf_config_beside_it(tmp_path):
    """``{"hf_config": path}`` is read relative to the plan file; fields given beside it override."""
    from wiretrace import plan as P

    (tmp_path / "qwen").mkdir()
    _write(tmp_path / "qwen", {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                               "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
                               "vocab_size": 151936, "tie_word_embeddings": True})
    doc = {"model": {"hf_config": "qwen/config.json", "num_hidden_layers": 12},
           "parallelism": {"tp": 2, "pp": 2}, "cluster": {"nodes": 1, "gpus_per_node": 4}}
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    plan = P.load(tmp_path / "plan.json")
    assert plan.model.num_hidden_layers == 12 and plan.model.num_key_value_heads == 2
    assert plan.model.attention_bias and not plan.model.attention_out_bias
