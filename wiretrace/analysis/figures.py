"""Figures of a summary (matplotlib, Agg backend): PNG and SVG of each.

* ``throughput`` — bits on the wire over time per NIC (sent), Wireshark I/O-graph style, with
  the forward / backward / optimizer phases shaded when the input knows them (Parquet); NICs
  with identical series are drawn once and named together in the legend;
* ``matrix`` — node x node traffic matrix heatmap (bytes sent from row to column);
* ``sizes`` — CDFs of flow sizes and message sizes;
* ``bursts`` — burst raster: one row per NIC and direction, a bar per burst (on period).

Each function takes the :class:`~wiretrace.analysis.summary.Summary` (and the input's phase spans)
and returns a matplotlib Figure; :func:`write_all` saves them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .summary import Summary  # noqa: E402

PHASE_COLORS = {"init": "#dddddd", "forward": "#cfe8ff", "backward": "#ffe0c2", "optimizer": "#d9f2d0"}
MAX_SERIES = 16
FIGURES = ("throughput", "matrix", "sizes", "bursts")
CAPTIONS = {
    "throughput": "Bits on the wire over time per NIC (sent), phases shaded when known",
    "matrix": "Node x node traffic matrix (bytes sent from row to column)",
    "sizes": "Flow-size and message-size CDFs",
    "bursts": "Burst raster: on periods per NIC and direction",
}


def _time_unit(span_ns: float) -> tuple[str, float]:
    for unit, div in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if span_ns >= 5 * div:
            return unit, div
    return "ns", 1.0


def _rate_unit(peak_bps: float) -> tuple[str, float]:
    for unit, div in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if peak_bps >= div:
            return unit, div
    return "b/s", 1.0


def _top_keys(s: Summary, direction: int) -> list[int]:
    """Keys (2*endpoint + direction) of the busiest NICs, at most MAX_SERIES."""
    col = "tx_bytes" if direction == 0 else "rx_bytes"
    b = s.ep[col]
    order = [int(e) for e in np.argsort(-b, kind="stable") if b[e] > 0][:MAX_SERIES]
    return sorted(2 * e + direction for e in order)


def _series_label(s: Summary, keys: list[int]) -> str:
    """Legend entry of NICs whose series are identical: one name, or the group and its size."""
    names = [s.endpoints.label[k // 2] for k in keys]
    if len(names) == 1:
        return names[0]
    if len(names) <= 3:
        return f"{', '.join(names)} (identical)"
    return f"{names[0]} … {names[-1]} ({len(names)} NICs, identical)"


def throughput_series(s: Summary, used: int) -> list[tuple[str, np.ndarray]]:
    """(label, bytes per bin) of the NICs' sent traffic: NICs whose binned series are identical
    (the ranks of a ring send the same steps at the same times) become one series labelled with
    the group, so that no line hides another; the busiest :data:`MAX_SERIES` series, in NIC
    order."""
    tl = s.timeline
    groups: dict[bytes, list[int]] = {}
    sent = s.ep["tx_bytes"]
    keys = sorted((2 * e for e in range(len(sent)) if sent[e] > 0 and 2 * e < tl.bins.shape[0]),
                  key=lambda k: s._ep_sort(k // 2))
    for k in keys:
        groups.setdefault(tl.bins[k, :used].tobytes(), []).append(k)
    busiest = sorted(groups.values(), key=lambda g: -float(tl.bins[g[0], :used].sum()))[:MAX_SERIES]
    busiest.sort(key=lambda g: s._ep_sort(g[0] // 2))
    return [(_series_label(s, g), tl.bins[g[0], :used]) for g in busiest]


def throughput(s: Summary, phase_spans=None) -> plt.Figure:
    """Bits per second sent by each NIC in the timeline's bins (at most 16 distinct series, the
    busiest). The x axis spans the packets, first to last; phase spans are clipped to it (tables
    of a ``generate --window`` run know phases beyond the window's packets)."""
    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    tl = s.timeline
    nb = tl.bins.shape[1]
    span = (s.last_ns - s.first_ns) if s.last_ns is not None else 0
    unit, div = _time_unit(max(span, 1))
    used = int(min(nb, (span // tl.width) + 1)) if tl.origin is not None else 0
    x = (np.arange(used) * tl.width) / div
    series = throughput_series(s, used) if used else []
    peak = max((b.max() for _, b in series), default=0)
    runit, rdiv = _rate_unit(peak * 8e9 / tl.width if peak else 1)
    for label, b in series:
        ax.step(x, b * 8e9 / tl.width / rdiv, where="post", lw=0.9, label=label)
    if not series:
        ax.text(0.5, 0.5, "no packets", ha="center", va="center", transform=ax.transAxes)
    if phase_spans and tl.origin is not None:
        seen = set()
        lo, hi = s.first_ns, s.last_ns
        for name, a, b in phase_spans:
            a, b = max(a, lo), min(b, hi)
            if a >= b:
                continue
            ax.axvspan((a - tl.origin) / div, (b - tl.origin) / div, color=PHASE_COLORS.get(name, "#eeeeee"),
                       alpha=0.6, lw=0, zorder=0, label=None if name in seen else f"phase: {name}")
            seen.add(name)
    if s.line_rate_bps:
        ax.axhline(s.line_rate_bps / rdiv, color="k", ls="--", lw=0.8, label="line rate")
    if tl.origin is not None:
        ax.set_xlim(0, max(span, 1) / div)
    ax.set_xlabel(f"time from first packet ({unit})")
    ax.set_ylabel(f"throughput ({runit}), bins of {tl.width:,} ns")
    ax.set_title("Bits on the wire per NIC (sent)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.15), frameon=False)
    fig.tight_layout()
    return fig


def matrix(s: Summary) -> plt.Figure:
    """Heatmap of the node x node matrix (log colour scale of bytes)."""
    m = s.matrix()
    names, data = m["nodes"], np.asarray(m["bytes"], dtype=np.float64)
    n = len(names)
    size = min(12, 3 + 0.5 * n)
    fig, ax = plt.subplots(figsize=(size + 1.5, size), dpi=100)
    if n == 0:                                  # no frame between two endpoints
        ax.text(0.5, 0.5, "no network traffic", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        ax.set_title(f"Traffic matrix by {m['by']}")
        fig.tight_layout()
        return fig
    shown = np.where(data > 0, data, np.nan)
    from matplotlib.colors import LogNorm, Normalize

    vmax = np.nanmax(shown) if np.isfinite(shown).any() else 1
    vmin = np.nanmin(shown) if np.isfinite(shown).any() else 0.1
    # a log scale when pairs differ by orders of magnitude, else linear from 0
    norm = LogNorm(vmin=vmin, vmax=vmax) if vmax > 10 * vmin else Normalize(vmin=0, vmax=vmax)
    im = ax.imshow(shown, cmap="viridis", norm=norm)
    fig.colorbar(im, ax=ax, label="bytes")
    ticks = range(n) if n <= 32 else np.linspace(0, n - 1, 16).astype(int)
    ax.set_xticks(ticks, [names[i] for i in ticks], rotation=90 if n > 8 else 0, fontsize=8)
    ax.set_yticks(ticks, [names[i] for i in ticks], fontsize=8)
    ax.set_xlabel("receiver")
    ax.set_ylabel("sender")
    ax.set_title(f"Traffic matrix by {m['by']}")
    if n <= 12:
        for i in range(n):
            for j in range(n):
                if data[i, j] > 0:
                    light = norm(data[i, j]) > 0.6            # dark text on the bright end of viridis
                    ax.text(j, i, _short_bytes(data[i, j]), ha="center", va="center",
                            color="k" if light else "w", fontsize=7)
    fig.tight_layout()
    return fig


def _short_bytes(v: float) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if v >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.0f}"


def sizes(s: Summary) -> plt.Figure:
    """CDFs of flow sizes (bytes per flow) and message sizes (bytes per message)."""
    from .stats import Distribution

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    flows = Distribution()
    flows.add(s.flows.bytes[: s.flows.n])
    for ax, dist, title in ((axes[0], flows, "Flow sizes (frame bytes per flow)"),
                            (axes[1], s.message_sizes, f"Message sizes ({s.message_source or 'none'})")):
        v, c = dist.cdf()
        if len(v):
            ax.step(np.concatenate([[v[0]], v]), np.concatenate([[0], c]), where="post")
            if v.min() > 0:
                ax.set_xscale("log")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("bytes")
        ax.set_ylabel("fraction <= size")
        ax.set_title(f"{title}, n = {dist.count:,}")
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def bursts(s: Summary) -> plt.Figure:
    """Burst raster: each row a NIC and direction, each bar one burst (kept earliest first)."""
    r = s.burst.raster_array()
    keys = sorted(set(_top_keys(s, 0)) | set(_top_keys(s, 1)))
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.3 * max(len(keys), 1)), dpi=100)
    origin = s.first_ns or 0
    span = (s.last_ns - origin) if s.last_ns is not None else 1
    unit, div = _time_unit(max(span, 1))
    for row, k in enumerate(keys):
        sel = r[r[:, 0] == k] if len(r) else r
        if len(sel):
            bars = [((a - origin) / div, max((b - a) / div, span / div / 2000)) for a, b in sel[:, 1:]]
            ax.broken_barh(bars, (row - 0.4, 0.8), color="C0" if k % 2 == 0 else "C1")
    ax.set_yticks(range(len(keys)), [f"{s.endpoints.label[k // 2]} {('tx', 'rx')[k % 2]}" for k in keys], fontsize=7)
    ax.set_ylim(-0.6, max(len(keys), 1) - 0.4)
    ax.set_xlim(0, span / div if span else 1)
    ax.set_xlabel(f"time from first packet ({unit})")
    if not keys:
        ax.text(0.5, 0.5, "no packets", ha="center", va="center", transform=ax.transAxes)
    kept = len(r)
    note = f", earliest {kept:,} bursts" if kept >= s.burst.raster_cap else ""
    ax.set_title(f"Burst raster (idle gap > {s.burst.idle_gap_ns:,} ns ends a burst{note})")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def write_all(s: Summary, out_dir: Path, phase_spans=None, force: bool = False) -> list[tuple[str, Path, Path]]:
    """Write every figure as ``<name>.png`` and ``<name>.svg`` into ``out_dir``.

    Every figure is drawn into a temporary file first and all are renamed at the end, so a
    failure leaves no figure (and no directory it made).

    Returns
    -------
    list of (caption, png path, svg path) in :data:`FIGURES` order.

    Raises
    ------
    wiretrace.errors.WiretraceError : a target file exists and ``force`` is False.
    """
    from ..errors import WiretraceError

    out_dir = Path(out_dir)
    targets = [out_dir / f"{n}.{ext}" for n in FIGURES for ext in ("png", "svg")]
    existing = [t for t in targets if t.exists()]
    if existing and not force:
        raise WiretraceError(f"{existing[0]} exists; pass --force to overwrite it")
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists()]      # innermost first
    out_dir.mkdir(parents=True, exist_ok=True)
    makers = {"throughput": lambda: throughput(s, phase_spans), "matrix": lambda: matrix(s),
              "sizes": lambda: sizes(s), "bursts": lambda: bursts(s)}
    # every figure into a temporary file first; renamed only when all were drawn
    staged: list[tuple[Path, Path]] = []
    try:
        for name in FIGURES:
            fig = makers[name]()
            try:
                for ext in ("png", "svg"):
                    tmp = out_dir / f".{name}.{ext}.tmp"
                    staged.append((tmp, out_dir / f"{name}.{ext}"))
                    fig.savefig(tmp, format=ext)
            finally:
                plt.close(fig)
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            for d in made:
                d.rmdir()
        raise
    for tmp, final in staged:
        os.replace(tmp, final)
    return [(CAPTIONS[name], out_dir / f"{name}.png", out_dir / f"{name}.svg") for name in FIGURES]
