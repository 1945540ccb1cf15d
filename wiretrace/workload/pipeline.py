"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) and their timeline.

Each pipeline rank runs a fixed sequence of forward (``F``) and backward (``B``) passes of
(micro-batch, model chunk). The orders follow Megatron-LM ``megatron/core/pipeline_parallel/
schedules.py``:

* ``gpipe``: all forwards, then all backwards (Huang et al. 2019).
* ``1f1b``: ``forward_backward_pipelining_without_interleaving`` — rank ``s`` of ``p`` runs
  ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one backward, then drains
  the remaining backwards (PipeDream-Flush, Narayanan et al. 2021).
* ``interleaved``: ``forward_backward_pipelining_with_interleaving`` with ``v`` model chunks per
  rank: ``(p - s - 1) * 2 + (v - 1) * p`` warm-up forwards; the k-th forward runs chunk
  ``(k // p) % v`` of micro-batch ``(k // (p v)) p + k % p``, the k-th backward chunk
  ``v - 1 - (k // p) % v`` of the same micro-batch formula.

:func:`simulate` places every pass in time: a pass starts when its rank is free and its input has
arrived (the previous virtual stage's forward, the next virtual stage's backward, plus the
point-to-point transfer time).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError

Pass = tuple[str, int, int]   # ("F" | "B", micro-batch, chunk)


def stage_order(schedule: str, pp: int, stage: int, m: int, v: int = 1) -> list[Pass]:
    """The passes of pipeline rank ``stage`` in execution order.

    Raises
    ------
    PlanError : unknown schedule, or interleaving with ``m`` not a multiple of ``pp``.
    """
    if schedule == "gpipe":
        return [("F", i, c) for c in range(v) for i in range(m)] + \
               [("B", i, c) for c in reversed(range(v)) for i in range(m)]
    if schedule == "1f1b" and v == 1:
        warm = min(pp - stage - 1, m)
        out: list[Pass] = [("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            out += [("F", warm + i, 0), ("B", i, 0)]
        out += [("B", i, 0) for i in range(m - warm, m)]
        return out
    if schedule in ("interleaved", "1f1b"):
        if m % pp:
            raise PlanError(f"plan: interleaved schedule needs micro-batches ({m}) divisible by pp = {pp}")
        total = m * v

        def fwd(k: int) -> Pass:
            return ("F", (k // (pp * v)) * pp + k % pp, (k // pp) % v)

        def bwd(k: int) -> Pass:
            return ("B", (k // (pp * v)) * pp + k % pp, v - 1 - (k // pp) % v)

        warm = min((pp - stage - 1) * 2 + (v - 1) * pp, total)
        out = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            out += [fwd(warm + i), bwd(i)]
        out += [bwd(k) for k in range(total - warm, total)]
        return out
    raise PlanError(f"plan $.parallelism.pp_schedule: unknown schedule {schedule!r}")


@dataclass(frozen=True)
class Timeline:
    """Start and end (ns from the iteration start) of every pass of every pipeline rank.

    ``start[(stage, kind, mb, chunk)]`` and ``end[...]``; ``order[stage]`` is the pass sequence.
    """

    order: list[list[Pass]]
    start: dict[tuple[int, str, int, int], float]
    end: dict[tuple[int, str, int, int], float]

    @property
    def makespan(self) -> float:
        return max(self.end.values()) if self.end else 0.0


def simulate(order: list[list[Pass]], pp: int, v: int, duration, p2p_ns: float) -> Timeline:
    """Place every pass in time.

    Parameters
    ----------
    order : per pipeline rank, its passes (:func:`stage_order`).
    duration : callable ``(stage, kind, chunk) -> ns`` of one pass.
    p2p_ns : transfer time of one activation (or gradient) between neighbouring stages, ns.
    """
    nvs = pp * v
    start: dict = {}
    end: dict = {}
    free = [0.0] * pp
    pos = [0] * pp
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(order[s]):
                kind, mb, c = order[s][pos[s]]
                vs = c * pp + s
                if kind == "F":
                    dep = None if vs == 0 else (((vs - 1) % pp), "F", mb, (vs - 1) // pp)
                else:
                    dep = (s, "F", mb, c) if vs == nvs - 1 else (((vs + 1) % pp), "B", mb, (vs + 1) // pp)
                if dep is not None and dep not in end:
                    break
                ready = 0.0 if dep is None else end[dep] + (p2p_ns if dep[0] != s else 0.0)
                t0 = max(free[s], ready)
                t1 = t0 + duration(s, kind, c)
                start[(s, kind, mb, c)] = t0
                end[(s, kind, mb, c)] = t1
                free[s] = t1
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocks: pass order and dependencies disagree")
    return Timeline(order=order, start=start, end=end)
