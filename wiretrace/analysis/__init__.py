"""Analysis of wiretrace outputs and real captures: summaries, burstiness, figures, HTML report.

Front functions (the CLI calls these):

* :func:`analyze` — one streaming pass over a capture or a Parquet directory, returning a
  :class:`~wiretrace.analysis.summary.Summary` (the state figures are drawn from);
* :func:`summarize` — the same pass, returned as the JSON-ready ``dict`` of
  :meth:`Summary.result`.

Modules: :mod:`.stats` (streaming distributions), :mod:`.burstiness` (windows and on/off
periods), :mod:`.summary` (flows, NICs, matrix, opcodes), :mod:`.sources` (inputs),
:mod:`.figures` (matplotlib) and :mod:`.report` (text tables and the HTML page).
"""

from __future__ import annotations

from pathlib import Path

from .burstiness import DEFAULT_IDLE_GAP_NS, DEFAULT_TIMESCALES_NS
from .sources import Input, open_input
from .summary import GROUP_KEYS, Summary


def analyze(path: str | Path, plan=None, line_rate_bps: float | None = None,
            timescales_ns=DEFAULT_TIMESCALES_NS, idle_gap_ns: int = DEFAULT_IDLE_GAP_NS,
            window_ns: tuple[int, int] | None = None) -> tuple[Summary, Input]:
    """Read ``path`` once and accumulate its summary.

    Parameters
    ----------
    path : capture (pcap, pcapng, ERF) or wiretrace Parquet directory.
    plan : optional plan (NIC addresses -> NIC indices and nodes; line rate).
    line_rate_bps : line rate in bits/s (overrides the plan's).
    timescales_ns : burstiness window widths, ns.
    idle_gap_ns : idle time that ends a burst, ns.
    window_ns : observation window ``(start, end)`` in the input's time base, ns; default from
        the first to the last packet.

    Returns
    -------
    (Summary, Input)

    Raises
    ------
    wiretrace.errors.WiretraceError : unreadable or unknown input.
    """
    inp = open_input(path, plan=plan, line_rate_bps=line_rate_bps)
    s = Summary(inp.endpoints, line_rate_bps=inp.line_rate_bps, timescales_ns=timescales_ns,
                idle_gap_ns=idle_gap_ns, labels=inp.labels, window_ns=window_ns)
    if inp.message_sizes is not None:
        for sizes in inp.message_sizes():
            s.add_message_sizes(sizes)
    for batch in inp.batches():
        s.add(batch)
    s.burst.finish()
    return s, inp


def summarize(path: str | Path, by: str = "nic", **kwargs) -> dict:
    """Summary of ``path`` as a JSON-ready dict; ``by`` is one of nic, node, parallelism, phase.

    Keyword arguments are those of :func:`analyze`. The dict holds ``input`` (path, kind and
    what was skipped) besides the keys of :meth:`Summary.result`.

    Raises
    ------
    wiretrace.errors.WiretraceError : unreadable input; ``by`` parallelism/phase for a capture
        (only a Parquet directory knows which collective each packet belongs to); ``by`` node for
        a capture without a plan, or with addresses that are not the plan's NICs (only the plan
        says which node a NIC address belongs to).
    """
    from ..errors import WiretraceError

    if by not in GROUP_KEYS:
        raise WiretraceError(f"--by must be one of {', '.join(GROUP_KEYS)}, got {by!r}")
    if by == "node" and kwargs.get("plan") is None and not Path(path).is_dir():
        # a capture names NICs by address; only the plan says which node each one belongs to
        raise WiretraceError(f"--by node needs the plan {path} was generated from (--plan PLAN) to map "
                             "NIC addresses to nodes")
    s, inp = analyze(path, **kwargs)
    if by in ("parallelism", "phase") and by not in inp.labels:
        raise WiretraceError(f"--by {by} needs a wiretrace Parquet directory (generate --parquet DIR); "
                             f"{path} is a capture")
    if by == "node":
        unknown = [label for label, node in zip(s.endpoints.label, s.endpoints.node) if node < 0]
        if unknown:
            raise WiretraceError(f"--by node: {len(unknown)} address(es) of {path} are not NICs of the "
                                 f"plan (first: {unknown[0]}); pass the plan the capture was generated from")
    out = {"input": {"path": str(path), "kind": inp.kind, **inp.info}}
    out.update(s.result(by=by))
    return out


__all__ = ["analyze", "summarize", "open_input", "Summary", "Input"]
