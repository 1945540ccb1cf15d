"""``wiretrace explain``: the six sections on the demo plan and the real corpus, link accounting
against the nccl-tests bus-bandwidth factors, and the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from wiretrace import plan as P
from wiretrace.explain import explain, link_bytes, render
from wiretrace.tables import to_arrow

from conftest import SAMPLES, SHARED, run_cli

CORPUS = SHARED / "data" / "divina_commedia.txt"
DEMO = SAMPLES / "gpt2-small-2x4.json"
ACT = 4 * 1024 * 768 * 2          # b s h bf16 of the demo plan (micro-batch 4, seq 1024)


@pytest.fixture(scope="module")
def report():
    return explain(P.load(DEMO), corpus=CORPUS)


def test_parameters_and_tokens(report):
    """GPT-2 small has 124,439,808 parameters (Hugging Face gpt2 page, 124M); the corpus section
    trains a BPE at GPT-2's vocabulary and counts sequences of the plan's 1024 tokens."""
    assert report["parameters"]["total"] == 124_439_808
    tok = report["tokens"]
    assert tok["vocab_target"] == 50257 and tok["seq_length"] == 1024 and tok["global_batch_size"] == 16
    assert tok["sequences"] == (tok["tokens"] - 1) // 1024
    # the fullest GPU holds a TP shard of everything (pp 1): vocab padded to 50688 -> 12672 rows
    h = 768
    shard = 12672 * h + 1024 * h + 12 * (3 * h * h // 4 + 3 * h // 4 + h * h // 4 + h + 4 * h * h // 4
                                          + 4 * h // 4 + 4 * h * h // 4 + h + 4 * h) + 2 * h
    assert report["parameters"]["max_per_gpu"] == shard


def test_embedding_and_block_shapes(report):
    """One TP rank of 4: 3 of 12 heads of 64, MLP 3072/4, embedding shard 50688/4 x 768."""
    emb = {t["name"]: t for t in report["embedding"]["tensors"]}
    assert emb["embed_tokens.weight (shard)"]["shape"] == [12672, 768]
    assert emb["input_ids"]["bytes"] == 4 * 1024 * 8
    fwd = {t["name"]: t for t in report["block"]["forward"]}
    assert fwd["Q"]["shape"] == [4, 1024, 3, 64] and fwd["Q"]["bytes"] == 4 * 1024 * 3 * 64 * 2
    assert fwd["attention scores"]["shape"] == [4, 3, 1024, 1024]
    assert fwd["up_proj out"]["shape"] == [4, 1024, 768]
    assert "gate_proj out" not in fwd
    blk = report["block"]
    # Korthikanti et al. 2022 table 2, tensor parallelism without SP: sbh(10 + 24/t + 5as/(ht))
    sbh = 1024 * 4 * 768
    assert blk["korthikanti_bytes"] == int(sbh * (10 + 24 / 4 + 5 * 12 * 1024 / (768 * 4)))
    assert blk["stage0_layers"] == 12 and blk["microbatches_in_flight"] == 1
    assert blk["activations_stage0_bytes"] == 12 * blk["activations_kept_bytes"]


def test_parallelism_totals(report):
    """TP: (2 x 12 forward + 2 x 12 backward + embedding + output layer) all-reduces of b s h per
    micro-batch (2) per TP group (2), plus 3 fp32 cross-entropy all-reduces of b s x 4 bytes."""
    tot = report["parallelism"]["totals"]
    assert tot["tp"]["bytes"] == 50 * 2 * 2 * ACT + 3 * 2 * 2 * (4 * 1024 * 4)
    assert tot["tp"]["calls"] == 53 * 2 * 2
    assert set(tot) == {"tp", "dp"}


def test_network_split_follows_busbw_factors(report):
    """TP groups sit inside a node: a ring all-reduce of S over 4 ranks moves 2(n-1)/n S = 1.5 S per
    rank, 6 S per call, all on NVLink. Each DP group pairs one GPU of each node: 2(2-1)/2 S = S per
    rank, both hops on the network."""
    net = report["network"]["per_parallelism"]
    tot = report["parallelism"]["totals"]
    assert net["tp"]["network_bytes"] == 0 and net["tp"]["nvlink_bytes"] == 6 * tot["tp"]["bytes"]
    assert net["dp"]["nvlink_bytes"] == 0 and net["dp"]["network_bytes"] == 2 * tot["dp"]["bytes"]
    assert report["network"]["total"]["network_bytes_per_gpu"] == round(2 * tot["dp"]["bytes"] / 8)
    ar = [r for r in report["parallelism"]["rows"] if r["tensor"] == "attn.out_proj.activation"][0]
    assert ar["busbw_factor"] == 1.5 and ar["sent_per_rank_min"] == ar["sent_per_rank_max"] == 1.5 * ACT
    assert ar["nvlink_bytes"] == 6 * ACT * ar["calls"] and ar["network_bytes"] == 0
    ce = [r for r in report["parallelism"]["rows"] if r["tensor"] == "loss.sum_exp_logits"][0]
    assert ce["sent_per_rank_max"] == 1.5 * 4 * 1024 * 4


def _table(rows: list[dict]):
    cols = {k: [] for k in ("op_id", "iteration", "op", "parallelism", "group", "ranks", "group_size",
                            "bytes_global", "bytes_per_rank", "dtype", "phase", "layer", "microbatch", "stage",
                            "tensor", "src", "dst", "algorithm", "t_ready_ns", "source")}
    for i, r in enumerate(rows):
        d = {"op_id": i, "iteration": 0, "parallelism": "other", "group": i, "group_size": len(r["ranks"]),
             "bytes_per_rank": r.get("bytes_global", 0), "dtype": "bf16", "phase": "forward", "layer": -1,
             "microbatch": -1, "stage": -1, "tensor": "x", "src": -1, "dst": -1, "algorithm": "ring",
             "t_ready_ns": 0, "source": "test"}
        d.update(r)
        for k in cols:
            cols[k].append(d[k])
    return to_arrow("collectives", {k: np.array(v) if k != "ranks" else v for k, v in cols.items()})


def test_link_bytes_by_hand():
    """8 GPUs per node. Ring all_reduce of 1000 B over [0, 1, 8, 9]: every rank sends 1.5 x 1000 to
    its successor; hops 0->1 and 8->9 are NVLink, 1->8 and 9->0 network. all_to_all of 400 B per
    rank over the same group: 100 B to each peer, 8 of the 12 ordered pairs cross nodes. send_recv
    0 -> 8 of 500 B: network; 0 -> 1: NVLink. all_gather of 800 over [0, 8]: (n-1)/n = 1/2 per rank."""
    t = _table([
        {"op": "all_reduce", "ranks": [0, 1, 8, 9], "bytes_global": 1000},
        {"op": "all_to_all", "ranks": [0, 1, 8, 9], "bytes_global": 1600, "bytes_per_rank": 400},
        {"op": "send_recv", "ranks": [0, 8], "bytes_global": 500, "src": 0, "dst": 8},
        {"op": "send_recv", "ranks": [0, 1], "bytes_global": 500, "src": 0, "dst": 1},
        {"op": "all_gather", "ranks": [0, 8], "bytes_global": 800, "bytes_per_rank": 400},
    ])
    nv, net = link_bytes(t, 8)
    assert net.tolist() == [3000.0, 800.0, 500.0, 0.0, 800.0]
    assert nv.tolist() == [3000.0, 400.0, 0.0, 500.0, 0.0]


def test_render_has_the_six_sections(report):
    from io import StringIO

    from rich.console import Console

    buf = StringIO()
    render(report, Console(file=buf, width=160))
    out = buf.getvalue()
    for title in ("1. text -> tokens", "2. tokens -> vectors", "3. one transformer block", "4. parallelism",
                  "5. collectives -> network", "6. time"):
        assert title in out
    assert "124,439,808 parameters" in out and "grad.bucket*" in out


def test_cli_json_and_errors(tmp_path):
    proc = run_cli("explain", "--plan", SAMPLES / "llama3-8b-4x8.json", "--json", check=True)
    rep = json.loads(proc.stdout)
    assert rep["parameters"]["total"] == 8_030_261_248
    assert rep["tokens"] is None
    assert set(rep["parallelism"]["totals"]) == {"tp", "pp", "dp"}
    assert rep["time"]["total_ns"] == rep["time"]["compute_ns"] + rep["time"]["bubble_ns"] + rep["time"]["exposed_comm_ns"]
    bad = run_cli("explain", "--plan", DEMO, "--tokenizer", tmp_path / "tokenizer.json")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --tokenizer needs --corpus (the text to count tokens of)"
    missing = run_cli("explain", "--plan", DEMO, "--corpus", tmp_path / "none.txt")
    assert missing.returncode == 2 and "none.txt: no such file" in missing.stderr
