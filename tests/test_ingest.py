"""Measured schedules: every real file in ../shared/real gives the values its README lists, and
cut-off or garbled copies are reported line by line without crashing."""

from __future__ import annotations

import gzip
import json
import subprocess
from decimal import Decimal

import pyarrow.parquet as pq
import pytest

from wiretrace.errors import InputFormatError, WiretraceError
from wiretrace.ingest import detect_format, format_report, read_schedule
from wiretrace.ingest.nccl_tests import compare_busbw
from wiretrace.tables import check

from conftest import REAL, require_tool, run_cli

LOGS = REAL / "nccl_logs"
KINETO = REAL / "kineto" / "hta_nccl_data_pt_nccl2.17_ddp2r_excerpt.json"
CHAKRA = REAL / "chakra"
TESTS = REAL / "nccl_tests"


def rows(got):
    return got.table.to_pylist()


# ------------------------------------------------------------------------------ NCCL logs


def test_ray_prefixed_allreduce_lines_of_several_hosts_are_one_call_per_opcount():
    got = read_schedule(LOGS / "nccl1193_ray_allreduce_coll_128ranks.log")
    check("collectives", got.table)
    r = rows(got)
    assert [x["op"] for x in r] == ["all_reduce", "all_reduce"]
    assert [x["bytes_global"] for x in r] == [7_382_228 * 4, 7_066_572 * 4] == [29_528_912, 28_266_288]
    assert [x["bytes_per_rank"] for x in r] == [29_528_912, 28_266_288]
    assert all(x["dtype"] == "fp32" and x["group_size"] == 128 and x["ranks"] == list(range(128)) for x in r)
    assert {x["group"] for x in r} == {0}
    assert r[0]["source"].endswith("nccl1193_ray_allreduce_coll_128ranks.log:1")
    assert r[1]["source"].endswith(":3")
    assert all(x["phase"] == "unknown" and x["algorithm"] == "ring" and x["t_ready_ns"] == 0 for x in r)
    rep = got.report
    assert rep["counts"] == {"all_reduce": 2}
    assert len(rep["communicators"]) == 1 and rep["communicators"][0]["processes"] == 3
    assert rep["world_size"] == 128 and rep["skipped"] == [] and rep["mismatches"] == []
    assert rep["in_place_calls"] == 2          # sendbuff equals recvbuff on every line


def test_send_recv_lines_give_one_message_each_and_the_elision_line_is_reported():
    path = LOGS / "nccl584_sendrecv_coll_2ranks.log"
    got = read_schedule(path)
    r = rows(got)
    assert len(r) == 7 and {x["op"] for x in r} == {"send_recv"}
    assert {x["bytes_global"] for x in r} == {2_420_736 * 4} == {9_682_944}
    assert {x["bytes_per_rank"] for x in r} == {9_682_944}
    pairs = [(x["src"], x["dst"]) for x in r]
    assert pairs == [(0, 1)] * 4 + [(1, 0)] * 3
    assert all(x["ranks"] == [x["src"], x["dst"]] and x["group_size"] == 2 for x in r)
    # the Recv (line 10) ran on the communicator of the first four Sends, the two Sends to peer 0
    # on another one: the same process holds rank 0 of one and rank 1 of the other.
    assert [x["group"] for x in r] == [0, 0, 0, 0, 1, 1, 0]
    assert r[-1]["source"] == f"{path}:10"
    assert got.report["skipped"] == [{"file": str(path), "line": 6,
                                      "reason": "elision marker: lines were left out of this log here"}]


def test_tp_log_interleaved_ranks_counts_and_both_size_conventions():
    got = read_schedule(LOGS / "torchtitan1369_tp_coll_2ranks.log")
    r = rows(got)
    assert got.report["counts"] == {"all_gather": 2, "all_reduce": 2, "reduce_scatter": 1}
    ag = [x for x in r if x["op"] == "all_gather"]
    rs = [x for x in r if x["op"] == "reduce_scatter"]
    ar = [x for x in r if x["op"] == "all_reduce"]
    for x in ag + rs:
        assert (x["bytes_per_rank"], x["bytes_global"]) == (8 << 20, 16 << 20)
    assert [(x["bytes_per_rank"], x["bytes_global"]) for x in ar] == [(4, 4), (4, 4)]
    # opCount e is logged by both ranks on lines 2 and 4: one call, sourced at its first line
    assert [x["source"].rsplit(":", 1)[1] for x in r] == ["1", "2", "3", "6", "7"]
    assert len(got.report["communicators"]) == 1 and got.report["communicators"][0]["processes"] == 2
    assert got.report["mismatches"] == []
    assert got.report["in_place_calls"] == 2   # the two one-element AllReduces


def test_rings_trees_and_per_edge_transports_of_a_two_node_log():
    got = read_schedule(LOGS / "nccl1412_init_rings_trees_16r_2nodes.log")
    assert got.table.num_rows == 0
    assert got.rings[0] == [0, 5, 4, 7, 6, 3, 2, 1, 8, 13, 12, 15, 14, 11, 10, 9]
    assert got.rings[3] == [0, 5, 12, 15, 14, 11, 10, 9, 8, 13, 4, 7, 6, 3, 2, 1]
    # channels 05..07 exist (Channel NN/08) but their orders are not in the excerpt
    assert sorted(got.rings) == list(range(8))
    assert [got.rings[c] is None for c in range(8)] == [False] * 5 + [True] * 3
    topo = got.report["topology"]
    assert topo == {"nodes": 2, "local_ranks": 8}
    assert got.report["rank_host"] == {"3": "node-a", "5": "node-a", "6": "node-a", "7": "node-a"}

    def crossings(ring):
        node = [r // topo["local_ranks"] for r in ring]
        return {(a, b) for a, b, na, nb in zip(ring, ring[1:] + ring[:1], node, node[1:] + node[:1]) if na != nb}

    assert crossings(got.rings[0]) == {(1, 8), (9, 0)}
    assert crossings(got.rings[3]) == {(5, 12), (13, 4)}
    net = {e for e, t in got.transports.items() if t.startswith("NET/")}
    assert net == crossings(got.rings[3])
    assert got.transports[(5, 12)] == got.transports[(13, 4)] == "NET/IB"
    assert got.transports[(7, 6)] == got.transports[(6, 3)] == got.transports[(5, 4)] == "P2P"
    assert got.trees[0][1] == {"up": 0, "down": [2]}
    assert got.trees[1][1] == {"up": 0, "down": []}
    assert [s["line"] for s in got.report["skipped"]] == [12]


def test_roce_device_version_and_hosts():
    got = read_schedule(LOGS / "nccl1052_roce_netib_2nodes_nccl2.18.log")
    rep = got.report
    assert rep["nccl_version"] == "2.18.5+cuda12.0"
    assert rep["hosts"] == ["node-a", "node-b"]
    assert rep["rank_host"] == {"1": "node-b"}
    assert rep["net_devices"] == [
        {"host": h, "index": 0, "name": "mlx5_4", "port": 1, "link_layer": "RoCE", "relaxed_ordering": True}
        for h in ("node-a", "node-b")]
    assert "IB" in rep["network"]
    assert got.table.num_rows == 0


def test_old_format_socket_edges_are_tcp_and_old_tree_syntax():
    got = read_schedule(LOGS / "nccl226_old_format_ring_socket_64r.log")
    assert len(got.transports) == 10
    assert set(got.transports.values()) == {"NET/Socket"}
    assert got.transports[(0, 32)] == got.transports[(34, 33)] == "NET/Socket"
    assert (56, 52) in got.transports and (56, 60) in got.transports
    assert got.rings == {}
    # 2.4 prints parent->rank->children
    assert got.trees[0][25] == {"up": 26, "down": []}
    assert got.trees[0][33] == {"up": 34, "down": []}
    assert got.report["transport_edges"] == {"NET/Socket": 10}


# ------------------------------------------------------------------------------ kineto


def test_profiler_trace_collectives_dtypes_from_args_and_times_in_ns():
    got = read_schedule(KINETO)
    check("collectives", got.table)
    r = rows(got)
    assert len(r) == 21
    assert got.report["counts"] == {"all_reduce": 15, "broadcast": 6}
    ar = [x for x in r if x["op"] == "all_reduce"]
    assert {x["dtype"] for x in ar} == {"fp32"}
    assert 26_550_272 in {x["bytes_global"] for x in ar}
    assert sorted({x["bytes_global"] for x in ar}) == sorted(n * 4 for n in (2049000, 7875584, 6563840, 6637568, 2431040))
    bc = [(x["dtype"], x["bytes_global"]) for x in r if x["op"] == "broadcast"]
    assert sorted(bc) == sorted([("fp32", 212_480), ("int64", 424)] * 3)
    assert all(x["group_size"] == 2 and x["ranks"] == [0, 1] for x in r)
    # ts are µs floats: differences are exact to the ns
    doc = json.loads(KINETO.read_text(), parse_float=Decimal)
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    t0 = kernels[0]["ts"]
    assert [x["t_ready_ns"] for x in r] == [int((k["ts"] - t0) * 1000) for k in kernels]
    assert r[1]["t_ready_ns"] == 2_553_054
    assert r[0]["source"] == f"{KINETO}#traceEvents[{doc['traceEvents'].index(kernels[0])}]"
    assert got.report["nccl_version"] == "2.17.1"
    assert got.report["skipped"] == []  # wait records are not collectives and not errors


def test_gzipped_and_cut_off_profiler_traces(tmp_path):
    data = KINETO.read_bytes()
    gz = tmp_path / "trace.json.gz"
    gz.write_bytes(gzip.compress(data))
    assert detect_format(gz) == "kineto"
    assert rows(read_schedule(gz)) == [{**x, "source": x["source"].replace(str(KINETO), str(gz))}
                                       for x in rows(read_schedule(KINETO))]
    cut = tmp_path / "cut.json"
    cut.write_bytes(data[: len(data) * 2 // 3])
    got = read_schedule(cut)
    assert 0 < got.table.num_rows < 21
    (skip,) = got.report["skipped"]
    assert skip["file"] == str(cut) and "cut off" in skip["reason"]
    cutgz = tmp_path / "cut.json.gz"
    cutgz.write_bytes(gzip.compress(data)[:-2000])
    got = read_schedule(cutgz)
    assert 0 < got.table.num_rows < 21
    assert any("gzip" in s["reason"] for s in got.report["skipped"])


def test_two_rank_traces_are_matched_call_by_call(tmp_path):
    doc = json.loads(KINETO.read_text())
    other = json.loads(KINETO.read_text())
    other["distributedInfo"]["rank"] = 1
    kern = [e for e in other["traceEvents"] if e.get("cat") == "kernel"]
    kern[3]["args"]["Collective name"] = "allgather"     # rank 1 disagrees about the 4th call
    for e in kern:
        e["ts"] = e["ts"] + 5.0                             # and starts 5 µs later
    a, b = tmp_path / "r0.json", tmp_path / "r1.json"
    a.write_text(json.dumps(doc))
    b.write_text(json.dumps(other))
    got = read_schedule([a, b])
    assert got.table.num_rows == 21
    (m,) = got.report["mismatches"]
    assert m["index"] == 3 and {v["op"] for v in m["variants"]} == {"all_reduce", "all_gather"}


# ------------------------------------------------------------------------------ Chakra


CHAKRA_SIZES = [("broadcast", 212_480), ("broadcast", 424), ("all_reduce", 8_196_000),
                ("all_reduce", 31_502_336), ("all_reduce", 26_255_360), ("all_reduce", 26_550_272),
                ("all_reduce", 9_724_160)]


@pytest.mark.parametrize("name", ["chakra_feeder_test_et_jsonized_excerpt.json", "chakra_feeder_test_excerpt.0.et"])
def test_chakra_gpu_collectives_and_cpu_nodes(name):
    path = CHAKRA / name
    assert detect_format(path) == "chakra"
    got = read_schedule(path)
    check("collectives", got.table)
    r = rows(got)
    assert [(x["op"], x["bytes_global"]) for x in r] == CHAKRA_SIZES
    assert [x["bytes_per_rank"] for x in r] == [b for _, b in CHAKRA_SIZES]
    assert [x["dtype"] for x in r] == ["fp32", "int64"] + ["fp32"] * 5
    assert got.report["chakra_cpu_nodes"] == 14
    assert [x["source"].rsplit(" ", 1)[1] for x in r] == ["435", "622", "3256", "3512", "3686", "4486", "5700"]
    # no group size in a Chakra node: unknown unless given
    assert {x["group_size"] for x in r} == {-1} and {len(x["ranks"]) for x in r} == {0}
    got8 = read_schedule(path, world_size=8)
    assert {x["group_size"] for x in rows(got8)} == {8}


def test_binary_and_jsonized_chakra_agree():
    a = rows(read_schedule(CHAKRA / "chakra_feeder_test_et_jsonized_excerpt.json"))
    b = rows(read_schedule(CHAKRA / "chakra_feeder_test_excerpt.0.et"))
    strip = lambda rs: [{k: v for k, v in x.items() if k != "source"} for x in rs]  # noqa: E731
    assert strip(a) == strip(b)


def test_older_chakra_json_broadcast_without_size_is_unknown_not_invented():
    path = CHAKRA / "chakra_feeder_json_small_chakra.0.json"
    got = read_schedule(path)
    (x,) = rows(got)
    assert x["op"] == "broadcast" and x["bytes_global"] == -1 and x["bytes_per_rank"] == -1
    assert x["dtype"] == "unknown"
    assert x["group_size"] == 8  # the file's ngpus
    (u,) = got.report["unknown_sizes"]
    assert u["source"] == f"{path}:node 435" and "no comm_size" in u["reason"]
    assert got.report["chakra_cpu_nodes"] == 2
    assert "unknown size" in format_report(got.report)


def test_pytorch_execution_trace_allgathers():
    got = read_schedule(CHAKRA / "pytorch_et_1.0.2-chakra.0.0.4_allgather_excerpt.json")
    r = rows(got)
    assert [(x["op"], x["bytes_per_rank"], x["bytes_global"], x["group_size"], x["dtype"]) for x in r] == \
        [("all_gather", 4, 8, 2, "fp32")] * 2


def test_cut_off_chakra_files(tmp_path):
    et = (CHAKRA / "chakra_feeder_test_excerpt.0.et").read_bytes()
    cut = tmp_path / "cut.0.et"
    cut.write_bytes(et[: len(et) // 2])
    first = tmp_path / "first.0.et"
    first.write_bytes(et[:200])            # metadata and the start of the first node
    assert detect_format(cut) == detect_format(first) == "chakra"
    got = read_schedule(cut)
    assert 0 < got.table.num_rows < 7
    assert [(x["op"], x["bytes_global"]) for x in rows(got)] == CHAKRA_SIZES[: got.table.num_rows]
    (s,) = got.report["skipped"]
    assert s["file"] == str(cut) and "cut off" in s["reason"]
    js = (CHAKRA / "chakra_feeder_test_et_jsonized_excerpt.json").read_text()
    cutj = tmp_path / "cut.json"
    cutj.write_text(js[: len(js) // 2])
    got = read_schedule(cutj)
    assert [(x["op"], x["bytes_global"]) for x in rows(got)] == CHAKRA_SIZES[: got.table.num_rows]
    (s,) = got.report["skipped"]
    assert isinstance(s["line"], int) and s["line"] > 1 and "cut off" in s["reason"]


# ------------------------------------------------------------------------------ nccl-tests


def test_nccl_tests_current_layout_tree_allreduce():
    path = TESTS / "nccltests232_allreduce_tree_2nodes_h100_4nics.txt"
    got = read_schedule(path)
    r = rows(got)
    assert [x["bytes_global"] for x in r] == [2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20]
    assert all(x["op"] == "all_reduce" and x["group_size"] == 2 and x["algorithm"] == "tree" for x in r)
    t = got.report["nccl_tests"]
    last = t[-1]
    assert (last["size"], last["count"], last["time_us"], last["algbw"], last["busbw"], last["wrong"]) == \
        (33_554_432, 8_388_608, 812.3, 41.31, 41.31, 0)
    assert last["inplace"] == {"time_us": 808.2, "algbw": 41.52, "busbw": 41.52}
    assert last["n"] == 2 and last["line"] == 11
    cmp = compare_busbw(got)
    assert all(c["ok"] for c in cmp)
    assert cmp[-1]["factor"] == 1.0 and abs(cmp[-1]["busbw_predicted"] - 33_554_432 / 812.3e-6 / 1e9) < 1e-9


def test_rccl_tests_srun_label_allgather_32_ranks():
    path = TESTS / "rccl1490_allgather_32ranks_srun_label.txt"
    got = read_schedule(path)
    r = rows(got)
    assert len(r) == 5 and {x["group_size"] for x in r} == {32}
    assert (r[0]["bytes_global"], r[0]["bytes_per_rank"], r[0]["dtype"]) == (65_536, 512 * 4, "fp32")
    assert [x["bytes_global"] for x in r] == [65536 << i for i in range(5)]
    cmp = compare_busbw(got)
    assert all(c["ok"] for c in cmp) and {c["factor"] for c in cmp} == {31 / 32}
    assert got.report["files"][0]["ranks_from"] == "launch command"
    # a wrong n is caught: with 16 ranks the factor would be 15/16
    assert not all(c["ok"] for c in compare_busbw(got, n=4))


def test_nccl_tests_2017_layout_in_ms_and_cut_off_row(tmp_path):
    text = ("# nThread 1 nGpus 4 minBytes 1048576 maxBytes 4194304 step: 2(factor) warmup iters: 5 iters: 20\n"
            "./build/all_reduce_perf -b 1M -e 4M -f 2 -g 4\n"
            "#                                                 out-of-place                    in-place\n"
            "#      bytes             N    type      op     time  algbw  busbw      res     time  algbw  busbw      res\n"
            "#                                              (ms)  (GB/s) (GB/s)             (ms) (GB/s) (GB/s)\n"
            "     1048576        262144   float     sum    0.100  10.49  15.73    0e+00    0.101  10.38  15.57    0e+00\n"
            "     2097152        524288   float     sum    0.2\n")
    p = tmp_path / "old.txt"
    p.write_text(text)
    got = read_schedule(p)
    (row,) = got.report["nccl_tests"]
    assert row["time_us"] == 100.0 and row["n"] == 4 and row["wrong"] == 0.0
    assert got.report["skipped"] == [{"file": str(p), "line": 7, "reason": "table row has 5 of 12 columns (cut off?)"}]
    (c,) = compare_busbw(got)
    assert c["ok"] and c["factor"] == 1.5


# ------------------------------------------------------------------------------ bad input


def _log(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_truncated_and_garbled_log_lines_are_reported_with_line_numbers(tmp_path):
    src = (LOGS / "torchtitan1369_tp_coll_2ranks.log").read_text().splitlines()
    bad = list(src)
    bad[1] = bad[1].replace("datatype 7", "datatype 42")
    bad[2] = bad[2].replace("opCount f ", "opCount zz ")
    text = "\n".join(bad)
    p = tmp_path / "cut.log"
    p.write_text(text[: text.rfind("[nranks=2]")])   # cut inside the last line
    got = read_schedule(p)
    sk = {s["line"]: s["reason"] for s in got.report["skipped"]}
    assert sorted(sk) == [2, 3, 7]
    assert "datatype 42" in sk[2] and "no known layout" in sk[3] and "[nranks=N]" in sk[7]
    assert got.report["counts"] == {"all_gather": 2, "all_reduce": 1, "reduce_scatter": 1}
    text = format_report(got.report)
    assert "skipped        3" in text and f"{p}:7:" in text


def test_log_split_per_rank_gives_the_same_calls(tmp_path):
    src = (LOGS / "torchtitan1369_tp_coll_2ranks.log").read_text().splitlines()
    a = _log(tmp_path, "rank0.log", [x for x in src if ":191369:" in x])
    b = _log(tmp_path, "rank1.log", [x for x in src if ":191370:" in x])
    got = read_schedule([a, b])
    assert got.report["counts"] == {"all_gather": 2, "all_reduce": 2, "reduce_scatter": 1}
    assert {(x["op"], x["bytes_per_rank"]) for x in rows(got)} == \
        {("all_gather", 8 << 20), ("reduce_scatter", 8 << 20), ("all_reduce", 4)}


def test_a_log_read_twice_counts_each_call_once(tmp_path):
    """The same COLL line of one thread again (a file given twice; stdout joined with
    NCCL_DEBUG_FILE) is one call logged twice, not two calls: skipped, naming the first."""
    log = LOGS / "torchtitan1369_tp_coll_2ranks.log"
    twice = read_schedule([log, log])
    assert twice.report["counts"] == {"all_gather": 2, "all_reduce": 2, "reduce_scatter": 1}
    assert [s["line"] for s in twice.report["skipped"]] == [1, 2, 3, 4, 5, 6, 7]
    assert twice.report["skipped"][3]["reason"] == \
        f"the same COLL line (same host, pid, thread) as {log}:4: a log read twice?"
    src = log.read_text().splitlines()
    r1 = [x for x in src if ":191370:" in x]
    again = _log(tmp_path, "again.log", r1 + [x for x in src if ":191369:" in x] + r1)
    got = read_schedule(again)
    assert got.report["counts"] == {"all_gather": 2, "all_reduce": 2, "reduce_scatter": 1}
    assert len(got.report["skipped"]) == len(r1) and got.report["mismatches"] == []


def test_ranks_disagreeing_at_one_opcount_are_a_mismatch(tmp_path):
    line = ("h{h}:{pid}:{pid} [0] NCCL INFO {op}: opCount {oc} sendbuff 0x1 recvbuff 0x2 count {c} datatype 9 "
            "op 0 root 0 comm 0x{pid}0 [nranks=2] stream 0x3")
    p = _log(tmp_path, "m.log", [
        line.format(h=0, pid=11, op="AllReduce", oc="4", c=100), line.format(h=1, pid=22, op="AllReduce", oc="4", c=100),
        line.format(h=0, pid=11, op="AllReduce", oc="5", c=100), line.format(h=1, pid=22, op="AllGather", oc="5", c=100),
    ])
    got = read_schedule(p)
    (m,) = got.report["mismatches"]
    assert m["opCount"] == "5" and {v["op"] for v in m["variants"]} == {"all_reduce", "all_gather"}
    assert [v["lines"] for v in m["variants"]] == [[f"{p}:3"], [f"{p}:4"]]
    assert got.table.num_rows == 2 and {x["dtype"] for x in rows(got)} == {"bf16"}
    assert "MISMATCHES" in format_report(got.report)


def test_rccl_globalrank_commid_init_lines_and_truncated_rings(tmp_path):
    p = _log(tmp_path, "rccl.log", [
        "RCCL version 2.18.3+hip6.0 HEAD:abc",
        "n0:1:1 [0] NCCL INFO ncclCommInitRank comm 0xa rank 0 nranks 24 cudaDev 0 busId 1000 commId 0xfeed - Init START",
        "n1:2:2 [0] NCCL INFO ncclCommInitRank comm 0xb rank 5 nranks 24 cudaDev 0 busId 1000 commId 0xfeed - Init START",
        "n2:3:3 [0] NCCL INFO comm 0xc rank 7 nranks 24 cudaDev 0 busId 2000 commId 0xfeed - Init COMPLETE",
        "n0:1:1 [0] NCCL INFO Channel 00/02 :    " + "   ".join(str(i) for i in range(20)),
        "n0:1:1 [0] NCCL INFO Channel 01/02 :    " + "   ".join(str(i) for i in range(20)),
        "n0:1:1 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x1 count 10 datatype 6 op 0 root 0 "
        "comm 0xa [nranks=24] stream 0x2 task 0 globalrank 0",
        "n1:2:2 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x1 count 10 datatype 6 op 0 root 0 "
        "comm 0xb [nranks=24] stream 0x2 task 0 globalrank 5",
        "n1:2:2 [0] NCCL INFO Send: opCount 1 sendbuff 0x1 recvbuff (nil) count 8 datatype 0 op 0 root 7 "
        "comm 0xb [nranks=24] stream 0x2 task 0 globalrank 5",
        "n2:3:3 [0] NCCL INFO Recv: opCount 1 sendbuff (nil) recvbuff 0x1 count 8 datatype 0 op 0 root 5 "
        "comm 0xc [nranks=24] stream 0x2 task 0 globalrank 7",
    ])
    got = read_schedule(p)
    assert got.report["nccl_version"] == "RCCL 2.18.3+hip6.0"
    assert got.rings == {0: None, 1: None}      # 20 of 24 ranks printed
    r = rows(got)
    assert [(x["op"], x["bytes_global"], x["dtype"]) for x in r] == [("all_reduce", 20, "fp16"), ("send_recv", 8, "int8")]
    assert (r[1]["src"], r[1]["dst"]) == (5, 7)
    assert got.report["communicators"][0]["commId"] == "0xfeed" and got.report["communicators"][0]["processes"] == 3
    assert r[1]["source"] == f"{p}:9" and len(got.report["communicators"]) == 1


def test_prev_rank_next_lines_close_a_ring(tmp_path):
    # NCCL_DEBUG=TRACE lines carry a time stamp and the function between the device and NCCL
    p = _log(tmp_path, "r.log", [f"h:1:1 [{r}] 12.5 ncclTransportP2pSetup:71 NCCL TRACE Ring 00 : "
                                 f"{(r - 1) % 4} -> {r} -> {(r + 1) % 4}" for r in (2, 0)]
             + [f"h:1:1 [{r}] NCCL INFO Ring 00 : {(r - 1) % 4} -> {r} -> {(r + 1) % 4}" for r in (3, 1)]
             + ["h:1:1 [0] NCCL INFO Ring 01 : 3 -> 0 -> 1"])
    got = read_schedule(p)
    assert got.rings == {0: [0, 1, 2, 3], 1: None}


def test_unknown_format_names_the_known_ones(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("hello\nworld\n")
    with pytest.raises(InputFormatError, match="nccl-log, kineto, chakra, nccl-tests"):
        read_schedule(p)
    b = tmp_path / "x.bin"
    b.write_bytes(bytes(range(256)))
    with pytest.raises(InputFormatError):
        detect_format(b)
    with pytest.raises(InputFormatError, match="unknown format"):
        read_schedule(LOGS / "nccl1193_ray_allreduce_coll_128ranks.log", fmt="pcap")
    for name, content in (("empty.log", b""), ("blank.log", b"\n  \n\t\n")):
        e = tmp_path / name
        e.write_bytes(content)
        with pytest.raises(InputFormatError) as err:
            detect_format(e)
        assert str(err.value) == f"{e}: no content (empty, or whitespace only)"


def test_nothing_usable_is_an_error_naming_the_reasons(tmp_path):
    p = _log(tmp_path, "bad.log", ["h:1:1 [0] NCCL INFO AllReduce: opCount 1 sendbuff 0x1 recvbuff 0x1 count 3 datatype 99 "
                                   "op 0 root 0 comm 0x5 [nranks=2] stream 0x2"])
    with pytest.raises(WiretraceError, match=r"nothing usable.*bad.log:1: .*datatype 99"):
        read_schedule(p)


# ------------------------------------------------------------------------------ command line


def test_schedule_from_writes_parquet_and_prints_the_summary(tmp_path):
    out = tmp_path / "sched"
    proc = run_cli("schedule", "--from", LOGS / "torchtitan1369_tp_coll_2ranks.log", "-o", out)
    assert proc.returncode == 0, proc.stderr
    t = pq.read_table(out / "collectives.parquet")
    assert t.num_rows == 5 and sorted(t.column("bytes_per_rank").to_pylist()) == [4, 4] + [8 << 20] * 3
    assert "reduce_scatter" in proc.stdout and "communicators  1" in proc.stdout and "skipped        0" in proc.stdout
    bad = tmp_path / "x.txt"
    bad.write_text("nothing here\n")
    proc = run_cli("schedule", "--from", bad, "-o", tmp_path / "o2")
    assert proc.returncode == 2 and "known formats" in proc.stderr and not (tmp_path / "o2").exists()


def test_profiler_steps_give_iterations_and_step_relative_times(tmp_path):
    doc = json.loads(KINETO.read_text())
    base = 4458676000000
    doc["traceEvents"] += [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 1, "tid": 1,
         "ts": base + 423000.0, "dur": 197000.0},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#8", "pid": 1, "tid": 1,
         "ts": base + 620000.0, "dur": 500000.0}]
    p = tmp_path / "steps.json"
    p.write_text(json.dumps(doc))
    got = read_schedule(p)
    r = rows(got)
    assert [x["iteration"] for x in r] == [0] * 7 + [1] * 14
    assert r[0]["t_ready_ns"] == 385_774            # 423385.774 µs - 423000.000 µs
    assert r[7]["t_ready_ns"] == 25_361_514         # 645361.514 µs - 620000.000 µs
    assert got.report["iterations"] == 2


def test_ring_order_tuning_lines_and_nccl_algo_shape_the_rows(tmp_path):
    coll = ("n{r}:{r}0:{r}1 [0] NCCL INFO AllReduce: opCount {oc} sendbuff 0x1 recvbuff 0x1 count 1048576 "
            "datatype 7 op 0 root 0 comm 0x{r}c [nranks=4] stream 0x2")
    lines = [f"n{r}:{r}0:{r}1 [0] NCCL INFO comm 0x{r}c rank {r} nRanks 4 nNodes 4 localRanks 1 localRank 0 MNNVL 0"
             for r in range(4)]
    lines += ["n0:00:01 [0] NCCL INFO NCCL_ALGO set by environment to ring;allgather:tree",
              "n0:00:01 [0] NCCL INFO Channel 00/01 :    0   2   1   3"]
    for oc in ("0", "1"):
        lines += [coll.format(r=r, oc=oc) for r in range(4)]
        if oc == "1":   # NCCL's tuning decision for this call, printed after its COLL line
            lines.append("n0:00:01 [0] NCCL INFO 4194304 Bytes -> Algo 0 proto 2 time 123.456")
    got = read_schedule(_log(tmp_path, "t.log", lines))
    r = rows(got)
    assert [x["ranks"] for x in r] == [[0, 2, 1, 3]] * 2
    assert [x["algorithm"] for x in r] == ["ring", "tree"]
    assert {x["bytes_global"] for x in r} == {4 << 20}
    assert got.rings == {0: [0, 2, 1, 3]}
    assert got.report["communicators"][0]["processes"] == 4


def test_nccl_algo_values():
    from wiretrace.ingest.nccl_log import parse_nccl_algo

    assert parse_nccl_algo("Tree") == {"*": "tree"}
    assert parse_nccl_algo("ring;allreduce:tree") == {"*": "ring", "all_reduce": "tree"}
    assert parse_nccl_algo("^ring") == {} and parse_nccl_algo("ring,collnetdirect") == {}


def test_nccl_tests_run_with_nccl_debug_info_keeps_rings_and_transports(tmp_path):
    p = tmp_path / "run.txt"
    p.write_text((LOGS / "nccl1412_init_rings_trees_16r_2nodes.log").read_text()
                 + (TESTS / "nccltests232_allreduce_tree_2nodes_h100_4nics.txt").read_text())
    assert detect_format(p) == "nccl-tests"
    got = read_schedule(p)
    assert got.table.num_rows == 5
    assert got.rings[0] == [0, 5, 4, 7, 6, 3, 2, 1, 8, 13, 12, 15, 14, 11, 10, 9]
    assert sorted(got.complete_rings()) == [0, 1, 2, 3, 4]
    assert got.transports[(5, 12)] == "NET/IB"
    assert "peak busbw 41.31 GB/s at 32.00 MiB" in format_report(got.report)


def test_same_size_communicators_doing_the_same_calls_stay_apart(tmp_path):
    # 8 GPUs, tensor parallel 2: four 2-rank communicators issue identical calls at each opCount
    line = ("h{g}:{pid}:{pid} [{g}] NCCL INFO AllReduce: opCount {oc} sendbuff 0x1 recvbuff 0x1 count 4096 "
            "datatype 9 op 0 root 0 comm 0x{pid}c [nranks=2] stream 0x3")
    lines = [line.format(g=g, pid=100 + g, oc=oc) for oc in ("0", "1", "2") for g in (3, 0, 6, 1, 2, 7, 5, 4)]
    got = read_schedule(_log(tmp_path, "tp.log", lines))
    assert got.table.num_rows == 12 and {x["bytes_global"] for x in rows(got)} == {8192}
    comms = got.report["communicators"]
    assert len(comms) == 4 and {c["processes"] for c in comms} == {2} and {c["calls"] for c in comms} == {3}
    assert got.report["mismatches"] == []


def test_profiler_trace_of_newer_pytorch_p2p_all_to_allv_and_cpu_side_args(tmp_path):
    def kernel(i, name, ts, **args):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": 1.0,
                "args": {"External id": i, "correlation": i, **args}}

    tp = {"Process Group Name": "3", "Process Group Description": "TENSOR_MODEL_PARALLEL_GROUP"}
    doc = {"distributedInfo": {"rank": 0, "world_size": 8, "nccl_version": "2.21.5"}, "traceEvents": [
        kernel(1, "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 100.0,
               **{"Collective name": "_allgather_base", "In msg nelems": 100, "Out msg nelems": 400,
                  "Group size": 4, "dtype": "BFloat16", "Process Group Ranks": "[0, 2, 4, 6]", **tp}),
        kernel(2, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 101.5,
               **{"Collective name": "send", "In msg nelems": 10, "Out msg nelems": 0, "Group size": 2,
                  "dtype": "Float", "Dst Rank": 3, "Process Group Name": "5", "Process Group Ranks": "[0, 3]"}),
        kernel(3, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 102.0,
               **{"Collective name": "all_to_allv", "In msg nelems": 60, "Out msg nelems": 60, "Group size": 3,
                  "dtype": "Float", "In split size": "[1, 2, 3]", "Out split size": "[2, 2, 2]",
                  "Process Group Name": "6", "Process Group Ranks": "[0, 1, 2]"}),
        {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 9, "tid": 9, "ts": 102.5, "dur": 1,
         "args": {"External id": 4, "Collective name": "allreduce", "In msg nelems": 50, "Out msg nelems": 50,
                  "Group size": 8, "dtype": "Half", "Process Group Name": "0", "Global rank start": 0,
                  "Global rank stride": 1, "Process Group Ranks": "[0, 1, 2, 3, 4, 5, 6, 7]"}},
        kernel(4, "ncclKernel_AllReduce_RING_LL_Sum_half(ncclDevComm*, unsigned long, ncclWork*)", 103.0),
        kernel(5, "ncclDevKernel_AllReduce_Sum_f32_TREE_LL(ncclDevKernelArgsStorage<4096ul>)", 104.25,
               **{"Collective name": "allreduce", "In msg nelems": 8, "Out msg nelems": 8, "Group size": 8,
                  "dtype": "Float", "Process Group Name": "0", "Process Group Ranks": "[0, 1, 2, 3, 4, 5, 6, 7]"}),
    ]}
    p = tmp_path / "new.json"
    p.write_text(json.dumps(doc))
    got = read_schedule(p)
    r = rows(got)
    got_rows = [(x["op"], x["bytes_per_rank"], x["bytes_global"], x["dtype"], x["ranks"], x["algorithm"],
                 x["parallelism"], x["t_ready_ns"]) for x in r]
    assert got_rows == [
        ("all_gather", 200, 800, "bf16", [0, 2, 4, 6], "ring", "tp", 0),
        ("send_recv", 40, 40, "fp32", [0, 3], "ring", "other", 1500),
        ("all_to_allv", 240, 720, "fp32", [0, 1, 2], "ring", "other", 2000),
        ("all_reduce", 100, 100, "fp16", list(range(8)), "ring", "other", 3000),
        ("all_reduce", 32, 32, "fp32", list(range(8)), "tree", "other", 4250),
    ]
    assert (r[1]["src"], r[1]["dst"]) == (0, 3)
    (splits,) = got.report["all_to_allv_splits"]
    assert splits["by_rank"] == {"0": [40, 80, 120]}
    assert got.report["nccl_version"] == "2.21.5"


def test_measured_schedule_goes_through_generate_to_a_capture_tshark_decodes(tmp_path):
    tshark = require_tool("tshark")
    plan = tmp_path / "cluster.json"
    plan.write_text(json.dumps({
        "name": "2 nodes x 1 GPU",
        "cluster": {"nodes": 2, "gpus_per_node": 1, "gpu": "H100", "nics_per_node": 1,
                    "nic_rate": "400Gbps", "nvlink_rate": "900GB/s", "latency": "2us"},
        "collectives": {"algorithm": "ring", "channels": 1},
        "transport": {"kind": "rocev2", "ip_version": 4, "path_mtu": 4096}}))
    log = LOGS / "torchtitan1369_tp_coll_2ranks.log"
    cap = tmp_path / "tp.pcap"
    proc = run_cli("generate", "--schedule", log, "--plan", plan, "-o", cap, "--no-parquet")
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([tshark, "-r", str(cap), "-T", "fields", "-e", "udp.dstport", "-e", "infiniband.bth.opcode",
                          "-e", "infiniband.reth.dmalen"], capture_output=True, text=True, check=True).stdout
    fields = [line.split("\t") for line in out.splitlines()]
    assert fields and all(f[0] == "4791" and f[1] != "" for f in fields)
    # every byte the ring puts on the wire, by the nccl-tests bus factors: busbw factor x S x n
    # (all_gather/reduce_scatter (n-1)/n, all_reduce 2(n-1)/n, n = 2)
    n = 2
    want = sum(round(factor * s * n) for factor, s in [((n - 1) / n, 16 << 20)] * 2     # all_gather
               + [((n - 1) / n, 16 << 20)]                                               # reduce_scatter
               + [(2 * (n - 1) / n, 4)] * 2)                                             # all_reduce
    assert want == 3 * (16 << 20) + 16
    # data messages are RDMA WRITE FIRST (0x06) .. LAST WITH IMMEDIATE or ONLY WITH IMMEDIATE (0x0b);
    # the RETH of the first packet carries the message length
    data = sum(int(f[2]) for f in fields if f[1] in ("6", "11"))
    assert data == want


def test_chakra_send_recv_nodes_of_two_ranks_pair_up(tmp_path):
    meta = {"attr": [{"name": "schema", "stringVal": "1.0.1"}]}

    def node(i, kind, start, **attrs):
        def attr(k, v):
            return {"name": k, "boolVal": v} if isinstance(v, bool) else {"name": k, "int64Val": str(v)}
        return {"id": str(i), "name": f"n{i}", "type": kind, "startTimeMicros": str(start),
                "attr": [attr(k, v) for k, v in attrs.items()]}

    r0 = [meta, node(1, "COMM_COLL_NODE", 1000, is_cpu_op=False, comm_type=2, comm_size=4096),
          node(2, "COMM_SEND_NODE", 1003, is_cpu_op=False, comm_src=0, comm_dst=1, comm_size=1024, comm_tag=7)]
    r1 = [meta, node(5, "COMM_RECV_NODE", 1004, is_cpu_op=False, comm_src=0, comm_dst=1, comm_size=1024, comm_tag=7)]
    a, b = tmp_path / "t.0.json", tmp_path / "t.1.json"
    a.write_text("".join(json.dumps(o, indent=2) for o in r0))
    b.write_text("".join(json.dumps(o, indent=2) for o in r1))
    got = read_schedule([a, b], world_size=4)
    r = rows(got)
    assert [(x["op"], x["bytes_per_rank"], x["bytes_global"], x["group_size"], x["t_ready_ns"]) for x in r] == \
        [("all_gather", 4096, 4 * 4096, 4, 0), ("send_recv", 1024, 1024, 2, 3000)]
    assert (r[1]["src"], r[1]["dst"]) == (0, 1) and r[1]["source"] == f"{a}:node 2"


def test_json_values_reads_up_to_a_cut_and_says_where():
    """The stream reader behind kineto's traceEvents and chakra's jsonized nodes: values kept up
    to the first one that does not decode, its line named; the caller's decoder is used."""
    from wiretrace.ingest.common import json_values

    text = '[ {"a": 1},\n {"b": 2.5} ,\n {"c": ]'
    values, cut = json_values(text, 1, lambda c: c in " \t\r\n,", end="]",
                              decoder=json.JSONDecoder(parse_float=str))
    assert values == [{"a": 1}, {"b": "2.5"}]
    assert cut is not None and cut[0] == 3
    values, cut = json_values('{"x": 1}\n\n{"y": 2}\n', 0, str.isspace)
    assert values == [{"x": 1}, {"y": 2}] and cut is None
    values, cut = json_values('[1, 2]', 1, lambda c: c in " ,", end="]")
    assert values == [1, 2] and cut is None
