"""Placement of collective traffic: NVLink vs network, rail alignment, NCCL's ring orders.

Real ring orders come from ``../shared/real/nccl_logs/nccl1412_init_rings_trees_16r_2nodes.log``
(2 nodes x 8 GPUs, NCCL INFO ``Channel NN/08 : r0 r1 ...`` lines).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from test_collectives import data_rows, make_coll, make_plan

from wiretrace import collectives, topology
from wiretrace.errors import WiretraceError

REAL = Path(__file__).resolve().parents[2] / "shared" / "real"
LOG = REAL / "nccl_logs" / "nccl1412_init_rings_trees_16r_2nodes.log"


def log_rings() -> dict[int, list[int]]:
    rings = {}
    for line in LOG.read_text().splitlines():
        m = re.search(r"NCCL INFO Channel (\d+)/\d+ :((?:\s+\d+)+)\s*$", line)
        if m:
            rings[int(m.group(1))] = [int(x) for x in m.group(2).split()]
    return rings


def tp_dp_collectives(nodes=2, gpus=8, size=4 * 100_003):
    """Megatron-LM layout tp = gpus_per_node, dp = nodes: TP groups are nodes, DP groups rails."""
    rows = []
    for nd in range(nodes):
        rows.append(dict(op="all_reduce", ranks=list(range(nd * gpus, (nd + 1) * gpus)), b=size, par="tp"))
    for g in range(gpus):
        rows.append(dict(op="all_reduce", ranks=[nd * gpus + g for nd in range(nodes)], b=size, par="dp"))
    return make_coll(rows)


@pytest.mark.parametrize("channels", [1, 4])
@pytest.mark.parametrize("algo", ["ring", "tree", "auto"])
def test_tp8_dp2_on_2x8(channels, algo):
    plan = make_plan(2, 8, channels=channels, algorithm=algo)
    topo = topology.build(plan)
    coll = tp_dp_collectives()
    coll = collectives.resolve_algorithms(coll, topo, plan)
    m = collectives.lower(coll, topo, plan)
    tp = m["op_id"] < 2
    assert set(m["link"][tp]) == {"nvlink"}
    assert set(m["link"][~tp]) == {"network"}
    net = m["link"] == "network"
    assert np.all(m["src_node"][net] != m["dst_node"][net])
    assert np.all(m["src_nic"][net] % 8 == m["dst_nic"][net] % 8)       # NIC i -> NIC i
    d = data_rows(m) & net
    assert np.all(m["src_nic"][d] == topo.rank_nic[m["src_rank"][d]])  # each GPU's own NIC
    assert np.all(m["dst_nic"][d] == topo.rank_nic[m["dst_rank"][d]])
    assert m["bytes"][d].sum() == 8 * 2 * 4 * 100_003                     # 8 DP pairs, 2(n-1)S each


@pytest.mark.parametrize("algo", ["ring", "tree", "hierarchical"])
@pytest.mark.parametrize("nics", [8, 4])
def test_world_collectives_are_rail_aligned(algo, nics):
    plan = make_plan(4, 8, nics=nics, channels=4)
    topo = topology.build(plan)
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=list(range(32)), b=4 * 50_000, algo=algo)]),
                          topo, plan)
    net = m["link"] == "network"
    assert net.any()
    assert np.all(topo.nic_rail[m["src_nic"][net]] == topo.nic_rail[m["dst_nic"][net]])
    assert np.all(topo.nic_node[m["src_nic"][net]] == m["src_node"][net])
    assert np.all(topo.nic_node[m["dst_nic"][net]] == m["dst_node"][net])
    if algo == "ring":
        # channels spread over the rails: channel c uses NIC c of each node
        d = data_rows(m) & net
        for c in range(4):
            assert set(m["src_nic"][d & (m["channel"] == c)] % nics) == {c % nics}


def _crossings(ring, gpus=8):
    """(leaving GPU, entering GPU) of each inter-node hop, as local indices."""
    out = []
    for a, b in zip(ring, ring[1:] + ring[:1]):
        if a // gpus != b // gpus:
            out.append((a % gpus, b % gpus))
    return out


def test_real_rings_leave_and_enter_on_one_nic_and_ours_do_too():
    rings = log_rings()
    # the excerpt shows channels 0-4 of 8 (then "...")
    assert sorted(rings) == list(range(5)) and all(sorted(r) == list(range(16)) for r in rings.values())
    # on this machine GPUs 2k and 2k+1 share a NIC (``4[4] -> ... via NET/IB/3`` and
    # ``5[5] -> 12[4] [send] via NET/IB/3``): every ring leaves a node from the partner of the GPU
    # where it entered the other node, i.e. rail-aligned
    for r in rings.values():
        for leave, enter in _crossings(r):
            assert leave // 2 == enter // 2
    assert _crossings(rings[0]) == [(1, 0), (1, 0)]                 # 1 -> 8, 9 -> 0
    assert _crossings(rings[3]) == [(5, 4), (5, 4)]                 # 5 -> 12, 13 -> 4
    plan = make_plan(2, 8, nics=4, channels=8)
    topo = topology.build(plan)
    ours = collectives.ring_orders(list(range(16)), topo, 8)
    for c in range(8):
        ring = ours[c].tolist()
        assert sorted(ring) == list(range(16))
        cross = _crossings(ring)
        assert len(cross) == 2 and all(a // 2 == b // 2 for a, b in cross)
        assert cross[0][1] == 2 * (c % 4)                             # enters on the channel's NIC
    assert _crossings(ours[0].tolist()) == _crossings(rings[0])


def test_measured_rings_override():
    rings = log_rings()
    plan = make_plan(2, 8, nics=4, channels=8)
    topo = topology.build(plan)
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=list(range(16)), b=4 * 16 * 8 * 10)]),
                          topo, plan, rings=rings)
    d = data_rows(m)
    for c in range(8):                       # channels 5-7 reuse the measured rings cyclically
        r = rings[c % 5]
        nxt = {a: b for a, b in zip(r, r[1:] + r[:1])}
        sel = d & (m["channel"] == c)
        assert all(nxt[int(s)] == int(t) for s, t in zip(m["src_rank"][sel], m["dst_rank"][sel]))
    # a communicator not described by the measured ring keeps the computed ring
    m2 = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 8], b=400)]), topo, plan, rings=rings)
    assert set(zip(m2["src_rank"][data_rows(m2)], m2["dst_rank"][data_rows(m2)])) == {(0, 8), (8, 0)}


def test_plan_ring_order():
    order = [0, 2, 4, 6, 8, 10, 12, 14, 15, 13, 11, 9, 7, 5, 3, 1]
    plan = make_plan(2, 8, channels=2, ring_order=order)
    topo = topology.build(plan)
    m = collectives.lower(make_coll([dict(op="all_gather", ranks=list(range(16)), b=400),
                                     dict(op="all_gather", ranks=[1, 2, 3, 4], b=400)]), topo, plan)
    d = data_rows(m) & (m["op_id"] == 0)
    nxt = {a: b for a, b in zip(order, order[1:] + order[:1])}
    assert all(nxt[int(s)] == int(t) for s, t in zip(m["src_rank"][d], m["dst_rank"][d]))
    d = data_rows(m) & (m["op_id"] == 1)                       # sub-communicator: order restricted
    assert set(zip(m["src_rank"][d].tolist(), m["dst_rank"][d].tolist())) == {(2, 4), (4, 3), (3, 1), (1, 2)}
    bad = make_plan(2, 8, ring_order=[0, 1, 2])
    with pytest.raises(WiretraceError, match="ring_order"):
        collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 9], b=400)]), topology.build(bad), bad)


def test_pxn_sends_on_the_destination_rail():
    plan = make_plan(2, 8, channels=1)
    topo = topology.build(plan)
    m = collectives.lower(make_coll([dict(op="send_recv", ranks=[0, 9], src=0, dst=9, b=4096)]), topo, plan)
    d = data_rows(m)
    assert set(m["src_nic"][d]) == {1} and set(m["dst_nic"][d]) == {9}   # node 0's NIC 1 -> node 1's NIC 1
    cts = ~d
    assert set(m["src_nic"][cts]) == {9} and set(m["dst_nic"][cts]) == {1}


def test_explicit_gpu_nic_map_and_rails():
    plan = make_plan(2, 4, nics=4, channels=1)
    doc = {"cluster": {"nodes": 2, "gpus_per_node": 4, "nics_per_node": 4,
                       "gpu_nic_map": [3, 2, 1, 0], "rails": [0, 1, 2, 3]}}
    from wiretrace import plan as P
    plan = P.from_dict(doc, require_model=False)
    topo = topology.build(plan)
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=[g, 4 + g], b=4000) for g in range(4)]), topo, plan)
    d = data_rows(m)
    for g in range(4):
        sel = d & (m["op_id"] == g)
        assert set(m["src_nic"][sel] % 4) == {3 - g} and set(m["dst_nic"][sel] % 4) == {3 - g}
    assert topo.nic_rail.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
