"""Collective algorithms: exact byte counts, nccl-tests bus-bandwidth factors, symbolic replay of
the data each message carries, closed forms of tree and halving-doubling, NCCL protocol mechanics.

Collectives tables are built by hand with ``wiretrace.tables.to_arrow``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from wiretrace import collectives, tables
from wiretrace import plan as P
from wiretrace import topology
from wiretrace.errors import WiretraceError

# ----------------------------------------------------------------------------- helpers


def make_plan(nodes: int, gpus: int, nics: int | None = None, **coll) -> P.Plan:
    cluster = {"nodes": nodes, "gpus_per_node": gpus}
    if nics:
        cluster["nics_per_node"] = nics
    return P.from_dict({"cluster": cluster, "collectives": coll}, require_model=False)


def make_coll(rows: list[dict]) -> pa.Table:
    """Collectives table from short row dicts: op, ranks, b (bytes_per_rank), dtype, algo, src, dst."""
    cols = {k: [] for k in tables.column_names("collectives")}
    for i, r in enumerate(rows):
        ranks = list(r.get("ranks", []))
        n = len(ranks) if ranks else 2
        b = r["b"]
        glob = b * n if r["op"] in ("all_gather", "reduce_scatter", "all_to_all", "all_to_allv") else b
        d = dict(op_id=r.get("op_id", i), iteration=0, op=r["op"], parallelism=r.get("par", "dp"),
                 group=r.get("group", 0), ranks=ranks, group_size=n, bytes_global=glob,
                 bytes_per_rank=b, dtype=r.get("dtype", "fp32"), phase="backward", layer=-1,
                 microbatch=-1, stage=-1, tensor="t", src=r.get("src", -1), dst=r.get("dst", -1),
                 algorithm=r.get("algo", "ring"), t_ready_ns=0, source="test")
        for k, v in d.items():
            cols[k].append(v)
    return tables.to_arrow("collectives", cols)


def replay(msgs: dict, ranks: list[int], nbytes: int, init: np.ndarray, esize: int = 4):
    """Replay data messages symbolically.

    ``init`` is (n, nbytes/esize) of contributor ids (-1: nothing); the state of each rank and
    element is a bitset of contributor communicator indices. Messages are applied step by step:
    every message of a step carries its sender's state from before the step; ``reduce`` rows
    add (and must not overlap what the receiver holds: that would count a contribution twice),
    others store (a store of exactly what the receiver already holds is a duplicate receipt).

    Returns (state (n, E, W) uint64, duplicates count).
    """
    n = len(ranks)
    E = nbytes // esize
    W = (n + 63) // 64
    state = np.zeros((n, E, W), dtype=np.uint64)
    for i in range(n):
        for e in range(E):
            c = init[i, e]
            if c >= 0:
                state[i, e, c // 64] |= np.uint64(1) << np.uint64(c % 64)
    pos = {r: i for i, r in enumerate(ranks)}
    data = np.nonzero(np.asarray(msgs["kind"]) == "data")[0]
    step = msgs["step"][data]
    dup = 0
    for s in np.unique(step):
        rows = data[step == s]
        loads = []
        for k in rows:
            a, o, ln = pos[int(msgs["src_rank"][k])], int(msgs["buf_offset"][k]) // esize, int(msgs["bytes"][k]) // esize
            loads.append(state[a, o:o + ln].copy())
        for k, load in zip(rows, loads):
            if len(load) == 0:                         # an empty piece carries no data
                continue
            b, o = pos[int(msgs["dst_rank"][k])], int(msgs["buf_offset"][k]) // esize
            cur = state[b, o:o + len(load)]
            if msgs["reduce"][k]:
                assert not np.any(cur & load), f"message {k}: contribution counted twice"
                state[b, o:o + len(load)] = cur | load
            else:
                if np.array_equal(cur, load):
                    dup += 1
                state[b, o:o + len(load)] = load
    return state, dup


def full_mask(n: int) -> np.ndarray:
    W = (n + 63) // 64
    m = np.zeros(W, dtype=np.uint64)
    for c in range(n):
        m[c // 64] |= np.uint64(1) << np.uint64(c % 64)
    return m


def single_mask(n: int, c: int) -> np.ndarray:
    m = np.zeros((n + 63) // 64, dtype=np.uint64)
    m[c // 64] |= np.uint64(1) << np.uint64(c % 64)
    return m


def topo_of(plan):
    return topology.build(plan)


NS = [2, 3, 4, 5, 7, 8, 16, 24, 128]
BIG = make_plan(16, 8, channels=2, step_bytes=1024)       # 128 ranks, slices of 1 KiB
TOPO = topology.build(BIG)


def data_rows(m):
    return np.asarray(m["kind"]) == "data"


def sent_per_rank(m, ranks):
    d = data_rows(m)
    return np.array([m["bytes"][d & (m["src_rank"] == r)].sum() for r in ranks])


def init_all(n, E):
    return np.tile(np.arange(n)[:, None], (1, E))


# ----------------------------------------------------------------------------- byte counts


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("elems", [1009, 5])
def test_ring_all_reduce_sends_2_n_minus_1_S(n, elems):
    S = 4 * elems
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=list(range(n)), b=S)]), TOPO, BIG)
    d = data_rows(m)
    assert m["bytes"][d].sum() == 2 * (n - 1) * S
    # every step slice is at most step_bytes and whole elements
    assert m["bytes"][d].max() <= 1024 and not np.any(m["bytes"][d] % 4)


@pytest.mark.parametrize("n", NS)
def test_ring_all_reduce_per_rank_matches_busbw_factor(n):
    S = 4 * n * 2 * 37                       # divisible by n and channels: the factor is exact
    ranks = list(range(n))
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=ranks, b=S)]), TOPO, BIG)
    per = sent_per_rank(m, ranks)
    assert np.all(per * n == 2 * (n - 1) * S)          # busbw factor 2(n-1)/n


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_ring_all_gather_reduce_scatter_send_n_minus_1_S(n, op):
    shard = 4 * 1009                          # S = n * shard, shard not divisible by n
    ranks = list(range(n))
    m = collectives.lower(make_coll([dict(op=op, ranks=ranks, b=shard)]), TOPO, BIG)
    S = n * shard
    assert m["bytes"][data_rows(m)].sum() == (n - 1) * S
    per = sent_per_rank(m, ranks)
    assert np.all(per * n == (n - 1) * S)              # busbw factor (n-1)/n


@pytest.mark.parametrize("n", NS)
def test_all_to_all_per_rank(n):
    ranks = list(range(n))
    S = 4 * n * 3                                      # each rank's input, divisible by n
    m = collectives.lower(make_coll([dict(op="all_to_all", ranks=ranks, b=S, algo="direct")]), TOPO, BIG)
    assert np.all(sent_per_rank(m, ranks) * n == (n - 1) * S)
    # not divisible: NCCL-style blocks of ceil(E/n) elements; a rank sends all but its own block
    E = 1009
    m = collectives.lower(make_coll([dict(op="all_to_all", ranks=ranks, b=4 * E)]), TOPO, BIG)
    blk = -(-E // n)
    own = [4 * max(0, min(blk, E - i * blk)) for i in range(n)]
    assert np.array_equal(sent_per_rank(m, ranks), 4 * E - np.array(own))


@pytest.mark.parametrize("n", [2, 5, 8, 24])
@pytest.mark.parametrize("op", ["broadcast", "reduce"])
def test_chain_broadcast_reduce_factor_one(n, op):
    ranks = list(range(n))
    S = 4 * 1009
    root = ranks[n // 2]
    m = collectives.lower(make_coll([dict(op=op, ranks=ranks, b=S, src=root)]), TOPO, BIG)
    per = sent_per_rank(m, ranks)
    assert per.sum() == (n - 1) * S
    silent = ranks.index(root) if op == "reduce" else None
    if op == "reduce":
        assert per[silent] == 0 and np.all(np.delete(per, silent) == S)
    else:
        assert sorted(per.tolist()) == [0] + [S] * (n - 1)
        recv = [m["bytes"][data_rows(m) & (m["dst_rank"] == r)].sum() for r in ranks]
        assert recv[ranks.index(root)] == 0


def test_send_recv_direct():
    m = collectives.lower(make_coll([dict(op="send_recv", ranks=[3, 12], src=3, dst=12, b=4 * 100_003)]), TOPO, BIG)
    d = data_rows(m)
    assert m["bytes"][d].sum() == 4 * 100_003
    assert set(m["src_rank"][d]) == {3} and set(m["dst_rank"][d]) == {12}
    assert set(m["link"][d]) == {"network"}


# ----------------------------------------------------------------------------- symbolic replay


def _trace(op, ranks, b, plan=BIG, **kw):
    row = dict(op=op, ranks=ranks, b=b, **kw)
    return collectives.trace(make_coll([row]), topology.build(plan), plan)


@pytest.mark.parametrize("n", NS)
def test_replay_ring_all_reduce(n):
    E = 37                                             # not divisible by any n > 1 here
    ranks = list(range(n))
    m = _trace("all_reduce", ranks, 4 * E)
    state, dup = replay(m, ranks, 4 * E, init_all(n, E))
    assert np.all(state == full_mask(n)) and dup == 0


@pytest.mark.parametrize("n", NS)
def test_replay_ring_reduce_scatter_and_all_gather(n):
    E = 7
    ranks = list(range(n))
    m = _trace("reduce_scatter", ranks, 4 * E)
    state, dup = replay(m, ranks, 4 * n * E, init_all(n, n * E))
    for i in range(n):
        assert np.all(state[i, i * E:(i + 1) * E] == full_mask(n)), f"rank {i} lacks its reduced shard"
    init = np.full((n, n * E), -1)
    for i in range(n):
        init[i, i * E:(i + 1) * E] = i
    m = _trace("all_gather", ranks, 4 * E)
    state, dup = replay(m, ranks, 4 * n * E, init)
    assert dup == 0
    for j in range(n):
        assert np.all(state[:, j * E:(j + 1) * E] == single_mask(n, j))


@pytest.mark.parametrize("op", ["broadcast", "reduce"])
def test_replay_chain(op):
    n, E, root = 7, 300, 3
    ranks = list(range(n))
    m = _trace(op, ranks, 4 * E, src=root)
    if op == "broadcast":
        init = np.full((n, E), -1)
        init[root] = root
        state, dup = replay(m, ranks, 4 * E, init)
        assert np.all(state == single_mask(n, root)) and dup == 0
    else:
        state, _ = replay(m, ranks, 4 * E, init_all(n, E))
        assert np.all(state[root] == full_mask(n))


@pytest.mark.parametrize("nodes,gpus,n", [(8, 1, 8), (5, 1, 5), (2, 8, 16), (3, 4, 12), (16, 8, 128)])
def test_replay_tree(nodes, gpus, n):
    plan = make_plan(nodes, gpus, channels=2, step_bytes=256)
    ranks = list(range(n))
    E = 301
    m = _trace("all_reduce", ranks, 4 * E, plan=plan, algo="tree")
    state, dup = replay(m, ranks, 4 * E, init_all(n, E))
    assert np.all(state == full_mask(n)) and dup == 0


@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 8, 12, 16, 24])
def test_replay_halving_doubling(n):
    ranks = list(range(n))
    E = 53
    m = _trace("all_reduce", ranks, 4 * E, algo="halving_doubling")
    state, dup = replay(m, ranks, 4 * E, init_all(n, E))
    assert np.all(state == full_mask(n)) and dup == 0


@pytest.mark.parametrize("nodes,gpus", [(2, 8), (3, 4), (4, 2), (1, 8), (4, 1)])
def test_replay_hierarchical(nodes, gpus):
    plan = make_plan(nodes, gpus, channels=2, step_bytes=512)
    n = nodes * gpus
    ranks = list(range(n))
    E = 211
    m = _trace("all_reduce", ranks, 4 * E, plan=plan, algo="hierarchical")
    state, dup = replay(m, ranks, 4 * E, init_all(n, E))
    assert np.all(state == full_mask(n)) and dup == 0
    d = data_rows(m)
    net = d & (m["link"] == "network")
    S = 4 * E
    assert m["bytes"][net].sum() == 2 * (nodes - 1) * S
    assert m["bytes"][d & ~net].sum() == 2 * nodes * (gpus - 1) * S


def test_replay_all_to_allv_with_split_sizes():
    n = 5
    ranks = list(range(n))
    rng = np.random.default_rng(7)
    sizes = rng.integers(0, 40, size=(n, n)) * 4
    coll = make_coll([dict(op="all_to_allv", ranks=ranks, b=int(sizes.sum(axis=1).max()), algo="direct")])
    m = collectives.trace(coll, TOPO, BIG, splits={0: sizes})
    d = data_rows(m)
    off = np.concatenate([np.zeros((n, 1), int), np.cumsum(sizes, axis=1)[:, :-1]], axis=1)
    for i in range(n):
        for j in range(n):
            sel = d & (m["src_rank"] == i) & (m["dst_rank"] == j)
            got = sorted(zip(m["buf_offset"][sel], m["bytes"][sel]))
            if i == j or sizes[i, j] == 0:
                assert not got
                continue
            # contiguous, complete, received once: exactly the block i -> j of i's send buffer
            assert got[0][0] == off[i, j]
            assert sum(b for _, b in got) == sizes[i, j]
            assert all(a + b == c for (a, b), (c, _) in zip(got, got[1:]))


# ----------------------------------------------------------------------------- closed forms


def test_tree_closed_form_one_gpu_per_node():
    # 8 nodes x 1 GPU, 2 channels (tree 0 and its mirror), one slice per channel: every rank is
    # interior in one tree and a leaf in the other, so it sends 2S, except the two roots (S).
    plan = make_plan(8, 1, channels=2, step_bytes="1MiB")
    S = 4 * 1000
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=list(range(8)), b=S, algo="tree")]),
                          topology.build(plan), plan)
    d = data_rows(m)
    assert d.sum() == 2 * 2 * (8 - 1)                  # 2(n-1) messages per channel
    per = sent_per_rank(m, range(8))
    assert sorted(per.tolist()) == [S, S] + [2 * S] * 6
    assert per[0] == S and per[7] == S                  # roots of tree 0 (rank 0) and its mirror (7)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 3, 5, 6, 7, 12, 24])
def test_halving_doubling_closed_form(n):
    p = 1 << (n.bit_length() - 1)
    r = n - p
    S = 4 * p * 25                                      # divisible by p (one channel)
    plan = make_plan(16, 8, channels=1, step_bytes="1MiB")
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=list(range(n)), b=S,
                                          algo="halving_doubling")]), topology.build(plan), plan)
    d = data_rows(m)
    lg = p.bit_length() - 1
    assert d.sum() == 2 * r + 2 * p * lg
    assert m["bytes"][d].sum() == 2 * r * S + 2 * (p - 1) * S
    per = sent_per_rank(m, range(n))
    core = 2 * S * (p - 1) // p
    for i in range(n):
        want = S if (i < 2 * r and i % 2 == 0) else core + (S if i < 2 * r else 0)
        assert per[i] == want, i


def test_step_slicing_and_chunk_numbering():
    plan = make_plan(2, 1, channels=1)                  # default Simple step: 512 KiB
    S = 3 * 1024 * 1024                                 # 2 ranks: each step moves 1.5 MiB
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1], b=S)]), topology.build(plan), plan)
    d = data_rows(m)
    for st in (0, 1):
        sel = d & (m["step"] == st) & (m["src_rank"] == 0)
        assert m["bytes"][sel].tolist() == [512 * 1024] * 3
        assert m["chunk"][sel].tolist() == [0, 1, 2]


def test_channels_split_the_buffer():
    plan = make_plan(2, 1, channels=4, step_bytes="16MiB")
    S = 4 * 1001
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1], b=S)]), topology.build(plan), plan)
    d = data_rows(m)
    per_ch = [m["bytes"][d & (m["channel"] == c) & (m["step"] == 0) & (m["src_rank"] == 0)].sum()
              + m["bytes"][d & (m["channel"] == c) & (m["step"] == 0) & (m["src_rank"] == 1)].sum()
              for c in range(4)]
    assert per_ch == [4 * 251, 4 * 251, 4 * 251, 4 * 248]   # ceil(1001/4) elements per channel


# ----------------------------------------------------------------------------- protocol mechanics


@pytest.mark.parametrize("proto,line,data", [("ll", 16, 8), ("ll128", 128, 120)])
def test_ll_ll128_wire_bytes_exact(proto, line, data):
    plan = make_plan(2, 1, channels=1, protocol=proto)
    for S in (4 * 1000, 4 * 1003, 4 * 100_000, 4 * 2_000_003):
        m = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1], b=S)]), topology.build(plan), plan)
        d = data_rows(m)
        b = m["bytes"][d]
        assert np.array_equal(m["wire_bytes"][d], -(-b // data) * line)
        assert b.sum() == 2 * S
    # default step slices: LL 32 KiB, LL128 576,000 bytes of data
    S = 4 * 1_000_000
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1], b=S)]), topology.build(plan), plan)
    d = data_rows(m)
    assert m["bytes"][d].max() == {"ll": 32 * 1024, "ll128": 576_000}[proto]
    simple = make_plan(2, 1, channels=1)
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1], b=4 * 1003)]), topology.build(simple), simple)
    assert np.array_equal(m["wire_bytes"], m["bytes"])


def test_cts_before_each_network_slice():
    plan = make_plan(2, 2, channels=2, step_bytes=4096)
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1, 2, 3], b=4 * 10_007)]),
                          topology.build(plan), plan)
    kind = np.asarray(m["kind"])
    cts = kind == "cts"
    net_data = (kind == "data") & (m["link"] == "network")
    assert cts.sum() == net_data.sum() > 0
    assert np.all(m["bytes"][cts] == 64) and np.all(m["wire_bytes"][cts] == 64)
    assert set(m["link"][cts]) == {"network"}
    for k in np.nonzero(net_data)[0]:
        c = k - 1                                       # its credit comes right before it
        assert kind[c] == "cts"
        assert (m["op_id"][c], m["step"][c], m["channel"][c], m["chunk"][c]) == \
               (m["op_id"][k], m["step"][k], m["channel"][k], m["chunk"][k])
        assert (m["src_rank"][c], m["dst_rank"][c]) == (m["dst_rank"][k], m["src_rank"][k])
        assert (m["src_nic"][c], m["dst_nic"][c]) == (m["dst_nic"][k], m["src_nic"][k])
    off = make_plan(2, 2, channels=2, step_bytes=4096, cts=False)
    m2 = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1, 2, 3], b=4 * 10_007)]),
                           topology.build(off), off)
    assert "cts" not in set(m2["kind"]) and len(m2["msg_id"]) == len(m["msg_id"]) - cts.sum()


def test_qps_per_connection_round_robin_and_split():
    S = 4 * 300_000
    plan = make_plan(2, 1, channels=1, step_bytes=65536, qps_per_connection=4)
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1], b=S)]), topology.build(plan), plan)
    d = data_rows(m)
    for s in (0, 1):
        q = m["qp_index"][d & (m["src_rank"] == s)]
        assert q.tolist() == [i % 4 for i in range(len(q))]   # messages take the QPs in turn
    cts = np.asarray(m["kind"]) == "cts"
    assert np.array_equal(m["qp_index"][np.nonzero(d)[0] - 1], m["qp_index"][d])  # credit on the same QP

    split = make_plan(2, 1, channels=1, step_bytes=65536, qps_per_connection=4, split_data_on_qps=True)
    m2 = collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1], b=S)]), topology.build(split), split)
    d2 = data_rows(m2)
    assert m2["bytes"][d2].sum() == 2 * S
    assert (np.asarray(m2["kind"]) == "cts").sum() == cts.sum()     # one credit per slice, not per piece
    # a 65,536-byte slice becomes 4 pieces of 16,384 on QPs 0..3; the last slice of a step
    # (300,000/2 = 150,000 elements per chunk -> 600,000 bytes = 9 x 65,536 + 10,176) splits
    # into ceil(ceil(10176/4)/128)*128 = 2560-byte pieces: 2560, 2560, 2560, 2496
    first = d2 & (m2["src_rank"] == 0) & (m2["step"] == 0) & (m2["chunk"] == 0)
    assert m2["bytes"][first].tolist() == [16384] * 4 and m2["qp_index"][first].tolist() == [0, 1, 2, 3]
    last = d2 & (m2["src_rank"] == 0) & (m2["step"] == 0) & (m2["chunk"] == 9)
    assert m2["bytes"][last].tolist() == [2560, 2560, 2560, 2496]


def test_nvlink_messages_have_no_cts_and_stay_off_the_network():
    plan = make_plan(1, 8, channels=2)
    m = collectives.lower(make_coll([dict(op="all_reduce", ranks=list(range(8)), b=4 * 10_000)]),
                          topology.build(plan), plan)
    assert set(m["link"]) == {"nvlink"} and set(m["kind"]) == {"data"}
    assert set(m["verb"]) == {""} and set(m["qpn"]) == {-1} and set(m["udp_sport"]) == {-1}
    assert not m["t_start_ns"].any() and not m["t_end_ns"].any()


def test_messages_table_schema_and_order():
    coll = make_coll([dict(op="all_reduce", ranks=list(range(16)), b=4 * 5000),
                      dict(op="all_gather", ranks=[0, 8], b=4 * 100),
                      dict(op="send_recv", ranks=[1, 9], src=1, dst=9, b=1000)])
    m = collectives.lower(coll, TOPO, BIG)
    t = tables.to_arrow("messages", m)
    tables.check("messages", t)
    assert np.array_equal(m["msg_id"], np.arange(len(m["msg_id"])))
    assert np.all(np.diff(m["op_id"]) >= 0)
    for op in range(3):
        st = m["step"][m["op_id"] == op]
        assert np.all(np.diff(st) >= 0)


def test_vectorized_over_many_calls():
    # 2,000 calls of the same shapes: one template per shape, repeated
    rows = [dict(op="all_reduce", ranks=[g, g + 8], b=4 * 1000 + 4 * (i % 3), group=g)
            for i in range(2000) for g in [i % 8]]
    m = collectives.lower(make_coll(rows), TOPO, BIG)
    d = data_rows(m)
    assert m["bytes"][d].sum() == sum(2 * r["b"] for r in rows)
    assert np.array_equal(np.unique(m["op_id"]), np.arange(2000))


# ----------------------------------------------------------------------------- algorithm choice


def test_resolve_auto_like_nccl():
    plan = make_plan(16, 8, channels=2, algorithm="auto")
    topo = topology.build(plan)
    rows = [dict(op="all_reduce", ranks=list(range(128)), b=64 * 1024, algo="auto"),
            dict(op="all_reduce", ranks=list(range(128)), b=1 << 30, algo="auto"),
            dict(op="all_gather", ranks=list(range(16)), b=4096, algo="auto"),
            dict(op="all_to_all", ranks=list(range(16)), b=4096, algo="auto"),
            dict(op="all_gather", ranks=list(range(16)), b=4096, algo="tree"),
            dict(op="all_reduce", ranks=[0, 1, 2, 8], b=4096, algo="hierarchical")]
    got = collectives.resolve_algorithms(make_coll(rows), topo, plan).column("algorithm").to_pylist()
    assert got == ["tree", "ring", "ring", "direct", "ring", "ring"]


def test_nccl_model_crossover():
    from wiretrace.collectives.tuning import auto_all_reduce
    # 16 nodes x 8 GPUs, 50 GB/s per GPU: tree up to 32 MiB, ring from 256 MiB (between, NCCL's
    # tree correction factors make the choice alternate, as in NCCL itself)
    picks = {k: auto_all_reduce(1 << k, 128, 16, 50.0) for k in range(10, 32)}
    assert all(picks[k] == "tree" for k in range(10, 26))
    assert all(picks[k] == "ring" for k in range(28, 32))
    # one node: the tree's 28 us NVLink latency per hop makes the ring win at every size
    assert {auto_all_reduce(1 << k, 8, 1, 900.0) for k in range(10, 32)} == {"ring"}


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_row():
    bad = make_coll([dict(op="all_reduce", ranks=[0, 1], b=8)])
    bad = bad.set_column(bad.schema.get_field_index("group_size"), bad.schema.field("group_size"),
                         pa.array([3], type=pa.int32()))
    with pytest.raises(WiretraceError, match="group_size"):
        collectives.lower(bad, TOPO, BIG)
    with pytest.raises(WiretraceError, match="outside"):
        collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 500], b=8)]), TOPO, BIG)
    with pytest.raises(WiretraceError, match="root"):
        collectives.lower(make_coll([dict(op="broadcast", ranks=[0, 1], b=8, src=5)]), TOPO, BIG)
    with pytest.raises(WiretraceError, match="algorithm"):
        collectives.lower(make_coll([dict(op="all_reduce", ranks=[0, 1], b=8, algo="bogus")]), TOPO, BIG)


@pytest.mark.parametrize("proto", ["simple", "ll", "ll128"])
def test_replay_with_qp_split_and_protocols(proto):
    plan = make_plan(4, 1, channels=2, step_bytes=2048, protocol=proto, qps_per_connection=3,
                     split_data_on_qps=True)
    ranks = [0, 1, 2, 3]
    E = 1001
    m = _trace("all_reduce", ranks, 4 * E, plan=plan)
    d = data_rows(m)
    assert m["bytes"][d].sum() == 2 * 3 * 4 * E
    assert set(m["qp_index"][d]) == {0, 1, 2}
    # the pieces of one slice (one per QP) add up to the slice and its framed size
    key = np.stack([m["src_rank"], m["step"], m["channel"], m["chunk"]], axis=1)[d]
    _, inv = np.unique(key, axis=0, return_inverse=True)
    inv = inv.ravel()
    b = np.bincount(inv, weights=m["bytes"][d]).astype(np.int64)
    w = np.bincount(inv, weights=m["wire_bytes"][d]).astype(np.int64)
    assert np.array_equal(w, collectives.wire_bytes(b, proto))
    assert np.all(np.bincount(inv) == 3)
    state, dup = replay(m, ranks, 4 * E, init_all(4, E))
    assert np.all(state == full_mask(4)) and dup == 0


def test_auto_in_the_table_is_resolved_when_lowering():
    plan = make_plan(16, 8, channels=2, algorithm="auto")
    topo = topology.build(plan)
    m = collectives.trace(make_coll([dict(op="all_reduce", ranks=list(range(128)), b=4 * 1000, algo="auto")]),
                          topo, plan)
    d = data_rows(m)
    assert d.sum() == 2 * 2 * 127                     # tree: 2(n-1) messages per channel, one slice
    state, dup = replay(m, list(range(128)), 4000, init_all(128, 1000))
    assert np.all(state == full_mask(128)) and dup == 0


def test_all_to_all_blocks_sit_at_their_send_displacements():
    n, blk = 6, 4 * 33
    m = collectives.lower(make_coll([dict(op="all_to_all", ranks=list(range(n)), b=n * blk)]), TOPO, BIG)
    d = data_rows(m)
    for i in range(n):
        for j in range(n):
            sel = d & (m["src_rank"] == i) & (m["dst_rank"] == j)
            if i == j:
                assert not sel.any()
            else:
                assert m["buf_offset"][sel].min() == j * blk and m["bytes"][sel].sum() == blk


def test_communicator_ranks_are_numbered_in_ascending_order():
    # ingest lists a communicator in a measured ring's order; shard i still belongs to the i-th
    # smallest rank, as in NCCL (comm rank) and torch.distributed.new_group (sorted ranks)
    shard = 4 * 10
    listed = [3, 1, 2, 0]
    m = collectives.trace(make_coll([dict(op="all_gather", ranks=listed, b=shard)]), TOPO, BIG)
    d = data_rows(m) & (m["step"] == 0)
    for r in listed:
        assert set(m["buf_offset"][d & (m["src_rank"] == r)] // shard) == {r}
    ranks = sorted(listed)
    init = np.full((4, 4 * 10), -1)
    for i in range(4):
        init[i, i * 10:(i + 1) * 10] = i
    state, dup = replay(m, ranks, 4 * shard, init)
    for j in range(4):
        assert np.all(state[:, j * 10:(j + 1) * 10] == single_mask(4, j)) and dup == 0
    # without src, a broadcast's root is the first rank as listed
    m = collectives.lower(make_coll([dict(op="broadcast", ranks=listed, b=400)]), TOPO, BIG)
    assert 3 in set(m["src_rank"][data_rows(m)]) and 3 not in set(m["dst_rank"][data_rows(m)])
