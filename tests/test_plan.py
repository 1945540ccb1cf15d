"""Plan loading: schema validation with JSON paths, defaults, consistency checks, unit parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wiretrace import plan as P
from wiretrace.errors import PlanError

from conftest import SAMPLES

BASE = {
    "model": {"preset": "llama3-8b"},
    "parallelism": {"tp": 8, "pp": 2, "dp": 2},
    "cluster": {"nodes": 4, "gpus_per_node": 8},
}


def doc(**over):
    d = json.loads(json.dumps(BASE))
    for k, v in over.items():
        d[k] = v
    return d


def test_samples_load():
    p = P.load(SAMPLES / "llama3-8b-4x8.json")
    assert p.model.hidden_size == 4096 and p.model.num_key_value_heads == 8
    assert p.num_microbatches == 64 // (1 * 2)
    assert p.cluster.nic_rate_bps == 400e9
    assert p.cluster.nvlink_rate_bps == 450e9 * 8      # 900 GB/s is both directions together
    assert p.cluster.latency_ns == 2000
    d = P.load(SAMPLES / "gpt2-small-2x4.json")
    assert d.parallelism.tp == 4 and d.parallelism.dp == 2 and d.cluster.world_size == 8


def test_defaults_fill_every_optional_section():
    p = P.from_dict(doc())
    assert p.training.seq_length == 2048 and p.training.micro_batch_size == 1
    assert p.training.global_batch_size == 2          # one micro-batch per DP replica
    assert p.training.dp_bucket_bytes == 25 * 1024 * 1024
    assert p.collectives.step_bytes == 512 * 1024 and p.collectives.cts is True
    assert p.transport.path_mtu == 4096 and p.transport.dscp == 26 and p.transport.ecn_bits == 2
    assert p.cluster.nics_per_node == 8 and p.parallelism.order == "tp-cp-ep-dp-pp"


@pytest.mark.parametrize("text,bits", [("400Gbps", 400e9), ("900GB/s", 7.2e12), ("100 Gbps", 100e9),
                                       ("25GB/s", 200e9), ("1.5Tbps", 1.5e12)])
def test_parse_rate(text, bits):
    assert P.parse_rate(text) == bits


@pytest.mark.parametrize("text,ns", [("2us", 2000), ("500ns", 500), ("1.5ms", 1_500_000), ("1s", 10**9)])
def test_parse_duration(text, ns):
    assert P.parse_duration_ns(text) == ns


@pytest.mark.parametrize("value,n", [("25MiB", 26214400), ("512KiB", 524288), (4096, 4096), ("1GB", 10**9)])
def test_parse_size(value, n):
    assert P.parse_size(value) == n


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: d["cluster"].update(nodes="four"), "$.cluster.nodes"),
    (lambda d: d["cluster"].update(nic_rate="fast"), "$.cluster.nic_rate"),
    (lambda d: d.update(transport={"path_mtu": 1500}), "$.transport.path_mtu"),
    (lambda d: d["parallelism"].update(tensor=8), "$.parallelism"),
    (lambda d: d.pop("cluster"), "'cluster' is a required property"),
    (lambda d: d["training"].update(mfu=1.5) if "training" in d else d.update(training={"mfu": 1.5}), "$.training.mfu"),
])
def test_schema_errors_name_the_json_path(mutate, fragment):
    d = doc()
    mutate(d)
    with pytest.raises(PlanError) as e:
        P.from_dict(d)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("over,fragment", [
    ({"parallelism": {"tp": 8, "pp": 2, "dp": 1}}, "tp*cp*dp*pp = 8*1*1*2 = 16 but nodes*gpus_per_node = 4*8 = 32"),
    ({"model": {"preset": "llama3-8b", "num_attention_heads": 30, "num_key_value_heads": 6}},
     "num_attention_heads = 30 is not divisible by tp = 8"),
    ({"model": {"preset": "llama3-8b", "num_hidden_layers": 31}}, "num_hidden_layers = 31 is not divisible by pp*virtual_stages = 2*1"),
    ({"training": {"global_batch_size": 5}}, "global_batch_size = 5 is not divisible by micro_batch_size*dp = 1*2 = 2"),
    ({"model": {"preset": "llama9"}}, "plan $.model.preset: unknown preset 'llama9'"),
    ({"parallelism": {"tp": 16, "pp": 1, "dp": 2}}, "num_key_value_heads = 8 is not divisible by tp = 16"),
    ({"parallelism": {"tp": 8, "pp": 2, "dp": 2, "ep": 2}}, "ep = 2 but the model has no experts"),
    ({"cluster": {"nodes": 4, "gpus_per_node": 8, "nic_rate": "0Gbps"}}, "expected a rate above zero"),
    ({"collectives": {"step_bytes": 64}}, "plan $.collectives.step_bytes: 64 B is below the minimum 256 B"),
    ({"transport": {"kind": "ib", "dscp": 46}}, "plan $.transport.dscp: native InfiniBand frames have no IP header"),
    ({"transport": {"ecn_marking": {"fraction": 0}}}, "plan $.transport.ecn_marking.fraction: 0 marks nothing"),
    ({"parallelism": {"tp": 8, "pp": 1, "dp": 4, "pp_schedule": "interleaved", "virtual_stages": 2}},
     "plan $.parallelism.pp_schedule: interleaved needs pipeline parallelism (pp > 1)"),
    ({"parallelism": {"tp": 8, "pp": 1, "dp": 4, "decoder_first_pipeline_num_layers": 5}},
     "plan $.parallelism.decoder_first/last_pipeline_num_layers: first/last stage layer counts need pipeline "
     "parallelism (pp > 1)"),
    ({"transport": {"ack": {"window": "0us"}}}, "plan $.transport.ack.window: must be above 0"),
    ({"transport": {"ecn_marking": {"cnp_interval": "4us"}}}, "plan $.transport.ecn_marking: give fraction"),
    ({"seed": 2 ** 70}, "plan $.seed"),
    ({"parallelism": {"tp": 8, "pp": 2, "dp": 2, "virtual_stages": 2}},
     "plan $.parallelism.virtual_stages: 2 needs pp_schedule interleaved (1f1b runs one model chunk per pipeline rank)"),
    ({"model": {"preset": "gpt2-small"}, "parallelism": {"tp": 4, "pp": 2, "dp": 4},
      "training": {"seq_length": 2048}},
     "seq_length = 2048 exceeds the model's learned position table (max_position_embeddings = 1024)"),
    ({"parallelism": {"tp": 8, "pp": 2, "dp": 2, "decoder_first_pipeline_num_layers": 30,
                      "decoder_last_pipeline_num_layers": 7}},
     "first/last stage layers 30 + 7 exceed num_hidden_layers = 32"),
    ({"model": {"preset": "llama3-8b"}, "parallelism": {"tp": 8, "pp": 4, "dp": 1, "decoder_first_pipeline_num_layers": 20,
                                                       "decoder_last_pipeline_num_layers": 11}},
     "first/last stage layers 20 + 11 leave 1 of num_hidden_layers = 32 for the 2 other pipeline stages (at least one each)"),
])
def test_inconsistent_plans_name_both_numbers(over, fragment):
    with pytest.raises(PlanError) as e:
        P.from_dict(doc(**over))
    assert fragment in str(e.value)


def test_invalid_json_gives_line_and_column(tmp_path: Path):
    f = tmp_path / "p.json"
    f.write_text('{"model": {"preset": "gpt2-small"},\n "cluster": {nodes: 2}}')
    with pytest.raises(PlanError) as e:
        P.load(f)
    assert "line 2 column" in str(e.value)


def test_a_key_given_twice_is_refused(tmp_path: Path):
    """JSON parsers keep the last of two equal keys: a plan with "transport" twice would lose the
    first silently."""
    f = tmp_path / "p.json"
    f.write_text('{"model": {"preset": "gpt2-small"}, "transport": {"dscp": 46}, "transport": {},'
                 ' "cluster": {"nodes": 1, "gpus_per_node": 1}}')
    with pytest.raises(PlanError) as e:
        P.load(f)
    assert str(e.value) == (f"plan {f}: key 'transport' appears twice in one object (JSON would keep "
                            "only the last); remove one")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json_numbers(tmp_path: Path, constant):
    f = tmp_path / "p.json"
    f.write_text('{"model": {"preset": "gpt2-small"}, "training": {"mfu": %s}, '
                 '"cluster": {"nodes": 1, "gpus_per_node": 1}}' % constant)
    with pytest.raises(PlanError) as e:
        P.load(f)
    assert str(e.value) == f"plan {f}: {constant} is not a JSON number (give a number)"


def test_a_binary_file_given_as_plan_is_refused_in_one_line(tmp_path: Path):
    """A capture passed as ``--plan`` (its pcap magic is not UTF-8) is a PlanError naming the
    file, not a decoding traceback."""
    f = tmp_path / "iter.pcap"
    f.write_bytes(bytes.fromhex("4d3cb2a10200040000000000000000008000000001000000"))
    with pytest.raises(PlanError) as e:
        P.load(f)
    assert str(e.value) == f"plan {f}: not a JSON text file (byte 2 is not UTF-8)"


@pytest.mark.parametrize("value,kind", [([], "an array"), ("x", "a string"), (3, "a number"), (None, "null")])
def test_a_plan_that_is_not_a_json_object_is_named(value, kind, tmp_path: Path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(value))
    for require_model in (True, False):
        with pytest.raises(PlanError) as e:
            P.load(f, require_model=require_model)
        assert str(e.value) == f'plan: expected a JSON object ({{"model": ..., "cluster": ...}}), not {kind}'


def test_cluster_only_plan_for_measured_schedules():
    p = P.from_dict({"cluster": {"nodes": 2, "gpus_per_node": 8}}, require_model=False)
    assert p.model is None and p.cluster.world_size == 16


def test_hf_config_and_explicit_dims(tmp_path: Path):
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1376,
           "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = doc(model={"hf_config": "config.json"}, parallelism={"tp": 2, "pp": 2, "dp": 8})
    (tmp_path / "plan.json").write_text(json.dumps(d))
    p = P.load(tmp_path / "plan.json")
    assert (p.model.num_hidden_layers, p.model.hidden_size, p.model.num_key_value_heads) == (4, 512, 2)
    d = doc(model={"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1000},
            parallelism={"tp": 4, "pp": 2, "dp": 4})
    p = P.from_dict(d)
    assert p.model.intermediate_size == 1024 and p.model.num_key_value_heads == 4


def test_integral_floats_are_integers():
    p = P.from_dict(doc(parallelism={"tp": 8.0, "pp": 2, "dp": 2.0}))
    assert p.parallelism.tp == 8 and isinstance(p.parallelism.tp, int)
    assert P.from_dict(doc(training={"mfu": 1.0})).training.mfu == 1.0
