"""Cluster placement and addresses: ranks -> (node, local GPU) -> NIC -> MAC, IPv4, IPv6, GID, LID.

Placement follows torchrun/Slurm launchers as Megatron-LM assumes them: global rank r runs on node
``r // gpus_per_node`` as local GPU ``r % gpus_per_node``. GPU i of a node uses NIC i
(rail-optimized, as on DGX/HGX H100 with one ConnectX-7 per GPU); with fewer NICs than GPUs,
neighbouring GPUs share one (GPU i -> NIC ``i * nics_per_node // gpus_per_node``, the PCIe-switch
pairing); ``cluster.gpu_nic_map`` overrides it. NIC ``k`` of node ``n`` has the global index
``n * nics_per_node + k`` and sits on rail (leaf switch) ``cluster.rails[k]`` (default ``k``).

Addresses (deterministic, documented so that captures can be read by eye):

* MAC: locally administered ``02:00:00:NH:NL:KK`` from ``cluster.mac_base``: bytes 3-4 the node
  (big-endian), byte 5 the local NIC.
* IPv4: one /16 per rail, ``ipv4_base + rail*2^16 + node + 1``; with the default base
  ``10.0.0.0`` NIC 3 of node 0 is ``10.3.0.1`` (rail-optimized fabrics give each rail its subnet).
* IPv6: ``ipv6_prefix`` + ``rail`` in bits 32..47 from the end + ``node + 1`` in the last 32 bits:
  ``fd00::3:0:1``.
* GID: the IPv4-mapped IPv6 address ``::ffff:a.b.c.d`` for RoCEv2 over IPv4 (what ``ibv_query_gid``
  reports for a RoCE v2 IPv4 GID), the IPv6 address otherwise.
* LID (native InfiniBand): global NIC index + 1 (LID 0 is reserved).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import numpy as np

from .plan import Plan


@dataclass(frozen=True)
class Topology:
    """Endpoints of a cluster as columns.

    Rank arrays have length ``world_size``; NIC arrays have length ``nodes * nics_per_node``.
    ``nic_mac`` is ``(num_nics, 6)`` uint8, ``nic_ipv6`` and ``nic_gid`` ``(num_nics, 16)`` uint8,
    ``nic_ipv4`` uint32 (host order).
    """

    nodes: int
    gpus_per_node: int
    nics_per_node: int
    rank_node: np.ndarray
    rank_local: np.ndarray
    rank_nic: np.ndarray
    nic_node: np.ndarray
    nic_local: np.ndarray
    nic_rail: np.ndarray
    nic_mac: np.ndarray
    nic_ipv4: np.ndarray
    nic_ipv6: np.ndarray
    nic_lid: np.ndarray
    nic_rate_bps: float
    nvlink_rate_bps: float
    latency_ns: int
    nvlink_latency_ns: int

    @property
    def world_size(self) -> int:
        return len(self.rank_node)

    @property
    def num_nics(self) -> int:
        return len(self.nic_node)

    def nic_gid(self, ip_version: int = 4) -> np.ndarray:
        """GIDs ``(num_nics, 16)``: IPv4-mapped for ``ip_version`` 4, else the IPv6 addresses."""
        if ip_version == 6:
            return self.nic_ipv6
        gid = np.zeros((self.num_nics, 16), dtype=np.uint8)
        gid[:, 10:12] = 0xFF
        gid[:, 12:] = self.nic_ipv4.astype(">u4").view(np.uint8).reshape(-1, 4)
        return gid

    def ipv4_str(self, nic: int) -> str:
        return str(ipaddress.IPv4Address(int(self.nic_ipv4[nic])))

    def ipv6_str(self, nic: int) -> str:
        return str(ipaddress.IPv6Address(bytes(self.nic_ipv6[nic])))

    def mac_str(self, nic: int) -> str:
        return ":".join(f"{b:02x}" for b in self.nic_mac[nic])

    def nic_name(self, nic: int) -> str:
        """Interface-style name of a NIC, ``node<N>/mlx5_<k>`` (used for pcapng interfaces)."""
        return f"node{int(self.nic_node[nic])}/mlx5_{int(self.nic_local[nic])}"


def build(plan: Plan) -> Topology:
    """Place the ranks of ``plan`` on its cluster and address every NIC.

    Raises nothing for a validated plan (plan.py checks the map lengths).
    """
    c = plan.cluster
    world = c.world_size
    ranks = np.arange(world, dtype=np.int64)
    rank_node = (ranks // c.gpus_per_node).astype(np.int32)
    rank_local = (ranks % c.gpus_per_node).astype(np.int32)
    if c.gpu_nic_map:
        gpu_to_nic = np.asarray(c.gpu_nic_map, dtype=np.int32)
    else:
        gpu_to_nic = (np.arange(c.gpus_per_node) * c.nics_per_node // c.gpus_per_node).astype(np.int32)
    rank_nic = (rank_node * c.nics_per_node + gpu_to_nic[rank_local]).astype(np.int32)

    num_nics = c.nodes * c.nics_per_node
    nics = np.arange(num_nics, dtype=np.int64)
    nic_node = (nics // c.nics_per_node).astype(np.int32)
    nic_local = (nics % c.nics_per_node).astype(np.int32)
    rails = np.asarray(c.rails, dtype=np.int32) if c.rails else np.arange(c.nics_per_node, dtype=np.int32)
    nic_rail = rails[nic_local]

    base_mac = np.frombuffer(bytes.fromhex(c.mac_base.replace(":", "")), dtype=np.uint8)
    mac = np.tile(base_mac, (num_nics, 1))
    mac[:, 3] = (nic_node >> 8) & 0xFF
    mac[:, 4] = nic_node & 0xFF
    mac[:, 5] = nic_local & 0xFF

    v4base = int(ipaddress.IPv4Address(c.ipv4_base))
    ipv4 = (v4base + (nic_rail.astype(np.int64) << 16) + nic_node + 1).astype(np.uint32)

    v6base = int(ipaddress.IPv6Address(c.ipv6_prefix))
    ipv6 = np.zeros((num_nics, 16), dtype=np.uint8)
    for i in range(num_nics):  # a few thousand NICs at most: setup, not a hot path
        v = v6base + (int(nic_rail[i]) << 32) + int(nic_node[i]) + 1
        ipv6[i] = np.frombuffer(v.to_bytes(16, "big"), dtype=np.uint8)

    return Topology(
        nodes=c.nodes, gpus_per_node=c.gpus_per_node, nics_per_node=c.nics_per_node,
        rank_node=rank_node, rank_local=rank_local, rank_nic=rank_nic,
        nic_node=nic_node, nic_local=nic_local, nic_rail=nic_rail, nic_mac=mac,
        nic_ipv4=ipv4, nic_ipv6=ipv6, nic_lid=(nics + 1).astype(np.uint16),
        nic_rate_bps=c.nic_rate_bps, nvlink_rate_bps=c.nvlink_rate_bps,
        latency_ns=c.latency_ns, nvlink_latency_ns=c.nvlink_latency_ns,
    )
