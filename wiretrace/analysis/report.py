"""Summaries for people: text tables on a terminal (rich) and one self-contained HTML page.

Both render the ``dict`` of :func:`wiretrace.analysis.summarize`; neither computes anything.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table


def fmt_bytes(n) -> str:
    """``1536`` -> ``1.50 KiB`` (binary prefixes); None -> ``-``."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_rate(bps) -> str:
    """bits/s with SI prefixes (``400.00 Gb/s``)."""
    if bps is None:
        return "-"
    for unit, div in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if bps >= div:
            return f"{bps / div:.2f} {unit}"
    return f"{bps:.0f} b/s"


def fmt_ns(ns) -> str:
    """Nanoseconds as ns / µs / ms / s."""
    if ns is None:
        return "-"
    ns = float(ns)
    for unit, div in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(ns) >= div:
            return f"{ns / div:.3g} {unit}"
    return f"{ns:.0f} ns"


def fmt_pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def fmt_num(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def tables(doc: dict, top_flows: int = 20, top_series: int = 16) -> list[tuple[str, list[str], list[list[str]]]]:
    """The summary as (title, header, rows) tables, shared by the text and HTML renderings:
    the ``top_flows`` largest flows and the ``top_series`` busiest NIC directions."""
    t = doc["totals"]
    out = []
    out.append(("Totals", ["packets", "bytes", "payload", "flows", "NICs", "duration", "mean rate", "line rate"],
                [[f"{t['packets']:,}", fmt_bytes(t["bytes"]), fmt_bytes(t["payload_bytes"]), f"{t['flows']:,}",
                  str(t["nics"]), fmt_ns(t["duration_ns"]), fmt_rate(t["mean_rate_bps"]),
                  fmt_rate(doc.get("line_rate_bps"))]]))
    by = doc["by"]
    key = by["key"]
    if key in ("nic", "node"):
        hdr = [key, "tx packets", "tx bytes", "rx packets", "rx bytes", "share of bytes"]
        rows = [[str(r[key]), f"{r['tx_packets']:,}", fmt_bytes(r["tx_bytes"]), f"{r['rx_packets']:,}",
                 fmt_bytes(r["rx_bytes"]), fmt_pct(r["share"])] for r in by["rows"]]
        if key == "nic":
            hdr += ["tx util.", "rx util."]
            for row, r in zip(rows, by["rows"]):
                row += [fmt_pct(r["tx_utilization"]), fmt_pct(r["rx_utilization"])]
    else:
        hdr = [key, "packets", "bytes", "share of bytes"]
        rows = [[str(r[key]), f"{r['packets']:,}", fmt_bytes(r["bytes"]), fmt_pct(r["share"])] for r in by["rows"]]
    if len(rows) > 64:
        order = sorted(range(len(rows)), key=lambda i: -by["rows"][i].get("tx_bytes", by["rows"][i].get("bytes", 0)))[:64]
        rows = [rows[i] for i in sorted(order)]
        out.append((f"Traffic by {key} (busiest 64 of {len(by['rows']):,})", hdr, rows))
    else:
        out.append((f"Traffic by {key}", hdr, rows))
    flows = doc["flows"]
    out.append((f"Flows (top {min(top_flows, len(flows))} of {len(flows):,} by bytes)",
                ["src", "dst", "UDP sport", "DestQP", "packets", "bytes", "duration", "mean rate"],
                [[r["src"], r["dst"], str(r["udp_sport"]), f"0x{r['dest_qp']:06x}", f"{r['packets']:,}",
                  fmt_bytes(r["bytes"]), fmt_ns(r["duration_ns"]), fmt_rate(r["mean_rate_bps"])]
                 for r in flows[:top_flows]]))
    for name, title in (("message_sizes", "Message sizes"), ("flow_sizes", "Flow sizes")):
        d = doc[name]
        note = "" if d.get("exact", True) else " (percentiles within 1.1 %)"
        src = f", from {d['source']}" if d.get("source") else ""
        out.append((f"{title}{src}{note}", ["count", "mean", "p50", "p90", "p99", "max"],
                    [[f"{d['count']:,}", fmt_bytes(d["mean"]), fmt_bytes(d["p50"]), fmt_bytes(d["p90"]),
                      fmt_bytes(d["p99"]), fmt_bytes(d["max"])]]))
        out.append((f"{title}: bytes share per size class", ["class", "count", "bytes", "share"],
                    [[c["class"], f"{c['count']:,}", fmt_bytes(c["bytes"]), fmt_pct(c["bytes_share"])]
                     for c in d.get("classes", []) if c["count"]]))
    # busiest NIC directions only (the JSON keeps every one)
    vol = {(r["nic"], d): r[f"{d}_bytes"] for r in doc["nics"] for d in ("tx", "rx")}
    series = sorted({(r["nic"], r["direction"]) for r in doc["burstiness"]}, key=lambda k: -vol.get(k, 0))
    keep = set(series[:top_series])
    more = f", busiest {len(keep)} of {len(series)} NIC directions" if len(series) > len(keep) else ""
    burst = [r for r in doc["burstiness"] if (r["nic"], r["direction"]) in keep]
    onoff = [r for r in doc["onoff"] if (r["nic"], r["direction"]) in keep]
    out.append((f"Burstiness (windows of each timescale over the whole span{more}; peak rate counts "
                f"frame bytes, peak util. the wire: frames plus preamble, FCS and inter-frame gap; a frame "
                f"counts in the window it starts in, so a short window can read up to one frame above 100 %)",
                ["nic", "dir", "timescale", "peak/mean", "CoV", "IDC", "peak rate", "peak util."],
                [[r["nic"], r["direction"], fmt_ns(r["timescale_ns"])]
                 + ([fmt_num(r["peak_to_mean"]), fmt_num(r["cov"]), fmt_num(r["index_of_dispersion"])]
                    if r["windows"] >= 2 else ["n/a", "n/a (fewer than 2 windows)", "n/a"])
                 + [fmt_rate(r["peak_bps"]), fmt_pct(r["peak_utilization"])] for r in burst]))
    out.append((f"On/off periods (a burst ends after an idle gap > {fmt_ns(doc['idle_gap_ns'])}{more})",
                ["nic", "dir", "bursts", "burst bytes p50", "p99", "on p50", "on p99", "off p50", "off p99"],
                [[r["nic"], r["direction"], f"{r['bursts']:,}", fmt_bytes(r["burst_bytes"]["p50"]),
                  fmt_bytes(r["burst_bytes"]["p99"]), fmt_ns(r["on_ns"]["p50"]), fmt_ns(r["on_ns"]["p99"]),
                  fmt_ns(r["off_ns"]["p50"]), fmt_ns(r["off_ns"]["p99"])] for r in onoff]))
    m = doc["matrix"]
    if len(m["nodes"]) <= 16:
        out.append((f"Traffic matrix (bytes, rows send to columns; by {m['by']})", [""] + m["nodes"],
                    [[src] + [fmt_bytes(v) for v in row] for src, row in zip(m["nodes"], m["bytes"])]))
    else:
        pairs = sorted(((v, a, b) for a, row in zip(m["nodes"], m["bytes"]) for b, v in zip(m["nodes"], row) if v),
                       reverse=True)
        out.append((f"Traffic matrix: largest {min(20, len(pairs))} of {len(pairs):,} pairs "
                    f"({len(m['nodes'])} x {len(m['nodes'])} in --json and the heatmap)",
                    ["from", "to", "bytes"], [[a, b, fmt_bytes(v)] for v, a, b in pairs[:20]]))
    out.append(("Opcodes", ["opcode", "packets"], [[k, f"{v:,}"] for k, v in doc["opcodes"].items()]))
    ecn = doc["ecn"]
    naks = doc.get("naks")
    nak_txt = "-" if naks is None else f"{naks['nak_psn_sequence_error'] + naks['nak_other']:,}"
    rnr_txt = "-" if naks is None else f"{naks['rnr_nak']:,}"
    out.append(("ACK / NAK / CNP / ECN", ["ACKs", "NAKs", "RNR NAKs", "CNPs", "Not-ECT", "ECT(0)", "ECT(1)", "CE marks"],
                [[f"{doc['acks']:,}", nak_txt, rnr_txt, f"{doc['cnps']:,}", f"{ecn['not_ect']:,}", f"{ecn['ect0']:,}",
                  f"{ecn['ect1']:,}", f"{ecn['ce']:,}"]]))
    return out


def print_text(doc: dict, file=None, top_flows: int = 20) -> None:
    """Print the summary as terminal tables."""
    console = Console(file=file, width=140, highlight=False)
    inp = doc.get("input", {})
    console.print(f"[bold]{inp.get('path', '')}[/bold] ({inp.get('kind', '')}"
                  + (f", {inp['format']}" if inp.get("format") else "") + ")")
    for title, hdr, rows in tables(doc, top_flows):
        if not rows:
            continue
        t = Table(title=title, title_justify="left", show_lines=False)
        for h in hdr:
            t.add_column(h, justify="left" if h in ("nic", "node", "src", "dst", "class", "opcode", "", "from", "to")
                         else "right")
        for r in rows:
            t.add_row(*r)
        console.print(t)
    skipped = inp.get("skipped")
    if skipped:
        console.print("frames skipped: " + ", ".join(f"{v:,} {k}" for k, v in skipped.items()))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }}
h1 {{ font-size: 1.4em; }} h2 {{ font-size: 1.15em; margin-top: 1.6em; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.85em; }}
th, td {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
th {{ background: #f0f0f0; }} td:first-child {{ text-align: left; }}
figure {{ margin: 1em 0; }} figure img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ font-size: 0.9em; color: #555; }}
</style>
<script>
// Counts script errors and images that fail to load on <html data-errors="N">.
(function () {{
  var n = 0, root = document.documentElement;
  root.setAttribute("data-errors", "0");
  window.addEventListener("error", function () {{ n += 1; root.setAttribute("data-errors", String(n)); }}, true);
}})();
</script>
</head>
<body data-figures="{nfig}">
<h1>{title}</h1>
<p>{subtitle}</p>
{figures}
{tables}
<h2>Definitions</h2>
<ul>
<li>bytes: frame bytes from the Ethernet header (or LRH) through the ICRC (and VCRC), without FCS,
as the capture's original length counts them.</li>
<li>utilization: bytes on the line (Ethernet adds 24 bytes per frame: preamble, SFD, FCS, minimum
inter-frame gap) x 8 / (line rate x span from first to last packet).</li>
<li>flow: source and destination address, UDP source port and BTH DestQP (one QP connection in one
direction).</li>
<li>burstiness: bytes (and packets) in windows of each timescale over the whole span, empty windows
included; peak-to-mean and coefficient of variation of bytes, index of dispersion of packet counts.</li>
<li>burst (on period): packets of one NIC direction each starting at most the idle gap after the
previous one ended ({idle_gap}).</li>
</ul>
<script>
// Sets data-loaded="N/M" on <html> (N figures decoded with naturalWidth > 0, of M), again
// after the load event, so that a headless browser can check that every figure is shown.
(function () {{
  var imgs = Array.prototype.slice.call(document.querySelectorAll("figure img"));
  function check() {{
    var ok = imgs.filter(function (i) {{ return i.complete && i.naturalWidth > 0; }}).length;
    document.documentElement.setAttribute("data-loaded", ok + "/" + imgs.length);
  }}
  check();
  window.addEventListener("load", check);
}})();
</script>
</body></html>
"""


def html_page(doc: dict, figures: list[tuple[str, Path]], top_flows: int = 50) -> str:
    """One self-contained HTML page: every figure embedded as a ``data:`` URI, then the tables.

    Parameters
    ----------
    doc : summary dict.
    figures : (caption, PNG or SVG path) in display order.
    """
    figs = []
    for caption, path in figures:
        data = Path(path).read_bytes()
        mime = "image/svg+xml" if str(path).endswith(".svg") else "image/png"
        uri = f"data:{mime};base64," + base64.b64encode(data).decode("ascii")
        figs.append(f'<figure><img alt="{html.escape(caption)}" src="{uri}">'
                    f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    tabs = []
    for title, hdr, rows in tables(doc, top_flows):
        if not rows:
            continue
        head = "".join(f"<th>{html.escape(h)}</th>" for h in hdr)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        tabs.append(f"<h2>{html.escape(title)}</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    inp = doc.get("input", {})
    title = f"wiretrace report: {Path(inp.get('path', 'input')).name}"
    subtitle = html.escape(f"{inp.get('kind', '')} {inp.get('path', '')}: {doc['totals']['packets']:,} packets, "
                           f"{fmt_bytes(doc['totals']['bytes'])}, {doc['totals']['flows']:,} flows")
    return _PAGE.format(title=html.escape(title), subtitle=subtitle, nfig=len(figs),
                        figures="\n".join(figs), tables="\n".join(tabs),
                        idle_gap=html.escape(fmt_ns(doc.get("idle_gap_ns"))))


def plain(o):
    """``o`` with NumPy scalars turned into Python numbers and NaN/inf into None (strict JSON)."""
    if isinstance(o, dict):
        return {str(k): plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [plain(v) for v in o]
    if hasattr(o, "item") and not isinstance(o, (str, bytes)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def to_json(doc: dict) -> str:
    """The summary as strict JSON text."""
    return json.dumps(plain(doc), indent=2, allow_nan=False)
