"""Which algorithm a collective uses: the plan's choice, or NCCL's cost model for ``auto``.

For ``auto`` an all-reduce gets the algorithm of the fastest (algorithm, protocol) pair of NCCL's
tuning model (``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``, NCCL
2.18-2.19): ``time = latency + bytes / (1000 * algBw)`` with

* latency (µs): ``baseLat[algo][proto]`` plus, for the ring, ``(nsteps - nInterSteps) * intraLat
  + nInterSteps * interLat`` (``nsteps = 2(n-1)``, ``nInterSteps = 2 nNodes`` across nodes); for
  the tree ``2 ((n/nNodes - 1) intraLat + log2(nNodes) interLat)``; the ring's latency times 1.4
  past 64 bytes per rank and channel across nodes ("plateau effect of ring");
* bandwidth: the bus bandwidth of a GPU (its NIC across nodes, NVLink inside one), times 1/4
  for ring LL, 0.92 for ring LL128, 0.92 for the tree (1/3.8 more for LL, 120/128 for LL128),
  converted to algorithm bandwidth by ``n / nsteps`` (ring) or 0.5 (tree), the tree's correction
  factor for medium sizes applied.

The result is NCCL's behaviour: the tree (with LL/LL128) for small inter-node all-reduces, the
ring for large ones. Other operations use the ring (NCCL has only ring for broadcast, reduce,
all_gather, reduce_scatter without NVLS/CollNet), and point-to-point operations the direct
pairwise exchange.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..errors import WiretraceError
from ..plan import Plan
from ..topology import Topology

ALGORITHMS = ("ring", "tree", "halving_doubling", "direct", "hierarchical")
PROTOCOLS = ("ll", "ll128", "simple")

# tuning.cc: Tree/Ring x { LL, LL128, Simple }, microseconds
BASE_LAT = {"tree": (6.8, 14.0, 0.0), "ring": (6.6, 14.0, 8.4)}
HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4)},
    "net": {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0)},
}
NET_OVERHEAD_US = 1.0     # getNetOverhead() on x86 Intel; x3 for Simple
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)


def _log2i(x: int) -> int:
    return max(int(x).bit_length() - 1, 0)


def nccl_time_us(algo: str, proto: str, nbytes: int, nranks: int, nnodes: int,
                 bus_gbps: float) -> float:
    """NCCL's modelled time of an all-reduce (µs) for one algorithm and protocol.

    Parameters
    ----------
    algo : "ring" or "tree"; proto : "ll", "ll128" or "simple".
    nbytes : buffer size (bytes); nranks, nnodes : communicator size and node count.
    bus_gbps : bus bandwidth of one GPU in GB/s (10^9 bytes/s).
    """
    p = PROTOCOLS.index(proto)
    nsteps = 2 * (nranks - 1)
    inter = 2 * nnodes if nnodes > 1 else 0
    bw = bus_gbps
    if algo == "ring":
        if proto == "ll":
            bw *= 1.0 / 4.0
        elif proto == "ll128":
            bw *= 0.92 if nranks / nnodes >= 2 else 0.7
        bw *= nranks / nsteps
    else:
        bw *= 0.92
        if proto == "ll":
            bw /= 3.8
        elif proto == "ll128":
            bw *= (7.0 / 9.0) if nnodes == 1 else 120.0 / 128.0
        bw *= 0.5
    lat = BASE_LAT[algo][p]
    intra = HW_LAT["nvlink"][algo][p]
    interlat = HW_LAT["net"][algo][p]
    if algo == "ring":
        if nnodes > 1:
            intra = max(intra, NET_OVERHEAD_US * (3 if proto == "simple" else 1))
        lat += (nsteps - inter) * intra + inter * interlat
        if proto == "simple" and nnodes > 1 and nbytes / nranks >= 64:
            lat *= 1.4
    else:
        lat += 2 * ((nranks // nnodes - 1) * intra + _log2i(nnodes) * interlat)
        log_size = _log2i(max(nbytes >> 6, 1))
        if log_size < 23:
            bw *= TREE_CORRECTION[p][log_size]
    return lat + nbytes / (1000.0 * bw)


def auto_all_reduce(nbytes: int, nranks: int, nnodes: int, bus_gbps: float) -> str:
    """"ring" or "tree": the algorithm of NCCL's fastest (algorithm, protocol) pair."""
    best = min((nccl_time_us(a, p, nbytes, nranks, nnodes, bus_gbps), a)
               for a in ("ring", "tree") for p in PROTOCOLS)
    return best[1]


def _applicable(op: str, algo: str, equal_nodes: bool) -> str:
    if op in ("all_to_all", "all_to_allv", "send_recv"):
        return "direct"
    if op == "all_reduce":
        if algo == "hierarchical" and not equal_nodes:
            return "ring"
        return "ring" if algo == "direct" else algo
    return "ring"


def algorithm_names(coll: pa.Table, topo: Topology, plan: Plan, rows=None) -> np.ndarray:
    """Resolved algorithm of every row (object array of str); see :func:`resolve_algorithms`.

    ``rows`` : the table already read by :func:`wiretrace.collectives.rows.read` (optional).
    """
    from .lower import OPS
    from .rows import read, unique_rows

    r = rows if rows is not None else read(coll, topo, OPS)
    n = len(r.op_id)
    out = np.empty(n, dtype=object)
    if n == 0:
        return out
    given = np.array([(g or "auto").lower() for g in r.given_algorithm.tolist()], dtype=object)
    c = plan.cluster
    nic_share = min(1.0, c.nics_per_node / c.gpus_per_node)
    first, inv = unique_rows(r.op, given, r.bytes_per_rank, r.comm)
    res = []
    for i in first:                      # one per distinct (op, algorithm, size, communicator)
        op, a = r.op[i], given[i]
        if a == "auto":
            a = plan.collectives.algorithm_for(op)
        if a not in ALGORITHMS + ("auto",):
            raise WiretraceError(f"collectives row {i} (op_id {r.op_id[i]}): algorithm {a!r} is not one of "
                                 f"{', '.join(ALGORITHMS + ('auto',))}")
        ranks = r.comms[r.comm[i]]
        nodes, counts = np.unique(topo.rank_node[ranks], return_counts=True)
        if a == "auto":
            if op == "all_reduce" and len(ranks) > 1:
                bus = (c.nic_rate_bps * nic_share if len(nodes) > 1 else c.nvlink_rate_bps) / 8e9
                a = auto_all_reduce(int(r.bytes_per_rank[i]), len(ranks), len(nodes), bus)
            else:
                a = "ring"
        res.append(_applicable(op, a, len(set(counts.tolist())) <= 1))
    out[:] = np.asarray(res, dtype=object)[inv]
    return out


def resolve_algorithms(coll: pa.Table, topo: Topology, plan: Plan) -> pa.Table:
    """Return ``coll`` with its ``algorithm`` column resolved to the algorithm used.

    A row's own algorithm wins; an empty or ``auto`` one takes ``plan.collectives.algorithm``
    (one name or a per-op mapping); ``auto`` then follows NCCL's cost model (module docstring:
    tree for small inter-node all-reduces, ring for large). Algorithms that do not exist for an
    operation fall back to NCCL's: ``direct`` for all_to_all(v) and send_recv, ``ring`` for
    everything else that is not an all-reduce; ``hierarchical`` needs the same number of ranks on
    every node (else ``ring``).

    Raises
    ------
    WiretraceError : an algorithm name that wiretrace does not know.
    """
    names = algorithm_names(coll, topo, plan)
    idx = coll.schema.get_field_index("algorithm")
    f = coll.schema.field(idx)
    arr = pa.array(names.tolist(), type=pa.string()).dictionary_encode().cast(f.type)
    return coll.set_column(idx, f, arr)

