"""Where a communicator's ranks sit and in which order the algorithms visit them.

Rings, trees and the hierarchical scheme are built per NCCL channel from the topology:

* **Rails.** Channel ``c`` of a communicator uses one NIC per node: the ``c``-th (cyclically) of
  the local NICs that the communicator's GPUs use on every node (NCCL gives each channel its own
  NIC so that channels spread over the rails; ``src/graph/search.cc``, ``src/graph/paths.cc``).
* **Ring order.** A ring visits the nodes in the order they first appear in the communicator; on
  each node it enters at the GPU attached to the channel's NIC and leaves from a GPU sharing that
  NIC when there is one (the pattern of NCCL's ring search with ``NCCL_CROSS_NIC`` off: the
  inter-node edge is ``NET n -> GPU ... GPU -> NET n``). Real orders from an NCCL log show it:
  ``0 5 4 7 6 3 2 1 | 8 13 ...`` enters node 0 at GPU 0 and leaves from GPU 1, two GPUs behind
  the same NIC. When the leaving GPU has no NIC on the channel's rail, NCCL's PXN (PCI x NVLink,
  NCCL >= 2.12, ``NCCL_PXN_DISABLE=0`` by default) moves the data over NVLink to the GPU next to
  the rail's NIC, so the hop is rail-aligned either way; :func:`network_nics` applies that rule.
* **Trees.** NCCL's double binary tree over the nodes (``src/graph/trees.cc``,
  ``ncclGetBtree``/``ncclGetDtree``: tree 1 mirrors tree 0 for an even node count and shifts it
  by one for an odd count) with a chain of the node's GPUs below each node's head; the
  ``NCCL_TOPO_PATTERN_BALANCED_TREE`` pattern of ``src/graph/connect.cc`` (``ncclTopoPreset``):
  the parent link and child 1 on the chain's first GPU, child 0 on its second.

Orders are arrays of *communicator indices* (positions in the collective's ``ranks`` list), one
row per channel, so that one lowering template serves every communicator of the same shape.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..errors import WiretraceError
from ..topology import Topology


def node_groups(ranks: np.ndarray, topo: Topology) -> list[np.ndarray]:
    """Communicator indices grouped by node, nodes in order of first appearance, GPUs by local index.

    Parameters
    ----------
    ranks : (n,) global ranks of the communicator.
    topo : placement of the ranks.

    Returns
    -------
    list of int arrays (communicator indices), one per node.
    """
    node = topo.rank_node[ranks]
    _, first = np.unique(node, return_index=True)
    out = []
    for nd in node[np.sort(first)]:
        idx = np.nonzero(node == nd)[0]
        out.append(idx[np.argsort(topo.rank_local[ranks[idx]], kind="stable")])
    return out


def channel_nics(ranks: np.ndarray, topo: Topology, channels: int) -> list[int]:
    """Local NIC index used by each channel: the communicator's NICs present on every node, cyclically.

    Falls back to the NICs of the first node when the nodes share no local NIC index.
    """
    groups = node_groups(ranks, topo)
    per_node = [np.unique(topo.nic_local[topo.rank_nic[ranks[g]]]) for g in groups]
    common = per_node[0]
    for s in per_node[1:]:
        common = np.intersect1d(common, s)
    if len(common) == 0:
        common = per_node[0]
    return [int(common[c % len(common)]) for c in range(channels)]


def _intra_order(members: np.ndarray, ranks: np.ndarray, topo: Topology, nic_local: int,
                 partner_last: bool) -> np.ndarray:
    """Order of one node's members for a channel whose NIC is ``nic_local``.

    The first member is the GPU on that NIC (else the first GPU); a second GPU on the same NIC, if
    any, goes last (ring: it leaves the node) or second (tree: it serves child 0).
    """
    nics = topo.nic_local[topo.rank_nic[ranks[members]]]
    on = np.nonzero(nics == nic_local)[0]
    e = int(on[0]) if len(on) else 0
    rest = [(e + k) % len(members) for k in range(1, len(members))]
    partner = [i for i in rest if nics[i] == nics[e]]
    if partner:
        rest.remove(partner[0])
        rest = rest + partner[:1] if partner_last else partner[:1] + rest
    return members[[e] + rest]


def ring_orders(ranks: Sequence[int], topo: Topology, channels: int,
                rings: Mapping[int, Sequence[int]] | None = None,
                ring_order: Sequence[int] = ()) -> np.ndarray:
    """Ring order of a communicator for every channel, as communicator indices.

    Parameters
    ----------
    ranks : global ranks of the communicator (the collective's ``ranks``).
    topo : placement.
    channels : number of NCCL channels.
    rings : optional measured rings, channel -> global ranks in ring order (for example read from
        an NCCL log by ``wiretrace.ingest``). Channel ``c`` uses ``rings[keys[c % len(keys)]]``
        restricted to the communicator's ranks. Ignored for a communicator whose ranks are not all
        in the ring (a measured ring describes one communicator).
    ring_order : optional global order (``plan.collectives.ring_order``): every communicator's
        ring visits its ranks in this order, on every channel.

    Returns
    -------
    (channels, n) int64 array of communicator indices.

    Raises
    ------
    WiretraceError : ``ring_order`` does not contain every rank of the communicator.
    """
    ranks = np.asarray(ranks, dtype=np.int64)
    n = len(ranks)
    pos_of = {int(r): i for i, r in enumerate(ranks)}
    if rings:
        keys = sorted(rings)
        rows = []
        for c in range(channels):
            ring = [pos_of[int(r)] for r in rings[keys[c % len(keys)]] if int(r) in pos_of]
            if len(ring) != n:
                rows = []
                break
            rows.append(ring)
        if rows:
            return np.asarray(rows, dtype=np.int64)
    if ring_order:
        ring = [pos_of[int(r)] for r in ring_order if int(r) in pos_of]
        if len(set(ring)) != n:
            missing = sorted(set(ranks.tolist()) - set(int(r) for r in ring_order))
            raise WiretraceError(f"plan $.collectives.ring_order lacks ranks {missing[:8]} of a "
                                 f"communicator of {n} ranks")
        return np.tile(np.asarray(ring, dtype=np.int64), (channels, 1))
    groups = node_groups(ranks, topo)
    nics = channel_nics(ranks, topo, channels)
    out = np.empty((channels, n), dtype=np.int64)
    for c in range(channels):
        out[c] = np.concatenate([_intra_order(g, ranks, topo, nics[c], True) for g in groups])
    return out


def tree_orders(ranks: Sequence[int], topo: Topology, channels: int) -> tuple[np.ndarray, list[int]]:
    """Node-major orders for the tree: per channel, each node's chain (head first).

    Returns
    -------
    orders : (channels, n) communicator indices, node after node.
    node_sizes : number of members of each node, in node order.
    """
    ranks = np.asarray(ranks, dtype=np.int64)
    groups = node_groups(ranks, topo)
    nics = channel_nics(ranks, topo, channels)
    out = np.empty((channels, len(ranks)), dtype=np.int64)
    for c in range(channels):
        out[c] = np.concatenate([_intra_order(g, ranks, topo, nics[c], False) for g in groups])
    return out, [len(g) for g in groups]


def btree(nranks: int, rank: int) -> tuple[int, int, int, int]:
    """NCCL's binary tree (``ncclGetBtree``, ``src/graph/trees.cc``): (up, down0, down1, child type).

    Root is 0; -1 marks no neighbour; the child type says whether ``rank`` is its parent's first
    (0) or second (1) child.
    """
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1 if nranks > 1 else -1), 0
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    ctype = 0 if rank < up else 1
    low = bit >> 1
    d0 = -1 if low == 0 else rank - low
    d1 = -1 if low == 0 else rank + low
    while d1 >= nranks:
        d1 = -1 if low == 0 else rank + low
        low >>= 1
    return up, d0, d1, ctype


def dtree_parent(nranks: int, rank: int, tree: int) -> tuple[int, int]:
    """Parent and child type of ``rank`` in tree 0 or 1 of NCCL's double binary tree (``ncclGetDtree``)."""
    if tree == 0:
        u, _, _, ct = btree(nranks, rank)
        return u, ct
    if nranks % 2 == 1:
        u, _, _, ct = btree(nranks, (rank - 1 + nranks) % nranks)
        return (-1 if u == -1 else (u + 1) % nranks), ct
    u, _, _, ct = btree(nranks, nranks - 1 - rank)
    return (-1 if u == -1 else nranks - 1 - u), ct


def tree_parents(node_sizes: Sequence[int], tree: int) -> np.ndarray:
    """Parent of every position of a node-major order in one tree (-1 for the root).

    Inside a node the chain runs head -> second -> ... (each GPU's parent is the previous one).
    A node's head connects to its parent node: to that node's head when it is child 1 there, to
    its second GPU when child 0 (BALANCED_TREE; a one-GPU node serves both).
    """
    m = len(node_sizes)
    base = np.concatenate([[0], np.cumsum(node_sizes)[:-1]]).astype(np.int64)
    par = np.full(int(sum(node_sizes)), -1, dtype=np.int64)
    for i in range(m):
        for k in range(1, node_sizes[i]):
            par[base[i] + k] = base[i] + k - 1
        up, ct = dtree_parent(m, i, tree)
        if up >= 0:
            par[base[i]] = base[up] + (1 if ct == 0 and node_sizes[up] > 1 else 0)
    return par


def network_nics(src: np.ndarray, dst: np.ndarray, topo: Topology) -> tuple[np.ndarray, np.ndarray]:
    """NICs of messages between global ranks: the receiver's NIC, and on the sender's node the NIC
    on the receiver's rail (PXN, NCCL >= 2.12: data crosses NVLink to the GPU next to that NIC and
    never crosses rails), or the sender's own NIC when its node has no NIC on that rail.

    Parameters
    ----------
    src, dst : global ranks (same length).

    Returns
    -------
    src_nic, dst_nic : int32 global NIC indices.
    """
    npn = topo.nics_per_node
    dst_nic = topo.rank_nic[dst]
    own = topo.rank_nic[src]
    want_rail = topo.nic_rail[dst_nic]
    same_rail = topo.nic_rail[own] == want_rail
    # NIC with the same local index on the sender's node sits on the same rail (rails are per
    # local NIC index); fall back to the first NIC of the rail, else the sender's own NIC.
    cand = topo.rank_node[src].astype(np.int64) * npn + topo.nic_local[dst_nic]
    rail_local = np.full(int(topo.nic_rail.max()) + 1, -1, dtype=np.int64)
    for k in range(npn - 1, -1, -1):
        rail_local[topo.nic_rail[k]] = k
    alt = np.where(rail_local[want_rail] >= 0,
                   topo.rank_node[src].astype(np.int64) * npn + rail_local[want_rail], own)
    cand = np.where(topo.nic_rail[np.minimum(cand, topo.num_nics - 1)] == want_rail, cand, alt)
    src_nic = np.where(same_rail, own, cand)
    return src_nic.astype(np.int32), dst_nic.astype(np.int32)
