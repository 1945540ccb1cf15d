"""Placement and addressing of ranks and NICs (wiretrace.topology)."""

from __future__ import annotations

import ipaddress

import numpy as np

from wiretrace import plan as P, topology


def make(nodes=2, gpus=8, nics=None, **cluster):
    c = {"nodes": nodes, "gpus_per_node": gpus, **cluster}
    if nics:
        c["nics_per_node"] = nics
    return topology.build(P.from_dict({"cluster": c}, require_model=False))


def test_rank_to_node_gpu_nic_rail_optimized():
    t = make(2, 8)
    assert t.world_size == 16 and t.num_nics == 16
    assert t.rank_node.tolist() == [0] * 8 + [1] * 8
    assert t.rank_local.tolist() == list(range(8)) * 2
    assert t.rank_nic.tolist() == list(range(16))          # GPU i <-> NIC i, global = node*8 + i
    assert t.nic_rail.tolist() == list(range(8)) * 2


def test_fewer_nics_are_shared_by_neighbouring_gpus():
    t = make(2, 8, nics=4)
    assert t.rank_nic.tolist()[:8] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert t.rank_nic.tolist()[8:] == [4, 4, 5, 5, 6, 6, 7, 7]


def test_explicit_gpu_nic_map_and_rails():
    t = make(2, 4, nics=2, gpu_nic_map=[1, 1, 0, 0], rails=[5, 6])
    assert t.rank_nic.tolist() == [1, 1, 0, 0, 3, 3, 2, 2]
    assert t.nic_rail.tolist() == [5, 6, 5, 6]


def test_addresses_are_documented_and_unique():
    t = make(3, 8)
    assert t.mac_str(0) == "02:00:00:00:00:00"
    assert t.mac_str(8 * 2 + 5) == "02:00:00:00:02:05"
    assert t.ipv4_str(3) == "10.3.0.1" and t.ipv4_str(8 + 3) == "10.3.0.2"
    assert t.ipv6_str(8 * 2 + 7) == "fd00::7:0:3"
    assert len({t.ipv4_str(i) for i in range(t.num_nics)}) == t.num_nics
    assert len({t.mac_str(i) for i in range(t.num_nics)}) == t.num_nics
    assert t.nic_lid.tolist() == list(range(1, t.num_nics + 1))


def test_gid_is_ipv4_mapped_for_rocev2_over_ipv4():
    t = make(1, 2)
    gid = bytes(t.nic_gid(4)[1])
    assert ipaddress.IPv6Address(gid).ipv4_mapped == ipaddress.IPv4Address("10.1.0.1")
    assert np.array_equal(t.nic_gid(6), t.nic_ipv6)
