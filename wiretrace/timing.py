"""When each message starts and ends: step dependencies, compute readiness, link serialization.

Rules (vectorized over whole columns; no per-message Python loop):

1. A message never starts before its collective's ``t_ready_ns`` (compute model or measured trace).
2. Step dependencies, as NCCL's primitives pipeline slices: a data message of step ``k`` and slice
   ``c`` leaves rank ``r`` after the data that ``r`` receives in the same call and channel at the
   latest step ``k' < k`` in which it receives anything — the same slice ``c`` of that step when
   ``r`` received one, else the whole step. A data message also waits for its clear-to-send (the
   ``kind == "cts"`` message of the same call, channel, step and slice from its receiver).
3. Serialization: a sender's messages of one call and channel go one after another, in (step,
   slice) order, on its link: the NIC (network messages, ``cluster.nic_rate``) or the GPU's NVLink
   port (``cluster.nvlink_rate``).
4. The calls of one communicator run one after another in issue order (NCCL launches them on
   the communicator's stream): rules 1-3 are re-run with each call's earliest start as a lower
   bound until the order no longer moves.
5. Messages of different communicators share a link first come, first served: a pass over each
   link in start order pushes overlapping messages back; the delay is propagated to dependent
   messages (and to the communicator's later calls) by re-running rules 1-4 with those start
   times as lower bounds, until nothing moves (at most ``max_passes`` passes).
6. Credits: a receiver has ``NCCL_STEPS`` = 8 buffer slots per connection, so the clear-to-send
   of a connection's k-th slice leaves only once its (k-8)-th slice has arrived.
7. ``t_end_ns`` = start + serialization time + one hop latency (``cluster.latency`` or
   ``nvlink_latency``). Serialization time on the network counts every frame's overhead:
   Ethernet (14, +4 with a VLAN tag), IPv4 20 or IPv6 40, UDP 8, BTH 12, ICRC 4, FCS 4, preamble
   and SFD 8, inter-frame gap 12 bytes (IEEE 802.3 clause 4.4.2), plus RETH (16) on the first
   packet and ImmDt (4) on the last (native IB: LRH, GRH when used, BTH, ICRC, VCRC and the
   link delimiters instead); segmentation at the path MTU (IBTA vol. 1, 9.7.7).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .plan import Plan
from .topology import Topology

RETH_BYTES = 16
IMMDT_BYTES = 4
NCCL_STEPS = 8
"""Slots of an NCCL connection's FIFO (``NCCL_STEPS`` in src/include/device.h): at most 8
slices in flight per connection, hence at most 8 outstanding clear-to-send credits."""


def frame_overhead_bytes(plan: Plan) -> int:
    """Bytes one packet occupies on the wire beyond its IB payload and pad.

    RoCEv2: preamble+SFD, Ethernet header (+802.1Q tag, also a priority tag), IPv4 or IPv6, UDP,
    BTH, ICRC, FCS and inter-frame gap; native IB: LRH (+GRH), BTH, ICRC, VCRC and the link
    delimiters. The layout is the transport's own (:mod:`wiretrace.transport.layout`), so that
    message times and packet times agree.
    """
    from .transport import layout
    from .transport.headers import GRH

    grh = GRH.length if plan.transport.kind == "ib" and plan.transport.grh else 0
    return layout.base_header_len(plan) + layout.trailer_len(plan) + layout.wire_extra(plan) + grh


def network_wire_bytes(wire_bytes: np.ndarray, plan: Plan) -> np.ndarray:
    """Bytes on the Ethernet wire for messages of ``wire_bytes`` payload each (int64 array).

    Packets = ceil(bytes / path MTU) (at least 1); each carries the frame overhead, its payload
    rounded up to 4 bytes; the first a RETH and the last an ImmDt.
    """
    mtu = plan.transport.path_mtu
    b = np.asarray(wire_bytes, dtype=np.int64)
    npkt = np.maximum(1, -(-b // mtu))
    last = b - (npkt - 1) * mtu
    padded = (npkt - 1) * mtu + ((last + 3) & ~3)
    return padded + npkt * frame_overhead_bytes(plan) + RETH_BYTES + IMMDT_BYTES


def _group_ids(*keys: np.ndarray) -> np.ndarray:
    """Dense int64 id of each row's key tuple (rows with equal keys share an id; ids follow the
    lexicographic order of the tuples)."""
    cols = [np.asarray(k, dtype=np.int64) for k in keys]
    if len(cols[0]) == 0:
        return np.zeros(0, dtype=np.int64)
    combined = np.zeros(len(cols[0]), dtype=np.int64)
    span = 1
    for c in cols:  # mixed-radix packing into one int64 when the ranges allow it
        lo, hi = int(c.min()), int(c.max())
        width = hi - lo + 1
        if span * width >= 1 << 62:
            stacked = np.stack(cols, axis=1)
            _, inv = np.unique(stacked, axis=0, return_inverse=True)
            return inv.reshape(-1).astype(np.int64)
        combined = combined * width + (c - lo)
        span *= width
    _, inv = np.unique(combined, return_inverse=True)
    return inv.astype(np.int64)


def schedule(messages: dict, coll: pa.Table, topo: Topology, plan: Plan,
             max_passes: int = 6) -> dict:
    """Fill ``t_start_ns`` and ``t_end_ns`` of a messages table (columns dict), in place.

    Parameters
    ----------
    messages : columns of the messages table (schemas/messages.schema.json) for whole calls
        (every message of a call and channel must be present). ``link`` and ``kind`` are arrays of
        str.
    coll : the collectives table the messages belong to (``op_id``, ``t_ready_ns`` used).
    topo, plan : cluster rates and latencies, transport framing.
    max_passes : passes of each fixed-point phase (communicator order, then link sharing).

    Returns
    -------
    The same dict, with int64 ``t_start_ns`` / ``t_end_ns`` (ns from iteration start).
    """
    n = len(messages["msg_id"])
    if n == 0:
        messages["t_start_ns"] = np.zeros(0, np.int64)
        messages["t_end_ns"] = np.zeros(0, np.int64)
        return messages
    op = np.asarray(messages["op_id"], dtype=np.int64)
    step = np.asarray(messages["step"], dtype=np.int64)
    chunk = np.asarray(messages["chunk"], dtype=np.int64)
    ch = np.asarray(messages["channel"], dtype=np.int64)
    src = np.asarray(messages["src_rank"], dtype=np.int64)
    dst = np.asarray(messages["dst_rank"], dtype=np.int64)
    is_net = np.asarray(messages["link"]) == "network"
    is_cts = np.asarray(messages["kind"]) == "cts"
    wire = np.asarray(messages["wire_bytes"], dtype=np.int64)

    # ---- readiness of each call
    op_ids = np.asarray(coll.column("op_id").to_numpy(), dtype=np.int64)
    t_ready_op = np.asarray(coll.column("t_ready_ns").to_numpy(), dtype=np.int64)
    order = np.argsort(op_ids)
    pos = np.searchsorted(op_ids[order], op)
    op_pos = order[np.minimum(pos, len(order) - 1)]          # row of each message's call
    t_ready = t_ready_op[op_pos]
    call_group = np.asarray(coll.column("group").to_numpy(), dtype=np.int64)
    call_ready0 = t_ready_op.astype(np.int64)

    # ---- durations
    bits = np.where(is_net, network_wire_bytes(wire, plan), wire) * 8
    rate = np.where(is_net, topo.nic_rate_bps, topo.nvlink_rate_bps)
    dur = np.ceil(bits / rate * 1e9).astype(np.int64)
    lat = np.where(is_net, topo.latency_ns, topo.nvlink_latency_ns).astype(np.int64)
    tx_link = np.where(is_net, np.asarray(messages["src_nic"], dtype=np.int64),
                       topo.num_nics + src)

    # ---- rounds: (step, chunk, cts before data); everything a message depends on is in an
    # earlier round.
    rnd = _group_ids(step, chunk, (~is_cts).astype(np.int64))

    # ---- receipt dependency: the sender's receipts at its latest receive step < step
    data = ~is_cts
    flow = _group_ids(op, ch)                                  # call+channel id
    stride = np.int64(max(int(step.max()) + 2, 2))
    rk = np.int64(max(int(max(src.max(), dst.max())) + 1, 1))
    # receipts sorted by (flow, rank, step, chunk)
    r_idx = np.nonzero(data)[0]
    r_key = (flow[r_idx] * rk + dst[r_idx]) * stride + step[r_idx]
    r_order = np.lexsort((chunk[r_idx], r_key))
    r_idx = r_idx[r_order]
    r_key = r_key[r_order]
    r_chunk = chunk[r_idx]
    m_key = (flow * rk + src) * stride + step
    # latest receive step < step: the position just before the first key >= m_key
    p = np.searchsorted(r_key, m_key, side="left") - 1
    has_pred = p >= 0
    has_pred[has_pred] = (r_key[p[has_pred]] // stride) == (flow[has_pred] * rk + src[has_pred])
    pred_key = np.where(has_pred, r_key[np.maximum(p, 0)], -1)
    lo = np.searchsorted(r_key, pred_key, side="left")
    hi = np.searchsorted(r_key, pred_key, side="right")
    # narrow to the same slice when the sender received that slice at that step
    ck = r_key * np.int64(chunk.max() + 2) + r_chunk
    want = pred_key * np.int64(chunk.max() + 2) + chunk
    clo = np.searchsorted(ck, want, side="left")
    chi = np.searchsorted(ck, want, side="right")
    same = has_pred & (chi > clo)
    lo = np.where(same, clo, lo)
    hi = np.where(same, chi, hi)
    has_pred &= hi > lo

    # ---- cts dependency: the cts of (call, channel, step, slice) from the data's receiver
    cts_of = np.full(n, -1, dtype=np.int64)
    if is_cts.any():
        c_idx = np.nonzero(is_cts)[0]
        key_c = _group_ids(np.concatenate([op[c_idx], op[data]]),
                           np.concatenate([ch[c_idx], ch[data]]),
                           np.concatenate([step[c_idx], step[data]]),
                           np.concatenate([chunk[c_idx], chunk[data]]),
                           np.concatenate([src[c_idx], dst[data]]),
                           np.concatenate([dst[c_idx], src[data]]))
        kc, kd = key_c[: len(c_idx)], key_c[len(c_idx):]
        table = np.full(int(key_c.max()) + 1, -1, dtype=np.int64)
        table[kc] = c_idx
        cts_of[np.nonzero(data)[0]] = table[kd]

    pos_in_r = np.full(n, -1, dtype=np.int64)
    pos_in_r[r_idx] = np.arange(len(r_idx))

    # ---- credit window: NCCL's connection FIFO has NCCL_STEPS = 8 slots (src/include/device.h),
    # so the credit for a sender's k-th slice on a connection waits for its (k-8)-th to arrive
    credit_dep = np.full(n, -1, dtype=np.int64)
    if is_cts.any():
        d_idx = np.nonzero(data)[0]
        conn = flow[d_idx] * rk * rk + src[d_idx] * rk + dst[d_idx]
        o = np.lexsort((chunk[d_idx], step[d_idx], conn))
        d_sorted, conn_sorted = d_idx[o], conn[o]
        k = np.arange(len(o))
        back = k - NCCL_STEPS
        ok = (back >= 0)
        ok[ok] = conn_sorted[back[ok]] == conn_sorted[ok]
        has_cts = cts_of[d_sorted] >= 0
        sel = ok & has_cts
        credit_dep[cts_of[d_sorted[sel]]] = d_sorted[back[sel]]

    # ---- own-sender order inside a call+channel
    sender = _group_ids(flow, src, is_net.astype(np.int64))

    rounds_order = np.argsort(rnd, kind="stable")
    bounds = np.flatnonzero(np.diff(rnd[rounds_order])) + 1
    round_slices = np.split(rounds_order, bounds)

    start = np.zeros(n, dtype=np.int64)
    end = np.zeros(n, dtype=np.int64)

    def run_rounds(lower: np.ndarray) -> None:
        """Rules 1-3 (and 6) for every message, given per-message lower bounds."""
        sender_free = np.zeros(int(sender.max()) + 1, dtype=np.int64)
        end_sorted = np.zeros(len(r_idx), dtype=np.int64)
        for idx in round_slices:
            ready = lower[idx].copy()
            hp = has_pred[idx]
            if hp.any():
                sub = idx[hp]
                a, b = lo[sub], hi[sub]
                mx = end_sorted[a]
                for k in range(1, int((b - a).max())):
                    more = (b - a) > k
                    mx[more] = np.maximum(mx[more], end_sorted[a[more] + k])
                ready[hp] = np.maximum(ready[hp], mx)
            for dep in (cts_of[idx], credit_dep[idx]):
                hc = dep >= 0
                if hc.any():
                    ready[hc] = np.maximum(ready[hc], end[dep[hc]])
            # serialize messages of the same sender inside this round, then after its last one
            s = sender[idx]
            o = np.lexsort((ready, s))
            idx_o, s_o, r_o, d_o = idx[o], s[o], ready[o], dur[idx[o]]
            r_o = np.maximum(r_o, sender_free[s_o])
            st = _fifo_starts(s_o, r_o, d_o)
            start[idx_o] = st
            end[idx_o] = st + d_o + lat[idx_o]
            np.maximum.at(sender_free, s_o, st + d_o)
            rp = pos_in_r[idx_o]
            keep = rp >= 0
            end_sorted[rp[keep]] = end[idx_o[keep]]

    # Phase 1, rule 5: calls of one communicator in issue order, recomputed from each pass's
    # schedule until it no longer moves.
    lower = t_ready.copy()
    for _ in range(max_passes):
        run_rounds(lower)
        call_ready = _communicator_order(op_pos, start, end, call_group, call_ready0)
        new_lower = np.maximum(t_ready, call_ready[op_pos])
        if np.array_equal(new_lower, lower):
            break
        lower = new_lower
    # Phase 2, rule 4: calls of different communicators share a link first come, first served;
    # a push is kept as a lower bound (and moves the communicator's later calls) until nothing
    # overlaps.
    link_lower = lower.copy()
    for _ in range(max_passes):
        new_start = _serialize_links(tx_link, start, dur)
        if np.array_equal(new_start, start):
            break
        link_lower = np.maximum(link_lower, new_start)
        run_rounds(link_lower)
        call_ready = _communicator_order(op_pos, start, end, call_group, call_ready0)
        link_lower = np.maximum(link_lower, call_ready[op_pos])
    start = _serialize_links(tx_link, start, dur)
    end = start + dur + lat
    messages["t_start_ns"] = start
    messages["t_end_ns"] = end
    return messages


def _communicator_order(op_pos: np.ndarray, start: np.ndarray, end: np.ndarray,
                        call_group: np.ndarray, call_ready0: np.ndarray) -> np.ndarray:
    """Earliest start of each call (row of the collectives table) when the calls of one
    communicator run one at a time in issue order (t_ready, then row), as NCCL's kernels do on
    the communicator's stream: a call is busy from its first message's start to its last
    message's arrival, and keeps that length when it is pushed back."""
    ncall = len(call_group)
    first = np.full(ncall, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(ncall, -1, dtype=np.int64)
    np.minimum.at(first, op_pos, start)
    np.maximum.at(last, op_pos, end)
    present = last >= 0
    ready = call_ready0
    busy = np.where(present, last - np.maximum(first, call_ready0), 0)
    o = np.lexsort((np.arange(ncall), ready, call_group))
    out = np.empty(ncall, dtype=np.int64)
    out[o] = _fifo_starts(call_group[o], ready[o], busy[o])
    return out


def _fifo_starts(group: np.ndarray, ready: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Start times of jobs served one at a time per group, in the given order (rows sorted by group).

    Closed form of ``start_i = max(ready_i, start_{i-1} + dur_{i-1})`` within each group:
    with ``D`` the exclusive prefix sum of ``dur`` inside the group,
    ``start_i = D_i + max_{j<=i}(ready_j - D_j)`` — a segmented running maximum.
    """
    n = len(group)
    if n == 0:
        return ready
    new = np.ones(n, dtype=bool)
    new[1:] = group[1:] != group[:-1]
    csum = np.cumsum(dur)
    seg_first = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    base = np.where(seg_first > 0, csum[seg_first - 1], 0)
    D = csum - dur - base                       # exclusive prefix sum inside the group
    x = ready - D
    seg = np.cumsum(new) - 1
    span = np.int64(x.max() - x.min() + 1)
    shifted = x - x.min() + seg * span          # later groups dominate earlier ones
    run = np.maximum.accumulate(shifted) - seg * span + x.min()
    return D + run


def _serialize_links(link: np.ndarray, start: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Push back messages that overlap on the same link (first come, first served by start)."""
    o = np.lexsort((start, link))
    st = _fifo_starts(link[o], start[o], dur[o])
    out = np.empty_like(start)
    out[o] = st
    return out
