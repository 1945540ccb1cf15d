"""Streaming distributions: counts, percentiles and the bytes share of size classes.

A :class:`Distribution` takes values chunk by chunk (message sizes, flow sizes, burst sizes, on and
off durations) and keeps a value -> count map. While the map holds at most ``max_distinct``
values every number it reports is exact; past that, values are folded into logarithmic bins of
ratio ``2**(1/64)`` (relative error of a percentile below 1.1 %; configurable) and the result
says ``"exact": false``. Memory is bounded by ``max_distinct`` (or the number of log bins between the
smallest and largest value, at most a few thousand) whatever the number of values.

Totals (count, sum, min, max) and the per-class counts and bytes are always exact.
"""

from __future__ import annotations

import numpy as np

SIZE_CLASSES = (
    ("<=256B", 256), ("<=4KiB", 4096), ("<=64KiB", 65536), ("<=1MiB", 1 << 20),
    ("<=16MiB", 16 << 20), ("<=256MiB", 256 << 20), (">256MiB", None),
)
"""Size classes (upper bound inclusive, powers of 16 from 256 B) used for the bytes share."""

PERCENTILES = (50, 90, 99, 99.9)
_LOG_RATIO = 2.0 ** (1.0 / 64.0)


class Distribution:
    """Value distribution accumulated from chunks of non-negative numbers.

    Parameters
    ----------
    max_distinct : number of distinct values kept exactly before folding into log bins.
    log_ratio : ratio of consecutive log bins after folding (default ``2**(1/64)``: percentiles
        within 1.1 %); coarser bins keep fewer values when many distributions are kept.
    classes : size classes for :meth:`class_shares` (``SIZE_CLASSES`` by default; ``None`` for
        durations, where a bytes share means nothing).
    """

    def __init__(self, max_distinct: int = 65536, classes=SIZE_CLASSES, log_ratio: float = _LOG_RATIO):
        self.max_distinct = max_distinct
        self.log_ratio = float(log_ratio)
        self.classes = classes
        self.values = np.zeros(0, dtype=np.float64)   # sorted distinct values (or bin centres)
        self.counts = np.zeros(0, dtype=np.int64)
        self.exact = True
        self.count = 0
        self.total = 0.0
        self.min = np.inf
        self.max = -np.inf
        n_cls = len(classes) if classes else 0
        self.class_counts = np.zeros(n_cls, dtype=np.int64)
        self.class_sums = np.zeros(n_cls, dtype=np.float64)
        self._bounds = np.array([b for _, b in classes[:-1]], dtype=np.float64) if classes else None

    def add(self, values, weights=None) -> None:
        """Add values (array-like, any shape); ``weights`` repeats each value that many times."""
        v = np.asarray(values, dtype=np.float64).ravel()
        w = np.ones(len(v), dtype=np.int64) if weights is None else np.asarray(weights, dtype=np.int64).ravel()
        if len(v) == 0:
            return
        self.count += int(w.sum())
        self.total += float((v * w).sum())
        self.min = min(self.min, float(v.min()))
        self.max = max(self.max, float(v.max()))
        if self.classes:
            cls = np.searchsorted(self._bounds, v, side="left")
            self.class_counts += np.bincount(cls, weights=w, minlength=len(self.classes)).astype(np.int64)
            self.class_sums += np.bincount(cls, weights=v * w, minlength=len(self.classes))
        if not self.exact:
            v = self._fold(v)
        uv, inv = np.unique(v, return_inverse=True)
        uc = np.bincount(inv, weights=w).astype(np.int64)
        self._merge(uv, uc)
        if self.exact and len(self.values) > self.max_distinct:
            self.exact = False
            self._merge_all(self._fold(self.values), self.counts)

    def merge(self, other: "Distribution") -> None:
        """Add everything ``other`` holds (same classes)."""
        if other.count == 0:
            return
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        if self.classes:
            self.class_counts += other.class_counts
            self.class_sums += other.class_sums
        vals = other.values
        if not self.exact or not other.exact:
            if self.exact:
                self.exact = False
                self._merge_all(self._fold(self.values), self.counts)
            vals = self._fold(vals) if other.exact else vals
        uv, inv = np.unique(vals, return_inverse=True)
        self._merge(uv, np.bincount(inv, weights=other.counts).astype(np.int64))
        if self.exact and len(self.values) > self.max_distinct:
            self.exact = False
            self._merge_all(self._fold(self.values), self.counts)

    def _fold(self, v: np.ndarray) -> np.ndarray:
        """Map values to the (geometric) centre of their log bin (0 stays 0)."""
        out = np.zeros_like(v)
        pos = v > 0
        k = np.floor(np.log(v[pos]) / np.log(self.log_ratio))
        out[pos] = self.log_ratio ** (k + 0.5)
        return out

    def _merge_all(self, v, c) -> None:
        uv, inv = np.unique(v, return_inverse=True)
        self.values = uv
        self.counts = np.bincount(inv, weights=c).astype(np.int64)

    def _merge(self, uv, uc) -> None:
        if len(self.values) == 0:
            self.values, self.counts = uv, uc
            return
        self._merge_all(np.concatenate([self.values, uv]), np.concatenate([self.counts, uc]))

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (nearest rank: smallest value with at least q % at or below)."""
        if self.count == 0:
            return None
        cum = np.cumsum(self.counts)
        rank = max(1, int(np.ceil(q / 100.0 * self.count)))
        return float(self.values[np.searchsorted(cum, rank, side="left")])

    def cdf(self) -> tuple[np.ndarray, np.ndarray]:
        """``(values, fraction <= value)`` for plotting."""
        if self.count == 0:
            return np.zeros(0), np.zeros(0)
        return self.values.copy(), np.cumsum(self.counts) / self.count

    def class_shares(self) -> list[dict]:
        """Per size class: name, count, bytes and share of all bytes (0..1)."""
        if not self.classes:
            return []
        total = float(self.class_sums.sum())
        return [{"class": name, "count": int(c), "bytes": int(round(s)),
                 "bytes_share": (s / total if total else 0.0)}
                for (name, _), c, s in zip(self.classes, self.class_counts, self.class_sums)]

    def to_dict(self) -> dict:
        """Count, sum, mean, min, max, percentiles (``p50``...), ``exact`` and the class shares."""
        d = {"count": self.count, "sum": self.total, "exact": self.exact}
        if not self.exact:
            d["relative_error"] = self.log_ratio ** 0.5 - 1
        if self.count:
            d.update(mean=self.total / self.count, min=self.min, max=self.max)
            for q in PERCENTILES:
                d[f"p{q:g}".replace(".", "_")] = self.percentile(q)
        else:
            d.update(mean=None, min=None, max=None)
            for q in PERCENTILES:
                d[f"p{q:g}".replace(".", "_")] = None
        if self.classes:
            d["classes"] = self.class_shares()
        return d
