"""Frame layouts: how long each frame is and where its headers sit, from the opcode and the plan.

RoCEv2 frame: Ethernet (14) [802.1Q tag 4] IPv4 (20) | IPv6 (40), UDP (8), BTH (12), the
opcode's extension headers, payload, pad (0..3), ICRC (4). Native InfiniBand: LRH (8) [GRH (40)],
BTH, extension headers, payload, pad, ICRC (4), VCRC (2). No FCS (captures do not keep it).
Ethernet adds preamble+SFD (8), FCS (4) and the inter-frame gap (12) on the wire (IEEE 802.3
clause 4.4.2), used for serialization times.
"""

from __future__ import annotations

import numpy as np

from ..plan import Plan
from ..topology import Topology
from . import headers as H

ETH_WIRE_EXTRA = 8 + 4 + 12
"""Bytes an Ethernet frame occupies on the wire beyond the captured frame: preamble+SFD, FCS, IFG."""
IB_WIRE_EXTRA = 2
"""Start and end delimiters of an IB packet on the link (IBTA vol. 2, 5.3), in byte times."""


def vlan_tag(plan: Plan) -> int | None:
    """VLAN ID of the 802.1Q tag RoCEv2 frames carry, or None for untagged frames.

    ``transport.vlan`` tags frames with that VLAN and ``transport.pcp``; a ``pcp`` without a
    ``vlan`` gives priority-tagged frames (VLAN ID 0, IEEE 802.1Q clause 9.6: "priority-tagged
    frame"), as NICs send them for PFC on an untagged port. Native IB frames are never tagged."""
    t = plan.transport
    if t.kind == "ib":
        return None
    if t.vlan is not None:
        return int(t.vlan)
    return 0 if t.pcp else None


def base_header_len(plan: Plan) -> int:
    """Bytes from the start of the frame through the BTH for RoCEv2 (Ethernet [VLAN] IP UDP BTH)
    or native IB without GRH (LRH BTH)."""
    t = plan.transport
    if t.kind == "ib":
        return H.LRH.length + H.BTH.length
    l2 = H.ETHERNET.length + (H.DOT1Q.length if vlan_tag(plan) is not None else 0)
    l3 = H.IPV4.length if t.ip_version == 4 else H.IPV6.length
    return l2 + l3 + H.UDP.length + H.BTH.length


def trailer_len(plan: Plan) -> int:
    """ICRC (4) for RoCEv2; ICRC + VCRC (6) for native IB."""
    return H.ICRC_LEN + (H.VCRC_LEN if plan.transport.kind == "ib" else 0)


def wire_extra(plan: Plan) -> int:
    return IB_WIRE_EXTRA if plan.transport.kind == "ib" else ETH_WIRE_EXTRA


def nic_subnet(topo: Topology, plan: Plan, nic: np.ndarray) -> np.ndarray:
    """IB subnet of each NIC: nodes split evenly into ``cluster.subnets`` consecutive groups."""
    s = max(1, plan.cluster.subnets)
    return (topo.nic_node[np.asarray(nic, dtype=np.int64)].astype(np.int64) * s) // max(1, topo.nodes)


def has_grh(src_nic: np.ndarray, dst_nic: np.ndarray, topo: Topology, plan: Plan) -> np.ndarray:
    """Whether a native-IB frame carries a GRH: always with ``transport.grh``, else when source
    and destination sit in different subnets (routed traffic needs global addresses, IBTA 8.1).
    All False for RoCEv2 (its IP header plays the GRH's role)."""
    n = len(np.asarray(src_nic))
    if plan.transport.kind != "ib":
        return np.zeros(n, dtype=bool)
    if plan.transport.grh:
        return np.ones(n, dtype=bool)
    if plan.cluster.subnets <= 1:
        return np.zeros(n, dtype=bool)
    return nic_subnet(topo, plan, src_nic) != nic_subnet(topo, plan, dst_nic)


def frame_len(opcode: np.ndarray, payload_len: np.ndarray, pad: np.ndarray, grh: np.ndarray | None,
              plan: Plan) -> np.ndarray:
    """Frame length in bytes (captured bytes of a whole frame, no FCS), ``(n,)`` int32."""
    base = base_header_len(plan) + trailer_len(plan)
    out = (base + H.EXT_LEN[np.asarray(opcode, dtype=np.int64)].astype(np.int64)
           + np.asarray(payload_len, dtype=np.int64) + np.asarray(pad, dtype=np.int64))
    if grh is not None:
        out = out + np.asarray(grh, dtype=np.int64) * H.GRH.length
    return out.astype(np.int32)
