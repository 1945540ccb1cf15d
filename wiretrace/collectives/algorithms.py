"""Collective algorithms as transfers between communicator indices, built with NumPy.

Each builder returns a :class:`Transfers` — one row per (sender, receiver, step, channel) transfer
of one contiguous byte range — for one collective shape; :mod:`wiretrace.collectives.lower` cuts
the transfers into protocol step slices, maps communicator indices to global ranks and adds
clear-to-send messages.

Conventions shared by all builders:

* Sizes are split in whole elements, NCCL-style: ``k`` parts of ``E`` elements get
  ``ceil(E/k)`` elements each and the last ones what remains (possibly nothing); the buffer is
  split across channels first, then each channel's part by the algorithm.
* ``offset`` is the byte offset of the range in the collective's buffer: the ``bytes_per_rank``
  buffer for all_reduce, broadcast and reduce; the whole ``n x shard`` buffer for all_gather and
  reduce_scatter (shard ``i`` belongs to communicator index ``i``); the sender's send buffer for
  all_to_all(v); the message for send_recv.
* ``reduce`` is True when the receiver combines the range with its own data (reduce-scatter
  phases, tree reduce, chain reduce), False when it stores it.
* ``step``: a transfer of step ``k`` leaves its sender after what the sender receives in steps
  ``< k`` of the same call and channel (the rule ``wiretrace.timing`` applies).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .placement import tree_parents


@dataclass
class Transfers:
    """Transfers of one collective shape; all arrays have the same length."""

    src: np.ndarray      # communicator index of the sender
    dst: np.ndarray      # communicator index of the receiver
    step: np.ndarray
    channel: np.ndarray
    offset: np.ndarray   # bytes
    length: np.ndarray   # bytes
    reduce: np.ndarray   # bool

    @staticmethod
    def concat(parts: list["Transfers"]) -> "Transfers":
        parts = [p for p in parts if len(p.src)]
        if not parts:
            z = np.zeros(0, np.int64)
            return Transfers(z, z, z, z, z, z, np.zeros(0, bool))
        return Transfers(*(np.concatenate([getattr(p, f) for p in parts])
                           for f in ("src", "dst", "step", "channel", "offset", "length", "reduce")))


def _mk(src, dst, step, channel, offset, length, reduce) -> Transfers:
    b = np.broadcast_arrays(np.asarray(src), np.asarray(dst), np.asarray(step), np.asarray(channel),
                            np.asarray(offset), np.asarray(length), np.asarray(reduce))
    arrs = [np.ascontiguousarray(x).ravel() for x in b]
    return Transfers(*(a.astype(np.int64) for a in arrs[:6]), arrs[6].astype(bool))


def split_even(total: int | np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """NCCL-style split of ``total`` elements into ``parts``: (offsets, sizes), shapes (..., parts).

    Each part gets ``ceil(total/parts)`` elements except the last ones, which get the rest (zero
    when ``total`` is small), as NCCL's ring kernels compute ``chunkSize = divUp(count, nranks)``
    (``src/device/all_reduce.h``).
    """
    total = np.asarray(total, dtype=np.int64)
    chunk = -(-total // parts)
    idx = np.arange(parts, dtype=np.int64)
    off = np.minimum(idx * chunk[..., None], total[..., None])
    size = np.minimum(off + chunk[..., None], total[..., None]) - off
    return off, size


def channel_split(elems: int, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Element offsets and counts of each channel's part of a buffer of ``elems`` elements."""
    return split_even(elems, channels)


# ----------------------------------------------------------------------------- ring family


def ring_all_reduce(order: np.ndarray, elems: int, esize: int) -> Transfers:
    """Ring all-reduce: reduce-scatter (n-1 steps) then all-gather (n-1 steps).

    At step ``s < n-1`` ring position ``p`` sends chunk ``(p-1-s) mod n`` to ``p+1``, which
    reduces it; at step ``n-1+t`` it sends chunk ``(p-t) mod n``, which the next rank stores
    (NCCL ``src/device/all_reduce.h``, ``runRing``). Every chunk crosses ``2(n-1)`` ring edges, so
    the ranks together send exactly ``2(n-1) S`` bytes.

    Parameters
    ----------
    order : (channels, n) ring order (communicator indices) per channel.
    elems : elements in the buffer; esize : bytes per element.
    """
    C, n = order.shape
    coff, csize = channel_split(elems, C)                      # (C,)
    ckoff, cksize = split_even(csize, n)                       # (C, n)
    s = np.arange(2 * (n - 1))[None, :, None]
    p = np.arange(n)[None, None, :]
    c = np.arange(C)[:, None, None]
    chunk = np.where(s < n - 1, (p - 1 - s) % n, (p - (s - (n - 1))) % n)
    src = order[c, p]
    dst = order[c, (p + 1) % n]
    off = (coff[c] + ckoff[c, chunk]) * esize
    ln = cksize[c, chunk] * esize
    return _mk(src, dst, s, c, off, ln, s < n - 1)


def ring_reduce_scatter(order: np.ndarray, shard_elems: int, esize: int) -> Transfers:
    """Ring reduce-scatter: n-1 steps; position ``p`` sends at step ``s`` the partial sum of the
    shard owned by the rank at ring position ``(p-1-s) mod n`` (NCCL ``src/device/reduce_scatter.h``).
    Total sent: ``(n-1) S`` with ``S = n x shard``."""
    C, n = order.shape
    coff, csize = channel_split(shard_elems, C)
    s = np.arange(n - 1)[None, :, None]
    p = np.arange(n)[None, None, :]
    c = np.arange(C)[:, None, None]
    owner = order[c, (p - 1 - s) % n]
    off = (owner * shard_elems + coff[c]) * esize
    return _mk(order[c, p], order[c, (p + 1) % n], s, c, off, csize[c] * esize, True)


def ring_all_gather(order: np.ndarray, shard_elems: int, esize: int) -> Transfers:
    """Ring all-gather: n-1 steps; position ``p`` forwards at step ``s`` the shard of ring position
    ``(p-s) mod n`` (NCCL ``src/device/all_gather.h``). Total sent: ``(n-1) S``."""
    C, n = order.shape
    coff, csize = channel_split(shard_elems, C)
    s = np.arange(n - 1)[None, :, None]
    p = np.arange(n)[None, None, :]
    c = np.arange(C)[:, None, None]
    owner = order[c, (p - s) % n]
    off = (owner * shard_elems + coff[c]) * esize
    return _mk(order[c, p], order[c, (p + 1) % n], s, c, off, csize[c] * esize, False)


def chain(order: np.ndarray, elems: int, esize: int, reduce: bool) -> Transfers:
    """Pipelined chain along the ring from the root (position 0): broadcast (root -> ... -> last)
    or reduce (last -> ... -> root), NCCL's ring broadcast/reduce (``src/device/broadcast.h``,
    ``reduce.h``). Hop ``h`` is step ``h``; the slices of a step pipeline hop to hop. Every rank
    but one sends the whole buffer once: ``(n-1) S`` in total, busbw factor 1."""
    C, n = order.shape
    coff, csize = channel_split(elems, C)
    h = np.arange(n - 1)[None, :]
    c = np.arange(C)[:, None]
    if reduce:
        src, dst = order[c, n - 1 - h], order[c, n - 2 - h]
    else:
        src, dst = order[c, h], order[c, h + 1]
    return _mk(src, dst, h, c, coff[c] * esize, csize[c] * esize, reduce)


# ----------------------------------------------------------------------------- tree


def tree_all_reduce(order: np.ndarray, node_sizes: list[int], elems: int, esize: int) -> Transfers:
    """NCCL's double binary tree all-reduce: reduce up the tree, broadcast down.

    Channels in the first half use tree 0, the second half tree 1 (NCCL duplicates its tree
    channels and gives the copies the mirrored/shifted tree, ``src/graph/connect.cc``
    ``connectTrees``); with one channel only tree 0 is used. Steps: a rank sends up at step
    ``height(parent) - 1`` so that a parent receives all its children in one step; the root sends
    down at step ``H`` (tree height), a rank at depth ``d`` at ``H + d``. Each non-root rank sends
    the channel's part up once and every non-leaf sends it to each child once: ``2(n-1) S_c``
    bytes per channel in total.
    """
    C, n = order.shape
    coff, csize = channel_split(elems, C)
    parts = []
    for c in range(C):
        tree = 1 if (C >= 2 and c >= C // 2) else 0
        par = tree_parents(node_sizes, tree)
        height = np.zeros(n, dtype=np.int64)
        depth = np.zeros(n, dtype=np.int64)
        # depth by walking up (n is a communicator size: setup, not a per-message loop)
        for i in range(n):
            d, j = 0, i
            while par[j] >= 0:
                j = par[j]
                d += 1
                height[j] = max(height[j], d)
            depth[i] = d
        H = int(height.max()) if n else 0
        kids = np.nonzero(par >= 0)[0]
        up = _mk(order[c, kids], order[c, par[kids]], height[par[kids]] - 1, c,
                 coff[c] * esize, csize[c] * esize, True)
        down = _mk(order[c, par[kids]], order[c, kids], H + depth[par[kids]], c,
                   coff[c] * esize, csize[c] * esize, False)
        parts += [up, down]
    return Transfers.concat(parts)


# ----------------------------------------------------------------------------- halving-doubling


def halving_doubling(n: int, channels: int, elems: int, esize: int) -> Transfers:
    """Rabenseifner's all-reduce: recursive-halving reduce-scatter, recursive-doubling all-gather.

    For ``n`` not a power of two (``p`` the largest power of two below, ``r = n - p``), the first
    ``2r`` ranks pair up before and after: even rank ``2i`` sends its whole buffer to ``2i+1``
    (reduce), drops out, and receives the result from it at the end — the scheme of Thakur,
    Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA
    2005), as in MPICH's ``allreduce_intra_reduce_scatter_allgather``. The buffer is cut into ``p``
    blocks; at reduce-scatter step ``k`` new rank ``q`` exchanges half of its current block range
    with ``q xor 2^k``. Per channel part ``S_c``: ``2r S_c + 2 S_c (p-1)`` bytes in total.
    """
    p = 1 << (n.bit_length() - 1)
    r = n - p
    lg = p.bit_length() - 1
    coff, csize = channel_split(elems, channels)
    real = np.where(np.arange(p) < r, 2 * np.arange(p) + 1, np.arange(p) + r)   # new rank -> index
    parts = []
    for c in range(channels):
        boff, bsize = split_even(int(csize[c]), p)
        bounds = np.concatenate([boff, [int(csize[c])]])
        base = int(coff[c])
        step = 0
        if r:
            i = np.arange(r)
            parts.append(_mk(2 * i, 2 * i + 1, 0, c, base * esize, csize[c] * esize, True))
            step = 1
        q = np.arange(p)
        lo = np.zeros(p, dtype=np.int64)
        hi = np.full(p, p, dtype=np.int64)
        for k in range(lg):
            mask = 1 << k
            half = (hi - lo) // 2
            keep_low = (q & mask) == 0
            send_lo = np.where(keep_low, lo + half, lo)
            send_hi = np.where(keep_low, hi, lo + half)
            parts.append(_mk(real[q], real[q ^ mask], step, c, (base + bounds[send_lo]) * esize,
                             (bounds[send_hi] - bounds[send_lo]) * esize, True))
            lo, hi = np.where(keep_low, lo, lo + half), np.where(keep_low, lo + half, hi)
            step += 1
        for k in reversed(range(lg)):
            mask = 1 << k
            parts.append(_mk(real[q], real[q ^ mask], step, c, (base + bounds[lo]) * esize,
                             (bounds[hi] - bounds[lo]) * esize, False))
            width = hi - lo
            lo = np.where((q & mask) == 0, lo, lo - width)
            hi = lo + 2 * width
            step += 1
        if r:
            i = np.arange(r)
            parts.append(_mk(2 * i + 1, 2 * i, step, c, base * esize, csize[c] * esize, False))
    return Transfers.concat(parts)


# ----------------------------------------------------------------------------- direct


def direct(sizes: np.ndarray, channels: int, esize: int) -> Transfers:
    """Pairwise exchange (all_to_all, all_to_allv, send_recv): index ``i`` sends ``sizes[i, j]``
    bytes to ``j``, in NCCL's peer order ``j = i+1, i+2, ...`` (``src/enqueue.cc`` p2p schedule).
    The exchanges do not depend on each other (step 0). ``offset`` is the position of the block
    in the sender's send buffer (row prefix sums, the block a rank keeps for itself included, as
    all-to-allv's send displacements), each block split across channels.
    """
    n = sizes.shape[0]
    rowoff = np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(sizes, axis=1)[:, :-1]], axis=1)
    i = np.arange(n)[:, None]
    s = np.arange(1, n)[None, :]
    j = (i + s) % n
    src = np.broadcast_to(i, j.shape).ravel()
    dst = j.ravel()
    blk = sizes[src, dst] // esize
    boff = rowoff[src, dst]
    coff, csize = split_even(blk, channels)                    # (m, C)
    c = np.arange(channels)[None, :]
    return _mk(src[:, None], dst[:, None], 0, c, boff[:, None] + coff * esize, csize * esize, False)


# ----------------------------------------------------------------------------- hierarchical


def hierarchical(order: np.ndarray, nodes: int, local: int, elems: int, esize: int) -> Transfers:
    """Rail-local hierarchical all-reduce: intra-node ring reduce-scatter over NVLink, inter-node
    ring all-reduce among the GPUs of each rail, intra-node ring all-gather.

    ``order`` is node-major: position ``i*local + q`` is local position ``q`` of node ``i``. The
    buffer (per channel) is cut into ``local`` shards; local position ``q`` reduces shard ``q``
    (steps ``0..local-2``), all-reduces it with position ``q`` of every other node
    (``2(nodes-1)`` steps), then the node all-gathers (``local-1`` steps). Bytes per channel part:
    ``2 nodes (local-1) S_c`` on NVLink plus ``2 (nodes-1) S_c`` on the network.
    """
    C, n = order.shape
    L, m = local, nodes
    coff, csize = channel_split(elems, C)
    soff, ssize = split_even(csize, L)                         # (C, L)
    c = np.arange(C)[:, None, None, None]
    parts = []
    if L > 1:
        s = np.arange(L - 1)[None, :, None, None]
        i = np.arange(m)[None, None, :, None]
        p = np.arange(L)[None, None, None, :]
        shard = (p - 1 - s) % L
        parts.append(_mk(order[c, i * L + p], order[c, i * L + (p + 1) % L], s, c,
                         (coff[c] + soff[c, shard]) * esize, ssize[c, shard] * esize, True))
    if m > 1:
        koff, ksize = split_even(ssize, m)                     # (C, L, m)
        s = np.arange(2 * (m - 1))[None, :, None, None]
        q = np.arange(L)[None, None, :, None]
        p = np.arange(m)[None, None, None, :]
        chunk = np.where(s < m - 1, (p - 1 - s) % m, (p - (s - (m - 1))) % m)
        parts.append(_mk(order[c, p * L + q], order[c, ((p + 1) % m) * L + q], (L - 1) + s, c,
                         (coff[c] + soff[c, q] + koff[c, q, chunk]) * esize,
                         ksize[c, q, chunk] * esize, s < m - 1))
    if L > 1:
        s = np.arange(L - 1)[None, :, None, None]
        i = np.arange(m)[None, None, :, None]
        p = np.arange(L)[None, None, None, :]
        shard = (p - s) % L
        parts.append(_mk(order[c, i * L + p], order[c, i * L + (p + 1) % L],
                         (L - 1) + 2 * (m - 1) + s, c,
                         (coff[c] + soff[c, shard]) * esize, ssize[c, shard] * esize, False))
    return Transfers.concat(parts)
