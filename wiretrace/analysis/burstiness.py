"""Burstiness of traffic per NIC and direction, accumulated over chunks with bounded memory.

Two views of the same packet stream, both computed per *key* (the summary uses
``key = 2 * endpoint + direction``, direction 0 = sent by the NIC, 1 = received):

**Counts in fixed windows** (Leland et al., "On the self-similar nature of Ethernet traffic",
SIGCOMM 1993; Gusella, "Characterizing the variability of arrival processes with indexes of
dispersion", IEEE JSAC 9(2), 1991). Time from ``origin_ns`` is cut into windows of width ``T``
for each timescale (1 µs ... 10 ms by default). With ``B_i`` the frame bytes and ``N_i`` the
packets in window ``i`` of ``n`` windows covering the observation span (empty windows included):

* peak-to-mean ratio ``max(B) / mean(B)``;
* coefficient of variation ``std(B) / mean(B)`` (population standard deviation);
* index of dispersion for counts ``var(N) / mean(N)`` (1 for a Poisson process);
* peak utilization ``max(W) * 8 / (T * line_rate)`` with ``W`` the bytes on the wire including the
  Ethernet preamble, SFD, FCS and minimum inter-frame gap (24 bytes per frame, IEEE 802.3). A
  frame counts whole in the window it starts in, so a window of back-to-back frames at the line
  rate can read up to one frame's time above 100 % (12 frames of 4 KiB at 400 Gb/s start within
  1 us: 100.8 %); received directions can exceed 100 % for real when senders overlap (incast).

Only running sums (``sum B``, ``sum B^2``, ``max B``...) and one open window per key and timescale
are kept, so memory does not grow with the capture. Packets that arrive in a later chunk but
before a key's open window (out-of-order capture files) are counted in that open window and
reported as ``reordered_packets``.

**On/off periods** (packet trains, Jain & Routhier, IEEE JSAC 4(6), 1986). A burst (on period)
is a maximal run of packets of one key in which each packet starts at most ``idle_gap_ns`` after
the previous one ended; a packet ends ``wire_bytes * 8 / line_rate`` after it starts (0 when no
line rate is known, so that the gap is then measured start to start). Off periods are the idle
times between consecutive bursts. Burst bytes, burst packets, on and off durations go into
streaming :class:`~wiretrace.analysis.stats.Distribution` objects (exact up to 512 distinct
values per key, then within 2.2 %).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import WiretraceError
from .stats import Distribution

DEFAULT_TIMESCALES_NS = (1_000, 10_000, 100_000, 1_000_000, 10_000_000)
"""Window widths: 1 µs, 10 µs, 100 µs, 1 ms, 10 ms."""

DEFAULT_IDLE_GAP_NS = 1_000
"""Idle gap that ends a burst: 1 µs, about 12 back-to-back 4 KiB-MTU frames at 400 Gb/s."""

ETHERNET_L1_OVERHEAD_BYTES = 24
"""Per-frame bytes on an Ethernet wire beyond the captured frame: preamble and SFD (8), FCS (4)
and the minimum inter-packet gap (12); IEEE 802.3 clauses 3.1.1 and 4.4.2."""


def parse_timescales(text: str, where: str = "--timescales") -> tuple[int, ...]:
    """Comma-separated durations (``"1us,10us,1ms"``) -> window widths in ns, in the order given.

    Raises
    ------
    WiretraceError : an entry that is not a duration, a width under 1 ns (``0us``, ``0.1ns``), a
        width given twice, or no width at all.
    """
    from ..plan import parse_duration_ns

    parts = [t.strip() for t in str(text).split(",")]
    if not any(parts):
        raise WiretraceError(f"{where}: expected window widths like 1us,10us,1ms, got {text!r}")
    out = []
    for t in parts:
        if not t:
            continue
        ns = parse_duration_ns(t, where)
        if ns < 1:
            raise WiretraceError(f"{where} {t}: a window width must be at least 1 ns")
        if ns in out:
            raise WiretraceError(f"{where}: {t} is given twice")
        out.append(ns)
    return tuple(out)


def _group_starts(*cols: np.ndarray) -> np.ndarray:
    """Indices where any of the (sorted) columns changes value; always includes 0."""
    n = len(cols[0])
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for c in cols:
        change[1:] |= c[1:] != c[:-1]
    return np.flatnonzero(change)


class _Grow:
    """Per-key arrays that grow when a larger key appears."""

    def __init__(self, spec: dict[str, tuple[np.dtype, float]]):
        self._spec = spec
        self.size = 0
        for name, (dt, fill) in spec.items():
            setattr(self, name, np.full(0, fill, dtype=dt))

    def ensure(self, n: int) -> None:
        if n <= self.size:
            return
        new = max(n, 2 * self.size, 16)
        for name, (dt, fill) in self._spec.items():
            old = getattr(self, name)
            arr = np.full(new, fill, dtype=dt)
            arr[: len(old)] = old
            setattr(self, name, arr)
        self.size = new


_WINDOW_SPEC = {
    "open_bin": (np.int64, -1), "open_b": (np.float64, 0), "open_w": (np.float64, 0),
    "open_p": (np.int64, 0), "sum_b": (np.float64, 0), "sumsq_b": (np.float64, 0),
    "sum_p": (np.float64, 0), "sumsq_p": (np.float64, 0), "max_b": (np.float64, 0),
    "max_w": (np.float64, 0), "max_p": (np.int64, 0), "busy": (np.int64, 0),
}

_BURST_SPEC = {
    "last_end": (np.float64, np.nan), "seen": (bool, False), "reordered": (np.int64, 0),
    "open": (bool, False), "b_start": (np.float64, 0), "b_end": (np.float64, 0),
    "b_bytes": (np.float64, 0), "b_pkts": (np.int64, 0), "prev_burst_end": (np.float64, np.nan),
    "packets": (np.int64, 0), "bytes": (np.float64, 0), "wire": (np.float64, 0),
    "first_ts": (np.int64, np.iinfo(np.int64).max), "last_ts": (np.int64, np.iinfo(np.int64).min),
}


class Burstiness:
    """Streaming burstiness of many keys (NIC x direction) at several timescales.

    Parameters
    ----------
    timescales_ns : window widths in ns (default 1 µs ... 10 ms in decades).
    idle_gap_ns : idle time (ns) that ends a burst (default :data:`DEFAULT_IDLE_GAP_NS`).
    line_rate_bps : line rate in bits/s, for packet durations and utilization; None if unknown.
    origin_ns : start of the observation window; default the first timestamp seen.
    raster_cap : number of bursts kept (earliest first) for the burst raster figure.

    Call :meth:`add` with chunks in (roughly) increasing time, then :meth:`finish`.
    """

    def __init__(self, timescales_ns=DEFAULT_TIMESCALES_NS, idle_gap_ns: int = DEFAULT_IDLE_GAP_NS,
                 line_rate_bps: float | None = None, origin_ns: int | None = None,
                 raster_cap: int = 200_000):
        self.timescales_ns = tuple(int(t) for t in timescales_ns)
        if not self.timescales_ns or min(self.timescales_ns) <= 0:
            raise WiretraceError(f"timescales: expected window widths of at least 1 ns, got "
                                 f"{list(self.timescales_ns)} ns")
        if int(idle_gap_ns) < 0:
            raise WiretraceError(f"idle gap: expected a duration of at least 0 ns, got {int(idle_gap_ns)} ns")
        self.idle_gap_ns = int(idle_gap_ns)
        self.line_rate_bps = float(line_rate_bps) if line_rate_bps else None
        self.origin_ns = origin_ns
        self.t_last = None
        self.windows = [_Grow(_WINDOW_SPEC) for _ in self.timescales_ns]
        self.k = _Grow(_BURST_SPEC)
        self.burst_bytes: dict[int, Distribution] = {}
        self.burst_packets: dict[int, Distribution] = {}
        self.on_ns: dict[int, Distribution] = {}
        self.off_ns: dict[int, Distribution] = {}
        self.raster_cap = raster_cap
        self.raster: list[np.ndarray] = []        # (n, 3) arrays of key, start, end
        self._raster_n = 0
        self._finished = False

    # -- input -------------------------------------------------------------------------------

    def add(self, ts_ns, key, nbytes, wire_bytes=None) -> None:
        """Add packets.

        Parameters
        ----------
        ts_ns : (n,) int64 start of each frame, ns.
        key : (n,) int, >= 0: which series the packet belongs to.
        nbytes : (n,) frame bytes (as captured, original length).
        wire_bytes : (n,) bytes occupying the wire (frame + L1 overhead); default ``nbytes``.
        """
        ts = np.asarray(ts_ns, dtype=np.int64)
        if len(ts) == 0:
            return
        key = np.asarray(key, dtype=np.int64)
        b = np.asarray(nbytes, dtype=np.float64)
        w = b if wire_bytes is None else np.asarray(wire_bytes, dtype=np.float64)
        order = np.lexsort((ts, key))
        ts, key, b, w = ts[order], key[order], b[order], w[order]
        if self.origin_ns is None:
            self.origin_ns = int(ts.min())
        tmax = int(ts.max())
        self.t_last = tmax if self.t_last is None else max(self.t_last, tmax)
        nkeys = int(key.max()) + 1
        self.k.ensure(nkeys)
        for win in self.windows:
            win.ensure(nkeys)
        rel = ts - self.origin_ns
        for T, win in zip(self.timescales_ns, self.windows):
            self._add_windows(win, T, rel, key, b, w)
        self._add_bursts(ts, key, b, w)

    def _add_windows(self, win: _Grow, T: int, rel, key, b, w) -> None:
        bins = np.maximum(rel // T, 0)
        ob = win.open_bin[key]
        bins = np.where(ob >= 0, np.maximum(bins, ob), bins)   # late packets go to the open window
        starts = _group_starts(key, bins)
        gk, gb = key[starts], bins[starts]
        gbytes = np.add.reduceat(b, starts)
        gwire = np.add.reduceat(w, starts)
        gp = np.diff(np.append(starts, len(key))).astype(np.int64)
        first = np.ones(len(gk), dtype=bool)
        first[1:] = gk[1:] != gk[:-1]
        last = np.ones(len(gk), dtype=bool)
        last[:-1] = gk[1:] != gk[:-1]
        ob = win.open_bin[gk]
        merge = first & (ob >= 0) & (gb == ob)
        gbytes[merge] += win.open_b[gk[merge]]
        gwire[merge] += win.open_w[gk[merge]]
        gp[merge] += win.open_p[gk[merge]]
        flush = first & (ob >= 0) & (gb != ob)       # the open window of that key is complete
        fk = gk[flush]
        self._close(win, fk, win.open_b[fk], win.open_w[fk], win.open_p[fk])
        done = ~last
        self._close(win, gk[done], gbytes[done], gwire[done], gp[done])
        lk = gk[last]
        win.open_bin[lk] = gb[last]
        win.open_b[lk] = gbytes[last]
        win.open_w[lk] = gwire[last]
        win.open_p[lk] = gp[last]

    @staticmethod
    def _close(win: _Grow, k, b, w, p) -> None:
        if len(k) == 0:
            return
        np.add.at(win.sum_b, k, b)
        np.add.at(win.sumsq_b, k, b * b)
        pf = p.astype(np.float64)
        np.add.at(win.sum_p, k, pf)
        np.add.at(win.sumsq_p, k, pf * pf)
        np.maximum.at(win.max_b, k, b)
        np.maximum.at(win.max_w, k, w)
        np.maximum.at(win.max_p, k, p)
        np.add.at(win.busy, k, 1)

    def _tx_ns(self, w: np.ndarray) -> np.ndarray:
        if not self.line_rate_bps:
            return np.zeros_like(w)
        return w * 8e9 / self.line_rate_bps

    def _add_bursts(self, ts, key, b, w) -> None:
        s = self.k
        tsf = ts.astype(np.float64)
        end = tsf + self._tx_ns(w)
        n = len(ts)
        keyfirst = np.ones(n, dtype=bool)
        keyfirst[1:] = key[1:] != key[:-1]
        prev_end = np.empty(n)
        prev_end[1:] = end[:-1]
        prev_end[keyfirst] = s.last_end[key[keyfirst]]
        # a packet starting before the previous one of its key ended (a later chunk going back in
        # time) is counted as reordered and continues the burst
        seen_before = keyfirst & s.seen[key]
        s.reordered += np.bincount(key[seen_before & (ts < s.last_ts[key])], minlength=s.size)[: s.size]
        new = np.isnan(prev_end) | (tsf - prev_end > self.idle_gap_ns)
        seg = np.flatnonzero(keyfirst | new)
        sk = key[seg]
        sstart = tsf[seg]
        send = np.maximum.reduceat(end, seg)
        sbytes = np.add.reduceat(b, seg)
        spk = np.diff(np.append(seg, n)).astype(np.int64)
        sfirst = keyfirst[seg]
        slast = np.ones(len(seg), dtype=bool)
        slast[:-1] = sk[1:] != sk[:-1]
        cont = sfirst & ~new[seg] & s.open[sk]
        ck = sk[cont]
        sstart[cont] = s.b_start[ck]
        send[cont] = np.maximum(send[cont], s.b_end[ck])
        sbytes[cont] += s.b_bytes[ck]
        spk[cont] += s.b_pkts[ck]
        # open bursts of keys whose first packet here starts a new burst are complete
        flush = sfirst & ~cont & s.open[sk]
        fk = sk[flush]
        done = ~slast
        fin_k = np.concatenate([fk, sk[done]])
        fin_s = np.concatenate([s.b_start[fk], sstart[done]])
        fin_e = np.concatenate([s.b_end[fk], send[done]])
        fin_b = np.concatenate([s.b_bytes[fk], sbytes[done]])
        fin_p = np.concatenate([s.b_pkts[fk], spk[done]])
        self._finalize(fin_k, fin_s, fin_e, fin_b, fin_p)
        lk = sk[slast]
        s.open[lk] = True
        s.b_start[lk] = sstart[slast]
        s.b_end[lk] = send[slast]
        s.b_bytes[lk] = sbytes[slast]
        s.b_pkts[lk] = spk[slast]
        # per-key carry and totals
        lastpos = np.append(np.flatnonzero(keyfirst)[1:], n) - 1
        kk = key[lastpos]
        s.last_end[kk] = np.fmax(s.last_end[kk], end[lastpos])
        s.last_ts[kk] = np.maximum(s.last_ts[kk], ts[lastpos])
        firstpos = np.flatnonzero(keyfirst)
        s.first_ts[key[firstpos]] = np.minimum(s.first_ts[key[firstpos]], ts[firstpos])
        s.seen[kk] = True
        np.add.at(s.packets, key, 1)
        np.add.at(s.bytes, key, b)
        np.add.at(s.wire, key, w)

    def _finalize(self, k, start, end, nbytes, pkts) -> None:
        if len(k) == 0:
            return
        order = np.lexsort((start, k))
        k, start, end, nbytes, pkts = k[order], start[order], end[order], nbytes[order], pkts[order]
        s = self.k
        kfirst = np.ones(len(k), dtype=bool)
        kfirst[1:] = k[1:] != k[:-1]
        prev = np.empty(len(k))
        prev[1:] = end[:-1]
        prev[kfirst] = s.prev_burst_end[k[kfirst]]
        off = start - prev
        for kk in np.unique(k):
            m = k == kk
            kk = int(kk)
            self._dist(self.burst_bytes, kk).add(nbytes[m])
            self._dist(self.burst_packets, kk, classes=None).add(pkts[m])
            self._dist(self.on_ns, kk, classes=None).add(end[m] - start[m])
            o = off[m]
            o = o[~np.isnan(o)]
            self._dist(self.off_ns, kk, classes=None).add(np.maximum(o, 0))
        klast = np.ones(len(k), dtype=bool)
        klast[:-1] = k[1:] != k[:-1]
        s.prev_burst_end[k[klast]] = end[klast]
        if self._raster_n < self.raster_cap:
            take = min(len(k), self.raster_cap - self._raster_n)
            self.raster.append(np.stack([k[:take], start[:take], end[:take]], axis=1))
            self._raster_n += take

    @staticmethod
    def _dist(d: dict, k: int, classes="sizes") -> Distribution:
        # one distribution per key and quantity: exact up to 512 distinct values, then log bins
        # of ratio 2**(1/16) (percentiles within 2.2 %), so that thousands of NICs stay small
        if k not in d:
            d[k] = Distribution(max_distinct=512, log_ratio=2 ** (1 / 16),
                                **({} if classes else {"classes": None}))
        return d[k]

    # -- results -----------------------------------------------------------------------------

    def finish(self) -> None:
        """Close the open windows and bursts (call once, after the last :meth:`add`)."""
        if self._finished:
            return
        self._finished = True
        for win in self.windows:
            k = np.flatnonzero(win.open_bin >= 0)
            self._close(win, k, win.open_b[k], win.open_w[k], win.open_p[k])
            win.open_bin[k] = -1
        s = self.k
        k = np.flatnonzero(s.open)
        self._finalize(k, s.b_start[k], s.b_end[k], s.b_bytes[k], s.b_pkts[k])
        s.open[k] = False

    def keys(self) -> np.ndarray:
        """Keys that carried at least one packet."""
        return np.flatnonzero(self.k.packets[: self.k.size] > 0)

    def windows_count(self, T: int, end_ns: int | None = None) -> int:
        """Number of windows of width ``T`` covering ``[origin, end_ns)`` (default: through the
        last packet's window)."""
        if self.origin_ns is None:
            return 0
        if end_ns is None:
            return (self.t_last - self.origin_ns) // T + 1
        return max(1, math.ceil((end_ns - self.origin_ns) / T))

    def window_stats(self, key: int, end_ns: int | None = None) -> list[dict]:
        """Rows for one key, one per timescale (see the module docstring for the definitions).

        Peak-to-mean, CoV and index of dispersion are None when the span holds fewer than two
        windows of the timescale (a timescale longer than the capture)."""
        self.finish()
        rows = []
        for T, win in zip(self.timescales_ns, self.windows):
            n = self.windows_count(T, end_ns)
            sb, sq = win.sum_b[key], win.sumsq_b[key]
            mean_b = sb / n
            var_b = max(sq / n - mean_b * mean_b, 0.0)
            mean_p = win.sum_p[key] / n
            var_p = max(win.sumsq_p[key] / n - mean_p * mean_p, 0.0)
            varies = n >= 2        # one window has nothing to vary against: no ratio, not 0
            rows.append({
                "timescale_ns": T,
                "windows": int(n),
                "busy_windows": int(win.busy[key]),
                "mean_bytes": mean_b,
                "peak_bytes": float(win.max_b[key]),
                "peak_to_mean": (win.max_b[key] / mean_b) if mean_b > 0 and varies else None,
                "cov": (math.sqrt(var_b) / mean_b) if mean_b > 0 and varies else None,
                "index_of_dispersion": (var_p / mean_p) if mean_p > 0 and varies else None,
                "peak_packets": int(win.max_p[key]),
                "peak_bps": win.max_b[key] * 8e9 / T,
                "peak_utilization": (win.max_w[key] * 8e9 / T / self.line_rate_bps)
                if self.line_rate_bps else None,
            })
        return rows

    def onoff(self, key: int) -> dict:
        """On/off summary of one key: bursts, on/off durations (ns) and burst sizes."""
        self.finish()
        empty = Distribution(classes=None)
        return {
            "idle_gap_ns": self.idle_gap_ns,
            "bursts": self.on_ns.get(key, empty).count,
            "burst_bytes": self.burst_bytes.get(key, Distribution()).to_dict(),
            "burst_packets": self.burst_packets.get(key, empty).to_dict(),
            "on_ns": self.on_ns.get(key, empty).to_dict(),
            "off_ns": self.off_ns.get(key, empty).to_dict(),
            "reordered_packets": int(self.k.reordered[key]),
        }

    def raster_array(self) -> np.ndarray:
        """``(n, 3)`` float array of (key, start_ns, end_ns) of the earliest bursts kept."""
        self.finish()
        if not self.raster:
            return np.zeros((0, 3))
        return np.concatenate(self.raster)
