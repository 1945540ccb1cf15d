"""Queue pairs: which RC QP carries each message, its QP numbers, UDP source port and PSN start.

Connections follow NCCL's IB transport (``src/transport/net_ib.cc``): a sender and a receiver NIC
are connected once per channel, with ``collectives.qps_per_connection`` RC QPs (NCCL's
``NCCL_IB_QPS_PER_CONNECTION``, default 1); successive messages of a connection use its QPs
round-robin. The receiver's clear-to-send writes travel back on the same QP pair.

QP numbers are deterministic. On NIC ``x``, the QP of the connection with peer NIC ``p``, channel
``c``, QP index ``i`` and role ``r`` (0 on the data sender, 1 on the data receiver) is::

    QPN = 0x100 + (((p * 64 + c) * Q + i) * 2 + r)        (Q = qps_per_connection)

so the number names its peer, channel and index (QPNs below 0x100 are left to the special QPs, as
ConnectX leaves QP0/QP1 and its reserved range). 64 is NCCL's ``MAXCHANNELS``.

The UDP source port is Linux's ``rdma_get_udp_sport(0, lqpn, rqpn)``
(``include/rdma/ib_verbs.h``): the flow label ``rdma_calc_flow_label`` folds the product of the two
QP numbers to 20 bits, ``rdma_flow_label_to_udp_sport`` folds those to 14 bits and ORs 0xC000.
It is symmetric, so both directions of a QP pair use one port.
"""

from __future__ import annotations

import numpy as np

from ..errors import WiretraceError
from ..plan import Plan
from ..topology import Topology

QP_BASE = 0x100
MAX_CHANNELS = 64
PSN_MOD = 1 << 24
QPN_MOD = 1 << 24

VERBS = ("write_imm", "write", "send", "send_imm", "read")
"""Verbs of the messages table, in the order of :data:`VERB_CODE`."""
VERB_CODE = {v: i for i, v in enumerate(VERBS)}


def rdma_calc_flow_label(lqpn: np.ndarray, rqpn: np.ndarray) -> np.ndarray:
    """20-bit flow label from two QP numbers, as Linux ``rdma_calc_flow_label``
    (``include/rdma/ib_verbs.h``): ``fl = lqpn * rqpn; fl ^= fl >> 20; fl ^= fl >> 40``."""
    fl = np.asarray(lqpn, dtype=np.uint64) * np.asarray(rqpn, dtype=np.uint64)
    fl ^= fl >> np.uint64(20)
    fl ^= fl >> np.uint64(40)
    return (fl & np.uint64(0xFFFFF)).astype(np.uint32)


def rdma_flow_label_to_udp_sport(fl: np.ndarray) -> np.ndarray:
    """RoCEv2 UDP source port from a 20-bit flow label, as Linux ``rdma_flow_label_to_udp_sport``:
    the low 14 bits XOR the high 6 bits, OR 0xC000 (49152..65535)."""
    fl = np.asarray(fl, dtype=np.uint32)
    low = (fl & np.uint32(0x3FFF)) ^ ((fl & np.uint32(0xFC000)) >> np.uint32(14))
    return (low | np.uint32(0xC000)).astype(np.int32)


def udp_sport(lqpn: np.ndarray, rqpn: np.ndarray) -> np.ndarray:
    """``rdma_get_udp_sport(0, lqpn, rqpn)``: the UDP source port of a QP pair, ``(n,)`` int32."""
    return rdma_flow_label_to_udp_sport(rdma_calc_flow_label(lqpn, rqpn))


def qpn(peer_nic: np.ndarray, channel: np.ndarray, index: np.ndarray, role: np.ndarray | int,
        qps_per_connection: int) -> np.ndarray:
    """QP number on a NIC for (peer NIC, channel, QP index, role); see the module docstring."""
    v = ((np.asarray(peer_nic, dtype=np.int64) * MAX_CHANNELS + np.asarray(channel, dtype=np.int64) % MAX_CHANNELS)
         * qps_per_connection + np.asarray(index, dtype=np.int64)) * 2 + np.asarray(role, dtype=np.int64)
    return (QP_BASE + v).astype(np.int32)


def decode_qpn(q: np.ndarray, qps_per_connection: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of :func:`qpn`: ``(peer_nic, channel, index, role)`` of QP numbers."""
    v = np.asarray(q, dtype=np.int64) - QP_BASE
    role = v & 1
    rest = v >> 1
    index = rest % qps_per_connection
    rest //= qps_per_connection
    return rest // MAX_CHANNELS, rest % MAX_CHANNELS, index, role


def check_qpn_space(num_nics: int, qps_per_connection: int) -> None:
    """Raise WiretraceError when the QPN formula would not fit in 24 bits."""
    top = QP_BASE + num_nics * MAX_CHANNELS * qps_per_connection * 2
    if top > QPN_MOD:
        raise WiretraceError(
            f"collectives.qps_per_connection = {qps_per_connection} with {num_nics} NICs needs QP numbers "
            f"up to {top:#x}, beyond the 24-bit QPN space; lower qps_per_connection")


def _str_col(col) -> np.ndarray:
    a = np.asarray(col)
    return a if a.dtype.kind in "OUS" else a.astype(str)


def connection_qps(messages: dict, plan: Plan) -> dict[str, np.ndarray]:
    """The two QPs of every message's connection.

    Returns a dict of ``(n,)`` arrays: ``sender_nic`` / ``receiver_nic`` (data direction of the
    connection: for a cts row these are its dst / src), ``sender_qpn`` and ``receiver_qpn``,
    ``qp_index``. Messages must carry ``qpn`` from :func:`assign_qps`.
    """
    Q = plan.collectives.qps_per_connection
    kind = _str_col(messages["kind"])
    is_cts = kind == "cts"
    src = np.asarray(messages["src_nic"], dtype=np.int64)
    dst = np.asarray(messages["dst_nic"], dtype=np.int64)
    sender = np.where(is_cts, dst, src)
    receiver = np.where(is_cts, src, dst)
    ch = np.asarray(messages["channel"], dtype=np.int64)
    dest = np.asarray(messages["qpn"], dtype=np.int64)
    _, _, idx, _ = decode_qpn(dest, Q)
    return {
        "sender_nic": sender, "receiver_nic": receiver, "qp_index": idx,
        "sender_qpn": qpn(receiver, ch, idx, 0, Q).astype(np.int64),
        "receiver_qpn": qpn(sender, ch, idx, 1, Q).astype(np.int64),
    }


def assign_qps(messages: dict, topo: Topology, plan: Plan) -> dict:
    """Fill ``verb``, ``qpn`` and ``udp_sport`` of the network messages.

    Parameters
    ----------
    messages : messages-table columns (``schemas/messages.schema.json``); ``link`` and ``kind``
        arrays of str.
    topo : cluster endpoints (NIC count for the QPN range check).
    plan : ``transport.verb`` (data messages; cts messages are always ``write``: NCCL's 64-byte
        inline RDMA WRITE), ``collectives.qps_per_connection``.

    Returns
    -------
    The same dict with ``verb`` (object array of str; ``""`` on nvlink rows), ``qpn`` (int32, the
    BTH DestQP of the message's data packets: the data receiver's QP; -1 on nvlink rows) and
    ``udp_sport`` (int32, 49152..65535; -1 on nvlink rows and for native InfiniBand).

    Raises
    ------
    WiretraceError : the QPN formula would overflow 24 bits.

    Notes
    -----
    A connection's QPs are used round-robin by successive messages (ordered by ``msg_id``) of
    that connection within this call, as NCCL spreads requests over ``NCCL_IB_QPS_PER_CONNECTION``
    QPs.
    """
    n = len(messages["msg_id"])
    Q = plan.collectives.qps_per_connection
    check_qpn_space(topo.num_nics, Q)
    link = _str_col(messages["link"])
    kind = _str_col(messages["kind"])
    net = link == "network"
    is_cts = kind == "cts"

    verb = np.full(n, "", dtype=object)
    verb[net] = plan.transport.verb
    verb[net & is_cts] = "write"
    q = np.full(n, -1, dtype=np.int32)
    sport = np.full(n, -1, dtype=np.int32)

    idx_net = np.nonzero(net)[0]
    if len(idx_net):
        src = np.asarray(messages["src_nic"], dtype=np.int64)[idx_net]
        dst = np.asarray(messages["dst_nic"], dtype=np.int64)[idx_net]
        ch = np.asarray(messages["channel"], dtype=np.int64)[idx_net]
        cts = is_cts[idx_net]
        sender = np.where(cts, dst, src)
        receiver = np.where(cts, src, dst)
        if Q > 1:
            mid = np.asarray(messages["msg_id"], dtype=np.int64)[idx_net]
            conn = (sender * topo.num_nics + receiver) * MAX_CHANNELS + ch % MAX_CHANNELS
            order = np.lexsort((mid, cts, conn))
            c_sorted = conn[order]
            first = np.r_[True, c_sorted[1:] != c_sorted[:-1]] if len(order) else np.zeros(0, bool)
            start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
            rank = np.empty(len(order), dtype=np.int64)
            rank[order] = np.arange(len(order)) - start
            index = rank % Q
        else:
            index = np.zeros(len(idx_net), dtype=np.int64)
        s_qpn = qpn(receiver, ch, index, 0, Q)
        r_qpn = qpn(sender, ch, index, 1, Q)
        # DestQP of the message's packets: the QP on the message's dst NIC
        q[idx_net] = np.where(cts, s_qpn, r_qpn)
        if plan.transport.kind == "rocev2":
            sport[idx_net] = udp_sport(s_qpn, r_qpn)
    messages["verb"] = verb
    messages["qpn"] = q
    messages["udp_sport"] = sport
    return messages


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over uint64 arrays (Steele, Lea, Flood 2014): a fixed, seedable
    hash used for random initial PSNs and seeded ECN marks."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def initial_psn(requester_nic: np.ndarray, requester_qpn: np.ndarray, plan: Plan) -> np.ndarray:
    """Initial send PSN of each requester QP: ``transport.initial_psn`` 0 (``"zero"``), a fixed
    number, or ``"random"``: a 24-bit hash of (plan seed, NIC, QPN), as a NIC draws it at QP
    creation (Linux ``rdma_cm`` uses a random 24-bit initial PSN)."""
    mode = plan.transport.initial_psn
    n = len(np.asarray(requester_qpn))
    if mode == "zero":
        return np.zeros(n, dtype=np.int64)
    if isinstance(mode, int) and not isinstance(mode, bool):
        return np.full(n, mode % PSN_MOD, dtype=np.int64)
    key = (np.asarray(requester_nic, dtype=np.uint64) << np.uint64(24)) | np.asarray(requester_qpn, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = splitmix64(key ^ splitmix64(np.full(n, plan.seed, dtype=np.uint64)))
    return (h & np.uint64(PSN_MOD - 1)).astype(np.int64)
