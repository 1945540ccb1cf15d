"""Reading and checking the collectives table as columns (no per-row Python loop).

Calls are keyed by their communicator: every distinct ``ranks`` list gets an id, found with
``numpy.unique`` over the lists of each length, so that the stages that follow work per distinct
(communicator, operation, size) rather than per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import WiretraceError
from ..topology import Topology


def _codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Integer codes and the names they stand for, for a string or dictionary column."""
    arr = col.combine_chunks()
    if not pa.types.is_dictionary(arr.type):
        arr = pc.dictionary_encode(arr)
    names = [str(x) if x is not None else "" for x in arr.dictionary.to_pylist()]
    idx = arr.indices.to_numpy(zero_copy_only=False)
    return np.asarray(idx, dtype=np.int64), names


@dataclass
class Rows:
    """The columns of a collectives table that lowering needs, checked."""

    op_id: np.ndarray
    op: np.ndarray            # object array of str
    given_algorithm: np.ndarray
    dtype: np.ndarray
    bytes_per_rank: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    comm: np.ndarray          # communicator id of each row (index into ``comms``), -1: none
    comms: list[np.ndarray]   # distinct communicators, ranks ascending (send_recv: [src, dst])
    first_rank: np.ndarray    # first rank of each row's ``ranks`` list as given (-1: empty)


def read(coll: pa.Table, topo: Topology, ops: tuple[str, ...]) -> Rows:
    """Columns of ``coll`` with communicator ids.

    Raises
    ------
    WiretraceError : unknown op; ``ranks`` length differs from ``group_size``; a rank outside the
        cluster; send_recv without ``src``/``dst``; negative ``bytes_per_rank``.
    """
    n = coll.num_rows
    op_id = coll.column("op_id").to_numpy().astype(np.int64)
    oc, onames = _codes(coll.column("op"))
    ac, anames = _codes(coll.column("algorithm"))
    dc, dnames = _codes(coll.column("dtype"))
    op = np.asarray(onames, dtype=object)[oc] if n else np.zeros(0, object)
    bad = [o for o in set(op.tolist()) if o not in ops]
    if bad:
        i = int(np.nonzero(op == bad[0])[0][0])
        raise WiretraceError(f"collectives row {i} (op_id {op_id[i]}): op {bad[0]!r} is not one of {', '.join(ops)}")
    bpr = coll.column("bytes_per_rank").to_numpy().astype(np.int64)
    if n and bpr.min() < 0:
        i = int(np.argmin(bpr))
        raise WiretraceError(f"collectives row {i} (op_id {op_id[i]}): bytes_per_rank {bpr[i]} < 0")
    src = coll.column("src").to_numpy().astype(np.int64)
    dst = coll.column("dst").to_numpy().astype(np.int64)
    gsize = coll.column("group_size").to_numpy().astype(np.int64)
    rl = coll.column("ranks").combine_chunks()
    roff = rl.offsets.to_numpy().astype(np.int64)
    rvals = rl.values.to_numpy(zero_copy_only=False).astype(np.int64)
    length = np.diff(roff)
    p2p = op == "send_recv"
    wrong = ~p2p & (length != gsize)
    if wrong.any():
        i = int(np.nonzero(wrong)[0][0])
        raise WiretraceError(f"collectives row {i} (op_id {op_id[i]}): ranks has {length[i]} entries "
                             f"but group_size = {gsize[i]}")
    nop = p2p & ((src < 0) | (dst < 0))
    if nop.any():
        i = int(np.nonzero(nop)[0][0])
        raise WiretraceError(f"collectives row {i} (op_id {op_id[i]}): send_recv needs src and dst >= 0")
    world = topo.world_size
    outside = (rvals < 0) | (rvals >= world)
    sr_out = p2p & ((src >= world) | (dst >= world))
    if outside.any() or sr_out.any():
        if outside.any():
            k = int(np.nonzero(outside)[0][0])
            i, r = int(np.searchsorted(roff, k, side="right") - 1), int(rvals[k])
        else:
            i = int(np.nonzero(sr_out)[0][0])
            r = int(max(src[i], dst[i]))
        raise WiretraceError(f"collectives row {i} (op_id {op_id[i]}): rank {r} outside the cluster's "
                             f"{world} ranks")
    comm = np.full(n, -1, dtype=np.int64)
    comms: list[np.ndarray] = []
    groups = [(2, np.nonzero(p2p)[0], np.stack([src[p2p], dst[p2p]], axis=1))]
    # a communicator's rank i is its i-th smallest global rank (torch.distributed.new_group
    # sorts the ranks it is given; the world communicator is the identity), whatever order the
    # table lists them in (ingest lists them in a measured ring's order)
    for L in np.unique(length[~p2p]):
        idx = np.nonzero(~p2p & (length == L))[0]
        groups.append((int(L), idx, np.sort(rvals[roff[idx][:, None] + np.arange(L)[None, :]], axis=1)))
    for L, idx, mat in groups:
        if len(idx) == 0:
            continue
        first, inv = distinct_rows(mat)
        comm[idx] = len(comms) + inv
        comms.extend(mat[first])
    first_rank = np.where(length > 0, rvals[np.minimum(roff[:-1], max(len(rvals) - 1, 0))] if len(rvals) else -1, -1)
    return Rows(op_id=op_id, op=op, first_rank=first_rank.astype(np.int64),
                given_algorithm=np.asarray(anames, dtype=object)[ac] if n else np.zeros(0, object),
                dtype=np.asarray(dnames, dtype=object)[dc] if n else np.zeros(0, object),
                bytes_per_rank=bpr, src=src, dst=dst, comm=comm, comms=comms)


def distinct_rows(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of an int matrix: (index of each distinct row's first occurrence, row -> id).

    Rows are hashed (a 64-bit polynomial over the columns, wrapping) and the hash collisions, if
    any, checked; ``numpy.unique(axis=0)`` (a sort of opaque byte strings) is much slower.
    """
    mat = np.ascontiguousarray(mat, dtype=np.int64)
    if mat.shape[0] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    mult = (np.arange(mat.shape[1], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            + np.uint64(0xD6E8FEB86659FD93)) | np.uint64(1)
    with np.errstate(over="ignore"):
        h = (mat.astype(np.uint64) * mult[None, :]).sum(axis=1, dtype=np.uint64)
        h ^= h >> np.uint64(29)
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.ravel()
    if not np.array_equal(mat, mat[first[inv]]):           # a collision: do it the slow way
        _, first, inv = np.unique(mat, axis=0, return_index=True, return_inverse=True)
        inv = inv.ravel()
    return first.astype(np.int64), inv.astype(np.int64)


def unique_rows(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First row index of each distinct combination of ``cols`` and the inverse (row -> group)."""
    codes = []
    for c in cols:
        if c.dtype == object:            # small vocabularies of str: a dict beats sorting strings
            vals = c.tolist()
            vocab = {v: i for i, v in enumerate(sorted(set(vals)))}
            codes.append(np.fromiter((vocab[v] for v in vals), dtype=np.int64, count=len(vals)))
        else:
            codes.append(np.asarray(c, dtype=np.int64).ravel())
    return distinct_rows(np.stack(codes, axis=1))
