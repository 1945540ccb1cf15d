"""wiretrace plot: PNG and SVG figures, and the self-contained HTML page opened in headless Chromium."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import require_tool

from test_analysis import REAL, capture_file, parquet_dir  # noqa: F401  (fixtures)

WIRETRACE = [sys.executable, "-m", "wiretrace.cli"]
FIGURES = ("throughput", "matrix", "sizes", "bursts")


def cli(*args):
    return subprocess.run([*WIRETRACE, *args], capture_output=True, text=True, timeout=300)


def chromium() -> str:
    for name in ("chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return require_tool("chromium")


def open_in_chromium(page: Path, tmp_path: Path) -> str:
    """The DOM of ``page`` after load, as headless Chromium serializes it."""
    profile = tmp_path / "chromium-profile"
    r = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom",
                        page.resolve().as_uri()], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def plotted(parquet_dir, tmp_path_factory):  # noqa: F811
    d, _, _ = parquet_dir
    out = tmp_path_factory.mktemp("fig")
    r = cli("plot", str(d), "-o", str(out / "figs"), "--html", str(out / "report.html"), "--line-rate", "100Gbps")
    assert r.returncode == 0, r.stderr
    return out


def test_figures_exist_as_png_and_svg(plotted):
    for name in FIGURES:
        w, h = png_size(plotted / "figs" / f"{name}.png")
        assert w >= 400 and h >= 200
        root = ET.parse(plotted / "figs" / f"{name}.svg").getroot()
        assert root.tag.endswith("svg")
    assert not list((plotted / "figs").glob(".*tmp"))


def test_html_is_self_contained(plotted):
    page = (plotted / "report.html").read_text()
    srcs = re.findall(r'src="([^"]*)"', page)
    assert len(srcs) == 4 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "http://" not in page and "https://" not in page
    for title in ("Totals", "Traffic by nic", "Flows", "Burstiness", "On/off periods", "Traffic matrix", "Opcodes"):
        assert f"<h2>{title}" in page


def test_html_loads_in_chromium_and_shows_every_figure(plotted, tmp_path):
    dom = open_in_chromium(plotted / "report.html", tmp_path)
    assert 'data-loaded="4/4"' in dom
    assert 'data-errors="0"' in dom
    assert dom.count("<figure>") == 4


def test_chromium_check_detects_a_broken_figure(plotted, tmp_path):
    """The marker is not a formality: a figure whose image does not decode is caught."""
    page = (plotted / "report.html").read_text()
    broken = re.sub(r'src="data:image/png;base64,[^"]{40}', 'src="data:image/png;base64,AAAA', page, count=1)
    bad = tmp_path / "broken.html"
    bad.write_text(broken)
    dom = open_in_chromium(bad, tmp_path)
    assert 'data-loaded="3/4"' in dom
    assert 'data-errors="1"' in dom


def test_plot_refuses_to_overwrite_without_force(plotted, parquet_dir):  # noqa: F811
    d, _, _ = parquet_dir
    r = cli("plot", str(d), "-o", str(plotted / "figs"))
    assert r.returncode == 2 and "exists; pass --force to overwrite it" in r.stderr
    r = cli("plot", str(d), "-o", str(plotted / "other"), "--html", str(plotted / "report.html"))
    assert r.returncode == 2 and "report.html exists" in r.stderr
    assert not (plotted / "other").exists()
    r = cli("plot", str(d), "-o", str(plotted / "figs"), "--force")
    assert r.returncode == 0, r.stderr


def test_plot_of_captures(capture_file, tmp_path):  # noqa: F811
    for src in (capture_file[0], REAL / "scapy_roce_test_vectors.pcap"):
        out = tmp_path / src.stem
        r = cli("plot", str(src), "-o", str(out), "--html", str(out / "r.html"))
        assert r.returncode == 0, r.stderr
        for name in FIGURES:
            assert png_size(out / f"{name}.png")[0] > 0
        dom = open_in_chromium(out / "r.html", tmp_path)
        assert 'data-loaded="4/4"' in dom and 'data-errors="0"' in dom


def test_throughput_x_axis_follows_the_packets(parquet_dir):  # noqa: F811
    """Phases known beyond the packets (tables of a generate --window run) are clipped to the
    packets' span instead of stretching the x axis."""
    from wiretrace.analysis import analyze
    from wiretrace.analysis.figures import throughput

    d, _, pk = parquet_dir
    s, _ = analyze(d)
    first, last = int(pk["ts_ns"].min()), int(pk["ts_ns"].max())
    assert (s.first_ns, s.last_ns) == (first, last)
    spans = [("forward", first - 10**9, first + 50_000), ("backward", first + 60_000, last + 10**9),
             ("optimizer", last + 10, last + 2 * 10**9)]
    fig = throughput(s, spans)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time from first packet (µs)"
    assert ax.get_xlim() == pytest.approx((0, (last - first) / 1e3))
    shaded = [p.get_extents().transformed(ax.transData.inverted()) for p in ax.patches]
    assert [(round(b.x0, 3), round(b.x1, 3)) for b in shaded] == [(0, 50), (60, round((last - first) / 1e3, 3))]
    labels = ax.get_legend_handles_labels()[1]
    assert "phase: forward" in labels and "phase: backward" in labels and "phase: optimizer" not in labels


def test_identical_nic_series_are_drawn_once_and_named_together():
    import numpy as np

    from wiretrace.analysis.figures import throughput
    from wiretrace.analysis.summary import Endpoints, Summary

    def figure(n_same):
        eps = Endpoints()
        for i in range(n_same + 1):
            eps.get(i, f"nic{i}", i, i // 4)
        s = Summary(eps, line_rate_bps=100e9)
        ts = np.arange(0, 200_000, 1_000)
        # NICs 0..n_same-1 send the same frames at the same times; the last one sends half of them
        for i in range(n_same + 1):
            t = ts if i < n_same else ts[::2]
            s.add(dict(ts_ns=t, src=np.full(len(t), i), dst=np.full(len(t), (i + 1) % (n_same + 1)),
                       udp_sport=np.full(len(t), 49153 + i), dest_qp=np.full(len(t), 0x10 + i),
                       opcode=np.full(len(t), 0x0A, np.uint8), payload_len=np.full(len(t), 4096),
                       frame_len=np.full(len(t), 4154), ecn=np.full(len(t), 2), dscp=np.full(len(t), 26)))
        ax = throughput(s).axes[0]
        return [ln.get_label() for ln in ax.get_lines() if ln.get_label() != "line rate"]

    assert figure(8) == ["nic0 … nic7 (8 NICs, identical)", "nic8"]
    assert figure(3) == ["nic0, nic1, nic2 (identical)", "nic3"]
    assert figure(1) == ["nic0", "nic1"]


def empty_pcap(path: Path) -> Path:
    """A nanosecond pcap with its file header only (a window without packets)."""
    path.write_bytes(struct.pack("<IHHiIII", 0xA1B23C4D, 2, 4, 0, 0, 128, 1))
    return path


def test_plot_of_a_capture_without_packets_says_so(tmp_path):
    """No frames (``generate --parallelism tp`` keeps everything on NVLink): every figure is
    drawn, saying there is nothing, and the HTML page is written."""
    out = tmp_path / "figs"
    r = cli("plot", str(empty_pcap(tmp_path / "e.pcap")), "-o", str(out), "--html", str(tmp_path / "e.html"))
    assert r.returncode == 0, r.stderr
    assert "<!-- no network traffic -->" in (out / "matrix.svg").read_text()
    for name in ("throughput", "bursts"):
        assert "<!-- no packets -->" in (out / f"{name}.svg").read_text(), name
    assert (tmp_path / "e.html").stat().st_size > 0


def test_a_failing_figure_leaves_no_figure_and_no_directory(tmp_path, monkeypatch):
    from wiretrace.analysis import analyze, figures

    s, _ = analyze(empty_pcap(tmp_path / "e.pcap"))

    def broken(_s):
        raise RuntimeError("figure failed")

    monkeypatch.setattr(figures, "bursts", broken)
    out = tmp_path / "new" / "figs"
    with pytest.raises(RuntimeError, match="figure failed"):
        figures.write_all(s, out)
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(RuntimeError):
        figures.write_all(s, kept)
    assert list(kept.iterdir()) == []
