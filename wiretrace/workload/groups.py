"""Process groups built from ``parallelism.order`` exactly as Megatron-LM builds them.

Megatron-LM (``megatron/core/parallel_state.py``: ``RankGenerator`` and
``generate_masked_orthogonal_rank_groups``) numbers ranks so that the first parallelism named in
``order`` varies fastest::

    rank = i_0 + n_0 * (i_1 + n_1 * (i_2 + ...))     for order "tp-cp-ep-dp-pp"

A group of parallelism X collects the ranks that differ only in X; groups are enumerated with the
remaining coordinates in the same fastest-first order, and ranks inside a group by increasing X
index. Here that is a reshape of ``np.arange(world)`` in Fortran order and a transpose that moves
the group's axes last.

Two generators exist, as in Megatron-LM's ``initialize_model_parallel``: the decoder one
(``ep = 1``; TP, CP, PP and the ``dp-cp`` gradient groups) and the expert one (``cp = 1``,
``tp = expert tp = tp``, ``dp = dp*cp/ep``; EP and expert data-parallel groups).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError

NAMES = ("tp", "cp", "ep", "dp", "pp")


def full_order(order: str, sizes: dict[str, int]) -> list[str]:
    """The order with missing size-1 parallelisms appended (Megatron-LM ``RankGenerator``).

    Raises
    ------
    PlanError : a parallelism of size > 1 is missing from ``order`` or one is named twice.
    """
    names = order.lower().split("-")
    if len(set(names)) != len(names):
        raise PlanError(f"plan $.parallelism.order: {order!r} names a parallelism twice")
    for n in NAMES:
        if n not in names:
            if sizes.get(n, 1) != 1:
                raise PlanError(f"plan $.parallelism.order: {order!r} lacks {n} but {n} = {sizes[n]}")
            names.append(n)
    return names


def rank_groups(sizes: dict[str, int], order: str, token: str) -> np.ndarray:
    """Rank groups of ``token`` (e.g. ``"tp"`` or ``"dp-cp"``) as an int64 array ``(groups, size)``.

    Row ``g`` is Megatron-LM's ``get_ranks(token)[g]``, in the same order.
    """
    names = full_order(order, sizes)
    shape = [sizes.get(n, 1) for n in names]
    world = int(np.prod(shape))
    grid = np.arange(world, dtype=np.int64).reshape(shape, order="F")   # grid[i0, i1, ...] = rank
    wanted = token.split("-")
    masked = [i for i, n in enumerate(names) if n in wanted]
    unmasked = [i for i, n in enumerate(names) if n not in wanted]
    size = int(np.prod([shape[i] for i in masked])) if masked else 1
    # C-order reshape makes the last axis fastest: put the first named axis last in each part.
    return grid.transpose(unmasked[::-1] + masked[::-1]).reshape(world // size, size)


def rank_coords(sizes: dict[str, int], order: str) -> dict[str, np.ndarray]:
    """Index of every rank along each parallelism, ``name -> int64 (world,)``."""
    names = full_order(order, sizes)
    shape = [sizes.get(n, 1) for n in names]
    world = int(np.prod(shape))
    ranks = np.arange(world, dtype=np.int64)
    out, stride = {}, 1
    for n, s in zip(names, shape):
        out[n] = (ranks // stride) % s
        stride *= s
    return out


@dataclass(frozen=True)
class Groups:
    """All communicators of a plan.

    Each attribute is ``(groups, size)`` int64 ranks; ``ids`` maps a communicator family to the
    first communicator id of that family (ids are consecutive within a family, families in the
    order tp, cp, dp, pp, embedding, ep, edp). ``stage`` gives each rank's pipeline stage.
    """

    tp: np.ndarray
    cp: np.ndarray
    dp: np.ndarray          # Megatron "dp-cp": dense gradient reduction
    pp: np.ndarray
    embedding: np.ndarray   # first and last rank of each pp group (tied embeddings)
    ep: np.ndarray          # expert generator "ep"
    edp: np.ndarray         # expert generator "dp": expert gradient reduction
    stage: np.ndarray
    ids: dict[str, int]

    def family(self, name: str) -> np.ndarray:
        return getattr(self, name)

    def group_ids(self, name: str) -> np.ndarray:
        return self.ids[name] + np.arange(len(self.family(name)), dtype=np.int64)


def build_groups(tp: int, cp: int, dp: int, pp: int, ep: int, order: str) -> Groups:
    """Every communicator of a ``tp x cp x dp x pp`` world (EP carved out of dp x cp).

    Raises
    ------
    PlanError : ``ep`` does not divide ``dp * cp`` or ``order`` is malformed.
    """
    if (dp * cp) % ep:
        raise PlanError(f"plan: ep = {ep} does not divide dp*cp = {dp * cp}")
    dec = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    exp = {"tp": tp, "cp": 1, "ep": ep, "dp": dp * cp // ep, "pp": pp}
    fams = {
        "tp": rank_groups(dec, order, "tp"),
        "cp": rank_groups(dec, order, "cp"),
        "dp": rank_groups(dec, order, "dp-cp"),
        "pp": rank_groups(dec, order, "pp"),
    }
    ppg = fams["pp"]
    fams["embedding"] = ppg[:, [0, -1]] if pp > 1 else ppg[:, :1]
    fams["ep"] = rank_groups(exp, order, "ep")
    fams["edp"] = rank_groups(exp, order, "dp")
    ids, nxt = {}, 0
    for k, v in fams.items():
        ids[k] = nxt
        nxt += len(v)
    stage = rank_coords(dec, order)["pp"]
    return Groups(stage=stage, ids=ids, **fams)
