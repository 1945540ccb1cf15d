"""Pipeline helpers: bus factors from the lowering, and the busbw check of nccl-tests output."""

from __future__ import annotations

import pytest

from wiretrace.pipeline import lowered_bus_factor

from conftest import REAL, run_cli


@pytest.mark.parametrize("n", [2, 3, 8, 32])
@pytest.mark.parametrize("op,factor", [
    ("all_reduce", lambda n: 2 * (n - 1) / n), ("all_gather", lambda n: (n - 1) / n),
    ("reduce_scatter", lambda n: (n - 1) / n), ("all_to_all", lambda n: (n - 1) / n),
    ("broadcast", lambda n: 1.0), ("reduce", lambda n: 1.0),
])
def test_lowered_bus_factor_is_the_nccl_tests_factor(op, factor, n):
    """nccl-tests doc/PERFORMANCE.md: busbw = algbw x factor(op, n); sizes divisible by n."""
    size = 4 * n * 12_345
    assert lowered_bus_factor(op, n, size) == pytest.approx(factor(n), abs=1e-12)


def test_schedule_from_nccl_tests_prints_the_busbw_check(tmp_path):
    proc = run_cli("schedule", "--from", REAL / "nccl_tests" / "rccl1490_allgather_32ranks_srun_label.txt",
                   "-o", tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    check = proc.stdout[proc.stdout.index("busbw check"):]
    lines = [line.split() for line in check.splitlines() if line.strip().startswith("all_gather ")]
    assert len(lines) == 5
    for op, n, size, time_us, busbw, factor, predicted, diff in lines:
        assert (op, n, factor) == ("all_gather", "32", f"{31 / 32:.4f}")
        # size / time x 31/32 gives the logged busbw up to its two printed decimals
        assert abs(float(diff)) <= 0.01
        assert float(predicted) == pytest.approx(int(size.replace(",", "")) / (float(time_us) * 1e3) * 31 / 32,
                                                 abs=0.006)


def _measured_run(tmp_path, lines: list[str], nodes: int, gpus: int):
    """``generate --schedule`` of the log ``lines`` on ``nodes`` x ``gpus`` (one NIC per node):
    (process, network messages as (src_rank, dst_rank, msg_id), packets table)."""
    import json

    import pyarrow.parquet as pq

    log = tmp_path / "run.log"
    log.write_text("\n".join(lines) + "\n")
    plan = tmp_path / "cluster.json"
    plan.write_text(json.dumps({"cluster": {"nodes": nodes, "gpus_per_node": gpus, "nics_per_node": 1}}))
    proc = run_cli("generate", "--schedule", log, "--plan", plan, "-o", tmp_path / "run.pcap")
    assert proc.returncode == 0, proc.stderr
    m = pq.read_table(tmp_path / "run.parquet" / "messages.parquet").to_pydict()
    net = [(a, b, mid) for a, b, mid, link in zip(m["src_rank"], m["dst_rank"], m["msg_id"], m["link"])
           if link == "network"]
    return proc, net, pq.read_table(tmp_path / "run.parquet" / "packets.parquet")


ALL_REDUCE = ("{host}:45293:45298 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x7f0000000000 recvbuff "
              "0x7f0000000000 count 1048576 datatype 7 op 0 root 0 comm 0x5560 [nranks={n}] stream 0x1")


def test_a_run_whose_network_was_net_socket_renders_no_roce(tmp_path):
    """NCCL runs one network module for all of a process's connections: a log whose network
    connections are all NET/Socket (the real 64-rank log; one AllReduce line added, the log has no
    call of its own) means every network message was TCP, the logged edges and the others alike.
    They stay in messages.parquet; none becomes a RoCEv2 packet."""
    lines = (REAL / "nccl_logs" / "nccl226_old_format_ring_socket_64r.log").read_text().splitlines()
    proc, net, pkts = _measured_run(tmp_path, lines + [ALL_REDUCE.format(host="node-11", n=64)], 8, 8)
    assert len(net) > 100 and pkts.num_rows == 0
    assert f"{len(net):,} network messages went over NET/Socket (TCP)" in proc.stderr


def test_only_the_socket_edges_of_a_mixed_log_are_held_back(tmp_path):
    """A log that also shows a NET/IB connection used RDMA: only its NET/Socket edges are TCP."""
    lines = ["node-0:45293:45298 [0] NCCL INFO Ring 00 : 0 -> 1 [send] via NET/IB/0",
             "node-1:45293:45298 [0] NCCL INFO Ring 00 : 1 -> 2 [send] via NET/Socket/0",
             ALL_REDUCE.format(host="node-0", n=4)]
    proc, net, pkts = _measured_run(tmp_path, lines, 4, 1)
    tcp = [mid for a, b, mid in net if (a, b) == (1, 2)]
    assert 0 < len(tcp) < len(net)
    assert f"{len(tcp):,} network messages went over NET/Socket (TCP)" in proc.stderr
    assert set(pkts.column("msg_id").to_pylist()) == {mid for _, _, mid in net} - set(tcp)
