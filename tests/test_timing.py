"""Message timing: readiness, step and clear-to-send dependencies, link serialization."""

from __future__ import annotations

import numpy as np
import pytest

from wiretrace import plan as P, tables, timing, topology

PLAN = P.from_dict({"cluster": {"nodes": 2, "gpus_per_node": 4, "nic_rate": "400Gbps",
                                "nvlink_rate": "900GB/s", "latency": "2us", "nvlink_latency": "1us"}},
                   require_model=False)
TOPO = topology.build(PLAN)


def messages(rows):
    cols = {k: [] for k in tables.column_names("messages")}
    for i, r in enumerate(rows):
        src, dst = r["src"], r["dst"]
        net = TOPO.rank_node[src] != TOPO.rank_node[dst]
        vals = dict(msg_id=i, op_id=r.get("op", 0), step=r["step"], channel=0, chunk=r.get("chunk", 0),
                    src_rank=src, dst_rank=dst, src_node=TOPO.rank_node[src], dst_node=TOPO.rank_node[dst],
                    src_nic=TOPO.rank_nic[src], dst_nic=TOPO.rank_nic[dst],
                    link="network" if net else "nvlink", kind=r.get("kind", "data"), bytes=r["bytes"],
                    wire_bytes=r["bytes"], verb="", qpn=-1, udp_sport=-1, t_start_ns=0, t_end_ns=0)
        for k, v in vals.items():
            cols[k].append(v)
    return {k: np.asarray(v) for k, v in cols.items()}


def calls(t_ready, groups=None):
    n = len(t_ready)
    return tables.to_arrow("collectives", dict(
        op_id=list(range(n)), iteration=[0] * n, op=["all_reduce"] * n, parallelism=["dp"] * n,
        group=list(groups) if groups is not None else list(range(n)), ranks=[[0, 4]] * n, group_size=[2] * n, bytes_global=[1] * n,
        bytes_per_rank=[1] * n, dtype=["fp32"] * n, phase=["backward"] * n, layer=[-1] * n,
        microbatch=[-1] * n, stage=[0] * n, tensor=["t"] * n, src=[-1] * n, dst=[-1] * n,
        algorithm=["ring"] * n, t_ready_ns=list(t_ready), source=["test"] * n))


def wire_ns(payload: int) -> int:
    """Serialization of one RDMA WRITE message on 400 Gb/s Ethernet, worked out by hand:
    packets of 4096 B, each with 8 preamble + 14 Ethernet + 20 IPv4 + 8 UDP + 12 BTH + 4 ICRC
    + 4 FCS + 12 IFG = 82 B, plus RETH 16 and ImmDt 4 once per message."""
    npkt = -(-payload // 4096)
    return int(np.ceil((payload + 82 * npkt + 20) * 8 / 400e9 * 1e9))


def test_two_rank_ring_with_clear_to_send():
    S = 4 * 2**20
    rows = []
    for step in range(2):
        for a, b in ((0, 4), (4, 0)):
            rows.append(dict(kind="cts", src=b, dst=a, step=step, bytes=64))
            rows.append(dict(kind="data", src=a, dst=b, step=step, bytes=S))
    m = timing.schedule(messages(rows), calls([1000]), TOPO, PLAN)
    st, en = m["t_start_ns"], m["t_end_ns"]
    cts_ns = wire_ns(64)
    # step 0: credits at t_ready, data once the credit arrived (serialization + 2 us)
    assert st[0] == 1000 and en[0] == 1000 + cts_ns + 2000
    assert st[1] == en[0]
    assert en[1] == st[1] + wire_ns(S) + 2000
    # step 1: rank 4's credit leaves after its step-0 receipt arrived; data follows the credit
    assert st[4] == en[1] and st[5] == en[4]
    assert m["t_end_ns"].max() == en[5]


def test_calls_sharing_a_nic_are_served_first_come_first_served():
    S = 2**20
    rows = [dict(op=0, src=0, dst=4, step=0, bytes=S), dict(op=1, src=0, dst=4, step=0, bytes=S)]
    m = timing.schedule(messages(rows), calls([0, 10]), TOPO, PLAN)
    d = wire_ns(S)
    assert m["t_start_ns"].tolist() == [0, d]
    assert m["t_end_ns"].tolist() == [d + 2000, 2 * d + 2000]


def test_nvlink_uses_the_nvlink_rate_and_latency():
    rows = [dict(src=0, dst=1, step=0, bytes=9_000_000)]
    m = timing.schedule(messages(rows), calls([0]), TOPO, PLAN)
    # "900GB/s" is NVIDIA's figure for both directions: 450 GB/s = 3.6 Tb/s each way
    assert m["t_end_ns"][0] == int(np.ceil(9_000_000 * 8 / 3.6e12 * 1e9)) + 1000


def test_delay_propagates_to_dependent_steps():
    """Call 1 takes the NIC first; call 0's step-1 message must wait for its delayed step 0."""
    S = 2**20
    rows = [dict(op=1, src=4, dst=0, step=0, bytes=8 * S),
            dict(op=0, src=4, dst=0, step=0, bytes=S), dict(op=0, src=0, dst=4, step=1, bytes=S)]
    m = timing.schedule(messages(rows), calls([5, 0]), TOPO, PLAN)
    d8, d1 = wire_ns(8 * S), wire_ns(S)
    assert m["t_start_ns"].tolist() == [0, d8, d8 + d1 + 2000]


@pytest.mark.parametrize("seed", range(5))
def test_fifo_closed_form_matches_a_plain_loop(seed):
    rng = np.random.default_rng(seed)
    n = 500
    group = np.sort(rng.integers(0, 7, n))
    ready = rng.integers(0, 10_000, n)
    dur = rng.integers(1, 300, n)
    got = timing._fifo_starts(group, ready, dur)
    want = np.empty(n, dtype=np.int64)
    free = {}
    for i in range(n):
        want[i] = max(ready[i], free.get(group[i], -10**18))
        free[group[i]] = want[i] + dur[i]
    assert np.array_equal(got, want)


def test_calls_of_one_communicator_run_one_after_another():
    """NCCL runs a communicator's calls in stream order: bucket 1 waits for bucket 0 to finish,
    even though both were ready at once; a call on another communicator does not wait."""
    S = 2**20
    rows = [dict(op=0, src=0, dst=4, step=0, bytes=S), dict(op=1, src=0, dst=4, step=0, bytes=S),
            dict(op=2, src=1, dst=5, step=0, bytes=S)]
    m = timing.schedule(messages(rows), calls([0, 0, 0], groups=[7, 7, 8]), TOPO, PLAN)
    d = wire_ns(S)
    assert m["t_start_ns"].tolist() == [0, d + 2000, 0]


def test_at_most_eight_credits_outstanding_per_connection():
    """A receiver has NCCL_STEPS = 8 slots per connection: the credit of slice k leaves when
    slice k-8 has arrived, never all at once."""
    S = 128 * 1024
    rows = []
    for c in range(20):
        rows.append(dict(kind="cts", src=4, dst=0, step=0, chunk=c, bytes=64))
        rows.append(dict(kind="data", src=0, dst=4, step=0, chunk=c, bytes=S))
    m = timing.schedule(messages(rows), calls([0]), TOPO, PLAN)
    cts_start = m["t_start_ns"][0::2]
    data_end = m["t_end_ns"][1::2]
    assert (cts_start[:8] < data_end[0]).all()
    for k in range(8, 20):
        assert cts_start[k] >= data_end[k - 8]
    # data never waits for a credit it has not received
    assert (m["t_start_ns"][1::2] >= m["t_end_ns"][0::2]).all()
