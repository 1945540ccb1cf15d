"""Collectives table -> messages columns.

Collectives that share a shape (operation, algorithm, sizes, communicator structure) share one
lowering *template* built with NumPy in communicator indices; the template is then mapped to the
global ranks of each communicator and repeated for every call (no per-message Python loop).

A template is the algorithm's transfers (:mod:`.algorithms`) cut into step slices (``chunk``
numbers them), each network slice preceded by its clear-to-send from the receiver, and, with
``qps_per_connection > 1``, given its QP index (or split across the QPs). See
:mod:`.protocol` for the NCCL facts used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa

from ..errors import WiretraceError
from ..plan import DTYPE_BYTES, Plan
from ..topology import Topology
from . import algorithms as alg
from . import placement, protocol

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
       "all_to_allv", "send_recv")
P2P_OPS = ("all_to_all", "all_to_allv", "send_recv")


@dataclass
class Template:
    """Messages of one collective shape, in communicator indices, in send order."""

    src: np.ndarray
    dst: np.ndarray
    step: np.ndarray
    channel: np.ndarray
    chunk: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    wire: np.ndarray
    is_cts: np.ndarray
    is_net: np.ndarray
    qp_index: np.ndarray
    reduce: np.ndarray

    def __len__(self) -> int:
        return len(self.src)


def _cumcount(keys: np.ndarray) -> np.ndarray:
    """Occurrence number of each row among rows with the same key, in row order."""
    if len(keys) == 0:
        return np.zeros(0, np.int64)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    start = np.concatenate([[True], sk[1:] != sk[:-1]])
    first = np.maximum.accumulate(np.where(start, np.arange(len(sk)), 0))
    out = np.empty(len(keys), np.int64)
    out[order] = np.arange(len(sk)) - first
    return out


def build_template(t: alg.Transfers, rel_node: np.ndarray, esize: int, p2p: bool,
                   plan: Plan) -> Template:
    """Slice transfers into messages, add clear-to-send rows and QP indices.

    Parameters
    ----------
    t : transfers in communicator indices.
    rel_node : (n,) node of each communicator index (any labels; equal means same node).
    esize : bytes per element (slices are whole elements).
    p2p : slice at NCCL's P2P chunk sizes instead of the collective step size.
    plan : ``collectives.protocol``, ``step_bytes``, ``cts``, ``qps_per_connection``,
        ``split_data_on_qps``; ``transport.verb`` ``read`` means no clear-to-send messages.
    """
    co = plan.collectives
    keep = t.length > 0
    src, dst, step, ch, off, ln, red = (a[keep] for a in
                                        (t.src, t.dst, t.step, t.channel, t.offset, t.length, t.reduce))
    net = rel_node[src] != rel_node[dst]
    if p2p:
        sl = protocol.p2p_chunk(plan, net)
    else:
        sl = np.full(len(src), protocol.step_bytes(plan), dtype=np.int64)
    sl = np.maximum(sl // esize * esize, esize)
    ns = -(-ln // sl)
    rep = np.repeat(np.arange(len(src)), ns)
    first = np.repeat(np.cumsum(ns) - ns, ns)
    chunk = np.arange(len(rep)) - first
    src, dst, step, ch, red, net, sl, ln, off = (a[rep] for a in (src, dst, step, ch, red, net, sl, ln, off))
    nbytes = np.minimum(sl, ln - chunk * sl)
    off = off + chunk * sl
    # send order: step, channel, slice, then transfer order
    order = np.lexsort((np.arange(len(src)), chunk, ch, step))
    src, dst, step, ch, red, net, nbytes, off, chunk = (a[order] for a in
                                                        (src, dst, step, ch, red, net, nbytes, off, chunk))
    m = len(src)
    n_idx = int(max(src.max(), dst.max())) + 1 if m else 1
    q = int(co.qps_per_connection)
    seq = _cumcount((src * n_idx + dst) * 1024 + ch) if q > 1 else np.zeros(m, np.int64)
    qp = np.where(net, seq % q, 0)
    wire = protocol.wire_bytes(nbytes, co.protocol)
    slot = np.arange(m, dtype=np.int64)
    rows = dict(src=src, dst=dst, step=step, channel=ch, chunk=chunk, offset=off, nbytes=nbytes,
                wire=wire, is_cts=np.zeros(m, bool), is_net=net, qp_index=qp, reduce=red,
                slot=slot, sub=np.ones(m, np.int64))
    if q > 1 and getattr(co, "split_data_on_qps", False):
        rows = _split_on_qps(rows, q, co.protocol)
    parts = [rows]
    # Clear-to-send is how a receiver grants credit to a sender that WRITEs into its buffer; with
    # RDMA READ the receiver pulls the data itself and its READ request is the grant.
    if co.cts and plan.transport.verb != "read":
        c = net
        parts.insert(0, dict(src=dst[c], dst=src[c], step=step[c], channel=ch[c], chunk=chunk[c],
                             offset=off[c], nbytes=np.full(int(c.sum()), protocol.CTS_BYTES, np.int64),
                             wire=np.full(int(c.sum()), protocol.CTS_BYTES, np.int64),
                             is_cts=np.ones(int(c.sum()), bool), is_net=np.ones(int(c.sum()), bool),
                             qp_index=qp[c], reduce=np.zeros(int(c.sum()), bool), slot=slot[c],
                             sub=np.zeros(int(c.sum()), np.int64)))
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    o = np.lexsort((cols["sub"], cols["slot"]))
    return Template(**{k: cols[k][o] for k in Template.__dataclass_fields__})


def _split_on_qps(rows: dict, q: int, proto: str) -> dict:
    """NCCL_IB_SPLIT_DATA_ON_QPS=1: cut each network data message into ``q`` pieces of
    ``ceil(ceil(wire/q)/128)*128`` wire bytes, piece ``i`` on QP ``i`` (empty pieces stay: every QP
    gets its WRITE WITH IMMEDIATE)."""
    net = rows["is_net"]
    idx = np.nonzero(net)[0]
    wire = rows["wire"][idx]
    piece = -(-(-(-wire // q)) // protocol.QP_SPLIT_ALIGN) * protocol.QP_SPLIT_ALIGN
    i = np.arange(q)[None, :]
    pw = np.clip(wire[:, None] - i * piece[:, None], 0, piece[:, None])
    before_w = np.minimum(i * piece[:, None], wire[:, None])
    data = rows["nbytes"][idx][:, None]
    db = np.minimum(protocol.data_in_wire(before_w, proto), data)
    dp = np.minimum(protocol.data_in_wire(before_w + pw, proto), data) - db
    out = {}
    keep = np.nonzero(~net)[0]
    for k, v in rows.items():
        rep = np.repeat(v[idx], q)
        out[k] = np.concatenate([v[keep], rep])
    nk = len(keep)
    out["wire"][nk:] = pw.ravel()
    out["nbytes"][nk:] = dp.ravel()
    out["offset"][nk:] = (rows["offset"][idx][:, None] + db).ravel()
    out["qp_index"][nk:] = np.tile(np.arange(q), len(idx))
    out["sub"][nk:] = np.tile(np.arange(1, q + 1), len(idx))
    return out


# ----------------------------------------------------------------------------- per collective


def _transfers(op: str, algo: str, ranks: np.ndarray, bpr: int, esize: int, root: int,
               topo: Topology, plan: Plan, rings, splits_row) -> alg.Transfers:
    co = plan.collectives
    C = int(co.channels)
    n = len(ranks)
    if op in ("all_to_all", "all_to_allv", "send_recv"):
        if op == "send_recv":
            sizes = np.array([[0, bpr], [0, 0]], dtype=np.int64)
        elif splits_row is not None:
            sizes = np.asarray(splits_row, dtype=np.int64)
            if (sizes % esize).any():            # per-peer sizes in bytes that are not whole elements
                esize = 1
        else:
            _, blk = alg.split_even(bpr // esize, n)
            sizes = np.tile(blk * esize, (n, 1))
        return alg.direct(sizes, C, esize)
    elems = bpr // esize
    if op == "all_reduce" and algo == "tree":
        orders, sizes = placement.tree_orders(ranks, topo, C)
        return alg.tree_all_reduce(orders, sizes, elems, esize)
    if op == "all_reduce" and algo == "halving_doubling":
        return alg.halving_doubling(n, C, elems, esize)
    if op == "all_reduce" and algo == "hierarchical":
        groups = placement.node_groups(ranks, topo)
        order = np.tile(np.concatenate(groups), (C, 1))
        return alg.hierarchical(order, len(groups), len(groups[0]), elems, esize)
    orders = placement.ring_orders(ranks, topo, C, rings=rings, ring_order=co.ring_order)
    if op == "all_reduce":
        return alg.ring_all_reduce(orders, elems, esize)
    if op == "reduce_scatter":
        return alg.ring_reduce_scatter(orders, elems, esize)
    if op == "all_gather":
        return alg.ring_all_gather(orders, elems, esize)
    # broadcast / reduce: rotate each channel's ring so that the root comes first
    rot = np.argmax(orders == root, axis=1)
    orders = np.take_along_axis(orders, (rot[:, None] + np.arange(n)[None, :]) % n, axis=1)
    return alg.chain(orders, elems, esize, reduce=(op == "reduce"))


def _lower(coll: pa.Table, topo: Topology, plan: Plan, rings=None, splits=None) -> dict:
    from .rows import read, unique_rows
    from .tuning import algorithm_names

    r = read(coll, topo, OPS)
    op_id, ops, bpr = r.op_id, r.op, r.bytes_per_rank
    algos = algorithm_names(coll, topo, plan, rows=r)
    esz = np.array([DTYPE_BYTES.get(d, 0) or 1 for d in r.dtype.tolist()], dtype=np.int64) \
        if len(op_id) else np.zeros(0, np.int64)
    esz = np.where(bpr % esz == 0, esz, 1)
    size = np.array([len(x) for x in r.comms], dtype=np.int64)[r.comm] if r.comms else np.zeros(len(op_id), np.int64)
    # root of broadcast/reduce: src, else dst, else the first rank
    root_g = np.where(r.src >= 0, r.src, np.where(r.dst >= 0, r.dst, r.first_rank))
    rooted = (ops == "broadcast") | (ops == "reduce")
    sp = np.full(len(op_id), -1, dtype=np.int64)
    if splits:
        has = np.isin(op_id, np.fromiter(splits.keys(), dtype=np.int64)) & (ops == "all_to_allv")
        sp[has] = op_id[has]
    live = (size >= 2) & (bpr > 0)
    live &= ~((ops == "send_recv") & (r.src == r.dst))
    idx = np.nonzero(live)[0]
    keys: dict[tuple, np.ndarray] = {}
    rank_lists = dict(enumerate(r.comms))
    if len(idx):
        root_key = np.where(rooted, root_g, -1)[idx]
        first, inv = unique_rows(ops[idx], algos[idx], bpr[idx], esz[idx], root_key, r.comm[idx], sp[idx])
        order = np.argsort(inv, kind="stable")
        bounds = np.cumsum(np.bincount(inv))
        groups = np.split(idx[order], bounds[:-1])
        for f, g in zip(first, groups):
            i = int(idx[f])
            ranks = rank_lists[int(r.comm[i])]
            root = -1
            if rooted[i]:
                hit = np.nonzero(ranks == root_g[i])[0]
                if len(hit) == 0:
                    raise WiretraceError(f"collectives row {i} (op_id {op_id[i]}): root {root_g[i]} is not in ranks")
                root = int(hit[0])
            key = (ops[i], algos[i], int(bpr[i]), int(esz[i]), root, int(r.comm[i]),
                   int(sp[i]) if sp[i] >= 0 else None)
            keys[key] = g

    cache: dict[tuple, Template] = {}
    parts = []
    for key, rows in keys.items():
        op, algo, b, esize, root, rid, sp = key
        ranks = rank_lists[rid]
        node = topo.rank_node[ranks]
        _, rel_node = np.unique(node, return_inverse=True)
        splits_row = None
        if sp is not None:
            splits_row = np.asarray(splits[sp], dtype=np.int64)
            if splits_row.shape != (len(ranks), len(ranks)) or (splits_row < 0).any():
                raise WiretraceError(f"all_to_allv op_id {sp}: split sizes must be a ({len(ranks)}, {len(ranks)}) "
                                     f"array of bytes >= 0, got shape {splits_row.shape}")
        t = _transfers(op, algo, ranks, b, esize, root, topo, plan, rings, splits_row)
        tkey = (op in P2P_OPS, esize, rel_node.tobytes()) + tuple(
            getattr(t, f).tobytes() for f in ("src", "dst", "step", "channel", "offset", "length", "reduce"))
        tpl = cache.get(tkey)
        if tpl is None:
            tpl = cache[tkey] = build_template(t, rel_node, esize, op in P2P_OPS, plan)
        parts.append((rows, ranks, tpl))

    return _assemble(parts, op_id, topo)


def _assemble(parts, op_id: np.ndarray, topo: Topology) -> dict:
    """Place every call's template rows at the call's position (calls in table order)."""
    count = np.zeros(len(op_id), dtype=np.int64)
    for rows, _, t in parts:
        count[rows] = len(t)
    start = np.cumsum(count) - count
    total = int(count.sum())
    out = {k: np.empty(total, dt) for k, dt in (
        ("op_id", np.int64), ("step", np.int32), ("channel", np.int16), ("chunk", np.int32),
        ("src_rank", np.int32), ("dst_rank", np.int32), ("buf_offset", np.int64), ("bytes", np.int64),
        ("wire_bytes", np.int64), ("is_cts", bool), ("is_net", bool), ("qp_index", np.int16),
        ("reduce", bool))}
    for rows, ranks, t in parts:
        K, M = len(rows), len(t)
        if M == 0:
            continue
        dest = (start[rows][:, None] + np.arange(M)[None, :]).ravel()
        out["op_id"][dest] = np.repeat(op_id[rows], M)
        for name, arr in (("step", t.step), ("channel", t.channel), ("chunk", t.chunk),
                          ("buf_offset", t.offset), ("bytes", t.nbytes), ("wire_bytes", t.wire),
                          ("is_cts", t.is_cts), ("is_net", t.is_net), ("qp_index", t.qp_index),
                          ("reduce", t.reduce), ("src_rank", ranks[t.src]), ("dst_rank", ranks[t.dst])):
            out[name][dest] = np.tile(arr, K)
    src, dst = out["src_rank"].astype(np.int64), out["dst_rank"].astype(np.int64)
    is_net, is_cts = out.pop("is_net"), out.pop("is_cts")
    # NICs: data rows by the PXN/rail rule; a cts travels back along its data message's NIC pair
    src_nic, dst_nic = topo.rank_nic[src].astype(np.int32), topo.rank_nic[dst].astype(np.int32)
    k = np.nonzero(is_net)[0]
    c = is_cts[k]
    dsrc, ddst = np.where(c, dst[k], src[k]), np.where(c, src[k], dst[k])
    snic, dnic = placement.network_nics(dsrc, ddst, topo)
    src_nic[k], dst_nic[k] = np.where(c, dnic, snic), np.where(c, snic, dnic)
    n = len(src)
    res = {
        "msg_id": np.arange(n, dtype=np.int64),
        "op_id": out["op_id"],
        "step": out["step"],
        "channel": out["channel"],
        "chunk": out["chunk"],
        "src_rank": out["src_rank"],
        "dst_rank": out["dst_rank"],
        "src_node": topo.rank_node[src].astype(np.int32),
        "dst_node": topo.rank_node[dst].astype(np.int32),
        "src_nic": src_nic,
        "dst_nic": dst_nic,
        "link": np.array(["nvlink", "network"], dtype=object)[is_net.astype(np.int8)],
        "kind": np.array(["data", "cts"], dtype=object)[is_cts.astype(np.int8)],
        "bytes": out["bytes"],
        "wire_bytes": out["wire_bytes"],
        "buf_offset": out["buf_offset"],
        "qp_index": out["qp_index"],
        "verb": np.full(n, "", dtype=object),
        "qpn": np.full(n, -1, dtype=np.int32),
        "udp_sport": np.full(n, -1, dtype=np.int32),
        "t_start_ns": np.zeros(n, dtype=np.int64),
        "t_end_ns": np.zeros(n, dtype=np.int64),
        "reduce": out["reduce"],
    }
    return res


def trace(coll: pa.Table, topo: Topology, plan: Plan,
          rings: Mapping[int, Sequence[int]] | None = None,
          splits: Mapping[int, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Like :func:`lower`, plus a ``reduce`` column (bool): the receiver combines the range
    ``[buf_offset, buf_offset + bytes)`` with its own data (True) or stores it (False).

    With ``buf_offset`` and ``bytes`` it describes the data each message carries, so that the
    movement of every algorithm can be replayed symbolically (which ranks' contributions each
    rank ends up holding for each byte range).
    """
    return _lower(coll, topo, plan, rings=rings, splits=splits)


def lower(coll: pa.Table, topo: Topology, plan: Plan,
          rings: Mapping[int, Sequence[int]] | None = None,
          splits: Mapping[int, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Lower collective calls to point-to-point messages (the messages table's columns).

    Parameters
    ----------
    coll : collectives table (``schemas/collectives.schema.json``). A communicator's rank ``i``
        is its ``i``-th smallest global rank (shard ``i`` of all_gather/reduce_scatter, block
        ``i`` of all_to_all), whatever the order of ``ranks``; ring and tree orders come from the
        topology (:mod:`.placement`), ``rings`` or ``plan.collectives.ring_order``.
        ``algorithm`` ``auto`` or empty is resolved as :func:`wiretrace.collectives.resolve_algorithms` does; an algorithm
        that does not apply to the operation falls back to the one NCCL would use.
        broadcast/reduce take their root from ``src`` (else ``dst``, else ``ranks[0]``).
    topo : placement (:func:`wiretrace.topology.build`).
    plan : ``collectives`` section: channels, protocol, step_bytes, cts, qps_per_connection,
        split_data_on_qps, ring_order.
    rings : optional measured ring orders, channel -> global ranks (from an NCCL log); they
        override the computed rings of the communicator they describe.
    splits : optional per-peer sizes of all_to_allv calls: op_id -> (n, n) int array of bytes,
        row ``i`` what communicator index ``i`` sends to each index. Without it an all_to_allv is
        lowered as an even all_to_all of ``bytes_per_rank``.

    Returns
    -------
    dict name -> NumPy array, the columns of ``schemas/messages.schema.json`` in call order
    (calls in table order; inside a call by step, channel, slice; each network slice's
    clear-to-send right before it). ``link``/``kind``/``verb`` are object arrays of str;
    ``verb`` is "" and ``qpn``/``udp_sport`` -1 (the transport fills them), times are 0 (timing
    fills them). ``bytes`` is user data; ``wire_bytes`` adds the protocol's framing
    (:func:`wiretrace.collectives.protocol.wire_bytes`) and is what crosses the link.

    Raises
    ------
    WiretraceError : unknown op, ranks inconsistent with group_size or outside the cluster,
        negative size, a root outside the communicator, a ring_order missing ranks, or
        all_to_allv split sizes of the wrong shape.
    """
    out = _lower(coll, topo, plan, rings=rings, splits=splits)
    out.pop("reduce")
    return out
