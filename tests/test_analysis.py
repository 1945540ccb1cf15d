"""wiretrace summarize: burstiness closed forms, streaming invariance, Parquet and capture inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import wrpcap

from wiretrace import tables
from wiretrace.analysis import summarize
from wiretrace.analysis.burstiness import Burstiness
from wiretrace.analysis.stats import Distribution
from wiretrace.io.parquet import write_table

REAL = Path(__file__).resolve().parents[2] / "shared" / "real" / "roce_packets"
WIRETRACE = [sys.executable, "-m", "wiretrace.cli"]


def cli(*args):
    return subprocess.run([*WIRETRACE, *args], capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------
# burstiness: closed forms
# ---------------------------------------------------------------------------------------------

# An on/off source: every P ns it sends for D ns, one S-byte frame every g ns; K periods.
P, D, G, S, K = 40_000, 10_000, 100, 125, 50


def onoff_trace():
    ts = (np.arange(K)[:, None] * P + np.arange(0, D, G)[None, :]).ravel()
    return ts.astype(np.int64)


@pytest.mark.parametrize("chunks", [1, 7, 333])
def test_onoff_windows_match_closed_form(chunks):
    ts = onoff_trace()
    b = Burstiness(idle_gap_ns=1000, origin_ns=0)
    for part in np.array_split(np.arange(len(ts)), chunks):
        b.add(ts[part], np.zeros(len(part), dtype=np.int64), np.full(len(part), S))
    rows = {r["timescale_ns"]: r for r in b.window_stats(0, end_ns=K * P)}
    f = D / P                      # fraction of time on
    n_on = D // G                  # frames per on period
    # T = 1 us and 10 us divide the on period: windows hold B_on (fraction f of them) or nothing
    for T in (1_000, 10_000):
        per_window = n_on * T // D
        r = rows[T]
        assert r["windows"] == K * P // T
        assert r["mean_bytes"] == pytest.approx(per_window * S * f)
        assert r["peak_to_mean"] == pytest.approx(1 / f)
        assert r["cov"] == pytest.approx(np.sqrt(1 / f - 1))
        assert r["index_of_dispersion"] == pytest.approx(per_window * (1 - f))
        assert r["peak_bps"] == pytest.approx(per_window * S * 8e9 / T)
    # T = 100 us = 2.5 periods: windows alternate 3 and 2 on periods
    r = rows[100_000]
    assert r["windows"] == 20
    assert r["peak_to_mean"] == pytest.approx(3 / 2.5)
    assert r["cov"] == pytest.approx(0.5 / 2.5)
    assert r["index_of_dispersion"] == pytest.approx(0.25 * n_on ** 2 / (2.5 * n_on))
    # T = 1 ms = 25 periods: every window alike
    r = rows[1_000_000]
    assert (r["peak_to_mean"], r["cov"], r["index_of_dispersion"]) == (pytest.approx(1), pytest.approx(0), pytest.approx(0))


def test_onoff_periods_with_line_rate_match_closed_form():
    ts = onoff_trace()
    rate = S * 8e9 / G            # each frame lasts exactly the gap: back-to-back during on
    b = Burstiness(idle_gap_ns=1000, line_rate_bps=rate, origin_ns=0)
    for part in np.array_split(np.arange(len(ts)), 5):
        b.add(ts[part], np.zeros(len(part), dtype=np.int64), np.full(len(part), S))
    o = b.onoff(0)
    assert o["bursts"] == K
    assert o["on_ns"]["min"] == o["on_ns"]["max"] == pytest.approx(D)
    assert o["off_ns"]["count"] == K - 1
    assert o["off_ns"]["min"] == o["off_ns"]["max"] == pytest.approx(P - D)
    assert o["burst_bytes"]["p50"] == (D // G) * S
    assert o["burst_packets"]["max"] == D // G
    # utilization at 1 us while on: 100 % of the line (wire bytes = frame bytes here)
    r = b.window_stats(0, end_ns=K * P)[0]
    assert r["peak_utilization"] == pytest.approx(1.0)


def brute_force(ts, key, nbytes, T, n_windows, gap):
    """Independent plain computation: dense windows per key, on/off by a loop."""
    out = {}
    for k in np.unique(key):
        m = key == k
        w = np.bincount(ts[m] // T, weights=nbytes[m], minlength=n_windows)[:n_windows]
        c = np.bincount(ts[m] // T, minlength=n_windows)[:n_windows]
        bursts, cur, last = [], None, None
        for t, nb in sorted(zip(ts[m].tolist(), nbytes[m].tolist())):
            if cur is None or t - last > gap:
                if cur is not None:
                    bursts.append(cur)
                cur = [t, t, 0]
            cur[1], cur[2] = t, cur[2] + nb
            last = t
        bursts.append(cur)
        out[int(k)] = dict(ptm=w.max() / w.mean(), cov=w.std() / w.mean(), idc=c.var() / c.mean(),
                           bursts=bursts)
    return out


def test_streaming_equals_brute_force_on_random_traffic():
    rng = np.random.default_rng(7)
    n = 20_000
    ts = np.sort(rng.integers(0, 5_000_000, n))
    key = rng.integers(0, 5, n)
    nbytes = rng.integers(60, 4200, n).astype(np.float64)
    T, gap = 10_000, 2_000
    b = Burstiness(timescales_ns=(T,), idle_gap_ns=gap, origin_ns=0)
    cuts = np.sort(rng.choice(np.arange(1, n), 40, replace=False))
    for part in np.split(np.arange(n), cuts):
        b.add(ts[part], key[part], nbytes[part])
    nw = int(ts.max()) // T + 1
    ref = brute_force(ts, key, nbytes, T, nw, gap)
    for k, want in ref.items():
        r = b.window_stats(k)[0]
        assert r["windows"] == nw
        assert r["peak_to_mean"] == pytest.approx(want["ptm"])
        assert r["cov"] == pytest.approx(want["cov"])
        assert r["index_of_dispersion"] == pytest.approx(want["idc"])
        o = b.onoff(k)
        assert o["bursts"] == len(want["bursts"])
        sizes = sorted(x[2] for x in want["bursts"])
        assert o["burst_bytes"]["sum"] == pytest.approx(sum(sizes))
        assert o["burst_bytes"]["max"] == pytest.approx(sizes[-1])
        assert o["on_ns"]["sum"] == pytest.approx(sum(x[1] - x[0] for x in want["bursts"]))
        offs = [b2[0] - b1[1] for b1, b2 in zip(want["bursts"], want["bursts"][1:])]
        assert o["off_ns"]["sum"] == pytest.approx(sum(offs))


def test_distribution_exact_then_bounded():
    rng = np.random.default_rng(1)
    v = rng.integers(1, 1000, 5000)
    d = Distribution(max_distinct=100_000)
    for part in np.array_split(v, 9):
        d.add(part)
    assert d.exact
    for q in (50, 90, 99):
        assert d.percentile(q) == np.percentile(v, q, method="inverted_cdf")
    big = rng.lognormal(12, 2, 50_000)
    d = Distribution(max_distinct=1000)
    for part in np.array_split(big, 10):
        d.add(part)
    assert not d.exact
    assert len(d.values) < 3000
    for q in (50, 90, 99):
        ref = np.percentile(big, q, method="inverted_cdf")
        assert abs(d.percentile(q) - ref) / ref < 0.011
    assert d.count == len(big) and d.total == pytest.approx(big.sum())
    shares = d.class_shares()
    assert sum(c["count"] for c in shares) == len(big)
    assert sum(c["bytes_share"] for c in shares) == pytest.approx(1.0)
    assert shares[0]["count"] == int((big <= 256).sum())


# ---------------------------------------------------------------------------------------------
# Parquet directory input
# ---------------------------------------------------------------------------------------------


def filled(table: str, n: int, cols: dict) -> dict:
    """Columns of ``table`` with ``cols`` given and every other declared column at a neutral value."""
    out = {}
    for name in tables.column_names(table):
        if name in cols:
            out[name] = cols[name]
            continue
        dt = tables.numpy_dtype(table, name)
        if dt == object:
            kind = next(f["type"] for f in tables.fields(table) if f["name"] == name)
            out[name] = [[] for _ in range(n)] if kind.startswith("list") else [""] * n
        else:
            out[name] = np.zeros(n, dtype=dt)
    return out


MTU = 4096


def packetize_reference(msgs, rate_bps=100e9):
    """Test-side packets for messages: RDMA WRITE FIRST/MIDDLE/LAST_WITH_IMMEDIATE (or ONLY with
    IMMEDIATE), back to back at the line rate per sending NIC, plus one ACK per message."""
    rows = []
    nic_free = {}
    for m in sorted(msgs, key=lambda m: m["t"]):
        n = max(1, -(-m["bytes"] // MTU))
        t = max(m["t"], nic_free.get(m["src"], 0))
        for i in range(n):
            pl = min(MTU, m["bytes"] - i * MTU)
            op = 0x0B if n == 1 else (0x06 if i == 0 else (0x09 if i == n - 1 else 0x07))
            ext = {0x0B: 20, 0x06: 16, 0x09: 4, 0x07: 0}[op]
            pad = (-pl) % 4
            flen = 14 + 20 + 8 + 12 + ext + pl + pad + 4
            rows.append(dict(ts_ns=t, msg_id=m["id"], src_nic=m["src"], dst_nic=m["dst"], udp_sport=m["sport"],
                             dest_qp=m["qpn"], psn=i, opcode=op, ack_req=i == n - 1, payload_len=pl, pad=pad,
                             frame_len=flen, dscp=26, ecn=3 if (m["id"] + i) % 11 == 0 else 2))
            t += int(round((flen + 24) * 8e9 / rate_bps))
        rows.append(dict(ts_ns=t + 2000, msg_id=m["id"], src_nic=m["dst"], dst_nic=m["src"], udp_sport=m["sport"] + 1,
                         dest_qp=m["qpn"] + 1, psn=n - 1, opcode=0x11, ack_req=False, payload_len=0, pad=0,
                         frame_len=62, dscp=26, ecn=2))
        nic_free[m["src"]] = t
    rows.sort(key=lambda r: (r["ts_ns"], r["msg_id"]))
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    """2 nodes x 2 NICs; a TP all-reduce in forward (intra-node NICs do not touch the network, so
    it is modelled as node0<->node1 here) and DP gradient messages in backward."""
    d = tmp_path_factory.mktemp("pq")
    coll = filled("collectives", 3, {"op_id": np.arange(3), "op": ["all_reduce", "all_reduce", "all_gather"],
                                     "parallelism": ["tp", "dp", "dp"], "phase": ["forward", "backward", "optimizer"],
                                     "ranks": [[0, 1], [0, 2], [1, 3]], "group_size": np.full(3, 2, np.int32)})
    write_table(d / "collectives.parquet", "collectives", coll)
    node = {0: 0, 1: 0, 2: 1, 3: 1}
    msgs = []
    rng = np.random.default_rng(3)
    for i in range(40):
        op = (0, 1, 2)[i % 3]
        src = (0, 2, 1, 3)[i % 4]
        dst = {0: 2, 2: 0, 1: 3, 3: 1}[src]
        msgs.append(dict(id=i, op=op, src=src, dst=dst, bytes=int(rng.choice([64, 1000, 4096, 70_000, 524_288])),
                         t=i * 20_000 + (0 if op == 0 else 5_000), sport=49153 + src, qpn=0x100 + 2 * src))
    # one message that stays on NVLink (never on the wire)
    nv = dict(id=40, op=0, src=0, dst=1, bytes=123_456, t=0, sport=-1, qpn=-1)
    allm = msgs + [nv]
    m = filled("messages", len(allm), {
        "msg_id": np.array([x["id"] for x in allm]), "op_id": np.array([x["op"] for x in allm]),
        "src_nic": np.array([x["src"] for x in allm], np.int32), "dst_nic": np.array([x["dst"] for x in allm], np.int32),
        "src_node": np.array([node[x["src"]] for x in allm], np.int32), "dst_node": np.array([node[x["dst"]] for x in allm], np.int32),
        "link": ["network"] * len(msgs) + ["nvlink"], "kind": ["data"] * len(allm), "verb": ["write_imm"] * len(allm),
        "bytes": np.array([x["bytes"] for x in allm]), "wire_bytes": np.array([x["bytes"] for x in allm]),
        "qpn": np.array([x["qpn"] for x in allm], np.int32), "udp_sport": np.array([x["sport"] for x in allm], np.int32),
        "t_start_ns": np.array([x["t"] for x in allm]), "t_end_ns": np.array([x["t"] + 10_000 for x in allm])})
    write_table(d / "messages.parquet", "messages", m)
    pk = packetize_reference(msgs)
    write_table(d / "packets.parquet", "packets", filled("packets", len(pk["ts_ns"]), pk))
    return d, msgs, pk


def test_parquet_summary_agrees_with_tables(parquet_dir):
    d, msgs, _ = parquet_dir
    pk = pq.read_table(d / "packets.parquet").to_pydict()
    pk = {k: np.array(v) for k, v in pk.items()}
    doc = summarize(d, line_rate_bps=100e9)
    assert doc["totals"]["packets"] == len(pk["ts_ns"])
    assert doc["totals"]["bytes"] == int(pk["frame_len"].sum())
    assert doc["totals"]["payload_bytes"] == int(pk["payload_len"].sum())
    # flows: (src NIC, dst NIC, UDP sport, DestQP)
    keys = {}
    for s_, d_, sp, q, fl in zip(pk["src_nic"], pk["dst_nic"], pk["udp_sport"], pk["dest_qp"], pk["frame_len"]):
        k = (f"nic{s_}", f"nic{d_}", int(sp), int(q))
        p, b = keys.get(k, (0, 0))
        keys[k] = (p + 1, b + int(fl))
    got = {(f["src"], f["dst"], f["udp_sport"], f["dest_qp"]): (f["packets"], f["bytes"]) for f in doc["flows"]}
    assert got == keys
    # per NIC bytes sent and received
    for r in doc["nics"]:
        nic = r["nic_index"]
        assert r["tx_bytes"] == int(pk["frame_len"][pk["src_nic"] == nic].sum())
        assert r["rx_bytes"] == int(pk["frame_len"][pk["dst_nic"] == nic].sum())
        assert r["node"] == nic // 2
    # messages: the network ones only, sizes as in the table
    sizes = sorted(x["bytes"] for x in msgs)
    assert doc["message_sizes"]["count"] == 40 and doc["message_sizes"]["sum"] == sum(sizes)
    assert doc["message_sizes"]["p50"] == sizes[19] and doc["message_sizes"]["max"] == max(sizes)
    # opcodes, ACKs, ECN
    ops = {0x06: "RC_RDMA_WRITE_FIRST", 0x07: "RC_RDMA_WRITE_MIDDLE", 0x09: "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE",
           0x0B: "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE", 0x11: "RC_ACKNOWLEDGE"}
    assert doc["opcodes"] == {ops[c]: int((pk["opcode"] == c).sum()) for c in ops if (pk["opcode"] == c).any()}
    assert doc["acks"] == 40 and doc["cnps"] == 0
    assert doc["ecn"]["ce"] == int((pk["ecn"] == 3).sum()) and doc["ecn"]["ect0"] == int((pk["ecn"] == 2).sum())
    # node matrix
    m = np.array(doc["matrix"]["bytes"])
    assert doc["matrix"]["nodes"] == ["node0", "node1"]
    assert m[0, 1] == int(pk["frame_len"][pk["src_nic"] < 2].sum())
    assert m[1, 0] == int(pk["frame_len"][pk["src_nic"] >= 2].sum())
    assert m[0, 0] == m[1, 1] == 0


def test_parquet_bytes_by_parallelism_and_phase(parquet_dir):
    d, msgs, pk = parquet_dir
    op_of = {x["id"]: x["op"] for x in msgs}
    ops = np.array([op_of[i] for i in pk["msg_id"]])
    want_par = {"tp": int(pk["frame_len"][ops == 0].sum()), "dp": int(pk["frame_len"][ops != 0].sum())}
    want_phase = {n: int(pk["frame_len"][ops == i].sum()) for i, n in enumerate(("forward", "backward", "optimizer"))}
    doc = summarize(d, by="parallelism")
    assert {r["parallelism"]: r["bytes"] for r in doc["by"]["rows"]} == want_par
    assert {r["phase"]: r["bytes"] for r in doc["phase"]} == want_phase
    assert sum(r["share"] for r in doc["by"]["rows"]) == pytest.approx(1.0)
    doc = summarize(d, by="phase")
    assert [r["phase"] for r in doc["by"]["rows"]] == ["forward", "backward", "optimizer"]


def test_parquet_utilization_against_line_rate(parquet_dir):
    d, _, pk = parquet_dir
    doc = summarize(d, line_rate_bps=100e9)
    span = int(pk["ts_ns"].max() - pk["ts_ns"].min())
    for r in doc["nics"]:
        wire = pk["frame_len"][pk["src_nic"] == r["nic_index"]] + 24
        assert r["tx_utilization"] == pytest.approx(wire.sum() * 8e9 / span / 100e9)
    # frames of one message leave back to back at the line rate: the 1 us peak is close to 100 %
    peaks = [r["peak_utilization"] for r in doc["burstiness"] if r["timescale_ns"] == 1000 and r["direction"] == "tx"]
    assert max(peaks) == pytest.approx(1.0, abs=0.06)


def test_summarize_cli_json_keys_and_by(parquet_dir, tmp_path):
    d, _, pk = parquet_dir
    r = cli("summarize", str(d), "--json", "--line-rate", "100Gbps")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["totals"]["packets"] == len(pk["ts_ns"]) and doc["totals"]["bytes"] == int(pk["frame_len"].sum())
    f = doc["flows"][0]
    assert {"src", "dst", "udp_sport", "dest_qp", "packets", "bytes"} <= set(f)
    b = doc["burstiness"][0]
    assert {"nic", "timescale_ns", "peak_to_mean", "cov"} <= set(b)
    assert [x["timescale_ns"] for x in doc["burstiness"][:5]] == [1000, 10_000, 100_000, 1_000_000, 10_000_000]
    assert isinstance(doc["opcodes"], dict) and doc["opcodes"]["RC_ACKNOWLEDGE"] == 40
    assert doc["idle_gap_ns"] == 1000 and doc["onoff"][0]["idle_gap_ns"] == 1000
    r = cli("summarize", str(d), "--by", "phase", "--idle-gap", "5us")
    assert r.returncode == 0, r.stderr
    assert "Traffic by phase" in r.stdout and "backward" in r.stdout and "idle gap > 5 µs" in r.stdout


# ---------------------------------------------------------------------------------------------
# capture input
# ---------------------------------------------------------------------------------------------


def send_message_frames(size, sport, dqp, psn0, src="10.0.0.1", dst="10.1.0.1", ecn=2):
    """RC SEND FIRST/MIDDLE/LAST (or ONLY) frames of one message, built by scapy."""
    n = max(1, -(-size // 1024))
    out = []
    for i in range(n):
        pl = min(1024, size - i * 1024)
        op = 4 if n == 1 else (0 if i == 0 else (2 if i == n - 1 else 1))
        body = bytes(pl + (-pl) % 4)
        p = (Ether(src="02:00:00:00:00:01", dst="02:00:00:00:01:01") /
             IP(src=src, dst=dst, tos=(26 << 2) | ecn, flags="DF") / UDP(sport=sport, dport=4791, chksum=0) /
             BTH(opcode=op, dqpn=dqp, psn=psn0 + i, padcount=(-pl) % 4) / Raw(body))
        out.append(p)
    return out


@pytest.fixture(scope="module")
def capture_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("cap")
    frames, sizes = [], []
    t = 1_700_000_000.0
    spec = [(3000, 50001, 0x11), (100, 50002, 0x12), (5000, 50001, 0x11), (1024, 50003, 0x13), (2500, 50002, 0x12)]
    for j, (size, sport, dqp) in enumerate(spec * 4):
        for p in send_message_frames(size, sport, dqp, 10 * j, ecn=3 if j == 5 else 2):
            p.time = t
            t += 2e-6
            frames.append(p)
        sizes.append(size)
        t += 50e-6
    path = d / "send.pcap"
    wrpcap(str(path), frames)
    return path, frames, sizes


def test_capture_summary_flows_messages_opcodes(capture_file):
    path, frames, sizes = capture_file
    doc = summarize(path)
    assert doc["input"]["kind"] == "capture" and doc["input"]["format"] == "pcap"
    assert doc["totals"]["packets"] == len(frames)
    assert doc["totals"]["bytes"] == sum(len(bytes(p)) for p in frames)
    flows = {(f["src"], f["dst"], f["udp_sport"], f["dest_qp"]): (f["packets"], f["bytes"]) for f in doc["flows"]}
    want = {}
    for p in frames:
        k = ("10.0.0.1", "10.1.0.1", p[UDP].sport, p[BTH].dqpn)
        a, b = want.get(k, (0, 0))
        want[k] = (a + 1, b + len(bytes(p)))
    assert flows == want
    # messages reassembled from FIRST..LAST / ONLY
    md = doc["message_sizes"]
    assert md["source"] == "capture" and md["count"] == len(sizes) and md["sum"] == sum(sizes)
    assert md["max"] == 5000 and md["min"] == 100
    names = {0: "RC_SEND_FIRST", 1: "RC_SEND_MIDDLE", 2: "RC_SEND_LAST", 4: "RC_SEND_ONLY"}
    want_ops = {}
    for p in frames:
        want_ops[names[p[BTH].opcode]] = want_ops.get(names[p[BTH].opcode], 0) + 1
    assert doc["opcodes"] == want_ops
    ce = sum(1 for p in frames if p[IP].tos & 3 == 3)
    assert doc["ecn"]["ce"] == ce and doc["ecn"]["ect0"] == len(frames) - ce
    assert doc["dscp"] == {"26": len(frames)}
    # one sender, one receiver
    assert [(r["nic"], r["tx_packets"], r["rx_packets"]) for r in doc["nics"]] == \
        [("10.0.0.1", len(frames), 0), ("10.1.0.1", 0, len(frames))]


def test_capture_messages_split_across_batches(capture_file, monkeypatch):
    """Message reassembly carries partial messages from one batch to the next."""
    from wiretrace.analysis import sources

    path, _, sizes = capture_file
    monkeypatch.setattr(sources, "CAPTURE_BATCH_FRAMES", 3)
    seen = []
    real = sources._capture_batch
    monkeypatch.setattr(sources, "_capture_batch", lambda cols, ids: seen.append(len(cols["row"])) or real(cols, ids))
    doc = summarize(path)
    assert max(seen) == 3 and sum(seen) == doc["totals"]["packets"]
    assert doc["message_sizes"]["count"] == len(sizes) and doc["message_sizes"]["sum"] == sum(sizes)


def test_real_roce_vectors_summarize():
    r = cli("summarize", str(REAL / "scapy_roce_test_vectors.pcap"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["totals"]["packets"] == 2
    assert doc["totals"]["bytes"] == 78 + 74            # UDP length 44 + 20 + 14; CNP 40 + 20 + 14
    assert doc["opcodes"] == {"UC_SEND_ONLY": 1, "CNP": 1}
    assert doc["cnps"] == 1 and doc["acks"] == 0
    cnp = [f for f in doc["flows"] if f["dest_qp"] == 0x118]
    assert len(cnp) == 1 and cnp[0]["udp_sport"] == 0 and cnp[0]["bytes"] == 74
    assert doc["ecn"]["ect0"] >= 1                      # the CNP's TOS 0xc2: DSCP 48, ECT(0)
    assert doc["dscp"].get("48") == 1
    assert doc["message_sizes"]["count"] == 1 and doc["message_sizes"]["sum"] == 18
    r = cli("summarize", str(REAL / "scapy_roce_test_vectors.pcap"))
    assert r.returncode == 0 and "CNP" in r.stdout and "UC_SEND_ONLY" in r.stdout


def test_capture_errors(tmp_path, capture_file):
    r = cli("summarize", str(tmp_path / "missing.pcap"))
    assert r.returncode == 2 and r.stderr.strip().endswith("missing.pcap: no such file")
    bad = tmp_path / "x.pcap"
    bad.write_bytes(b"not a capture at all")
    r = cli("summarize", str(bad))
    assert r.returncode == 2 and "not a capture" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("summarize", str(capture_file[0]), "--by", "parallelism")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: --by parallelism needs a wiretrace Parquet directory")
    r = cli("summarize", str(tmp_path), "--json")
    assert r.returncode == 2 and "not a wiretrace Parquet directory (missing packets.parquet" in r.stderr
    r = cli("summarize", str(capture_file[0]), "--line-rate", "fast")
    assert r.returncode == 2 and "--line-rate" in r.stderr


def test_timeline_keeps_sums_while_coarsening():
    from wiretrace.analysis.summary import _Timeline

    rng = np.random.default_rng(5)
    tl = _Timeline(max_bins=256, width_ns=1000, max_cells=256 * 64)
    want = np.zeros(300)
    t = 0
    for _ in range(20):
        n = 5000
        ts = t + np.cumsum(rng.integers(1, 500, n))
        t = int(ts[-1])
        key = rng.integers(0, 300, n)
        nb = rng.integers(60, 4000, n).astype(float)
        tl.add(ts, key, nb)
        np.add.at(want, key, nb)
    assert tl.bins.shape == (300, 64)                      # 300 series: 64 bins each
    assert tl.width * 64 > t - tl.origin                   # the span still fits
    assert np.allclose(tl.bins.sum(axis=1), want)


# ---------------------------------------------------------------------------------------------
# generated captures against the Parquet tables they came from
# ---------------------------------------------------------------------------------------------

PLAN = Path(__file__).resolve().parents[1] / "samples" / "plans" / "gpt2-small-2x4.json"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    r = cli("generate", "--plan", str(PLAN), "-o", str(d / "iter.pcap"), "-q")
    assert r.returncode == 0, r.stderr
    return d / "iter.pcap", d / "iter.parquet"


def np_table(path, columns):
    t = pq.read_table(path, columns=columns)
    return {c: t.column(c).to_numpy() for c in columns}


def test_generated_capture_summary_agrees_with_parquet_tables(generated):
    from wiretrace import topology
    from wiretrace.plan import load

    cap, pqdir = generated
    plan = load(PLAN)
    topo = topology.build(plan)
    doc = summarize(cap, plan=plan)
    pk = np_table(pqdir / "packets.parquet", ["src_nic", "dst_nic", "udp_sport", "dest_qp", "frame_len",
                                              "payload_len", "opcode"])
    assert doc["totals"]["packets"] == len(pk["frame_len"]) > 100_000
    assert doc["totals"]["bytes"] == int(pk["frame_len"].sum())
    assert doc["totals"]["payload_bytes"] == int(pk["payload_len"].sum())
    # flows from the packets table, grouped by pyarrow
    t = pq.read_table(pqdir / "packets.parquet").group_by(["src_nic", "dst_nic", "udp_sport", "dest_qp"]) \
        .aggregate([("frame_len", "sum"), ("frame_len", "count")]).to_pylist()
    want = {(topo.ipv4_str(r["src_nic"]), topo.ipv4_str(r["dst_nic"]), r["udp_sport"], r["dest_qp"]):
            (r["frame_len_count"], r["frame_len_sum"]) for r in t}
    got = {(f["src"], f["dst"], f["udp_sport"], f["dest_qp"]): (f["packets"], f["bytes"]) for f in doc["flows"]}
    assert got == want
    for r in doc["nics"]:
        nic = r["nic_index"]
        assert r["nic"] == topo.ipv4_str(nic) and r["node"] == int(topo.nic_node[nic])
        assert r["tx_bytes"] == int(pk["frame_len"][pk["src_nic"] == nic].sum())
        assert r["rx_bytes"] == int(pk["frame_len"][pk["dst_nic"] == nic].sum())
        assert r["tx_packets"] == int((pk["src_nic"] == nic).sum())
    counts = np.bincount(pk["opcode"], minlength=256)
    assert sum(doc["opcodes"].values()) == len(pk["opcode"])
    assert doc["acks"] == counts[0x11]
    # messages reassembled from the capture's opcodes = the network messages of the table
    msgs = np_table(pqdir / "messages.parquet", ["link", "wire_bytes"])
    net = msgs["link"] == "network"
    assert doc["message_sizes"]["count"] == int(net.sum())
    assert doc["message_sizes"]["sum"] == int(msgs["wire_bytes"][net].sum())
    # node x node matrix from the table
    m = np.zeros((2, 2), dtype=np.int64)
    np.add.at(m, (topo.nic_node[pk["src_nic"]], topo.nic_node[pk["dst_nic"]]), pk["frame_len"])
    assert doc["matrix"]["nodes"] == ["node0", "node1"] and doc["matrix"]["bytes"] == m.tolist()


def test_generated_parquet_summary_equals_capture_summary(generated):
    from wiretrace.plan import load

    cap, pqdir = generated
    plan = load(PLAN)
    a = summarize(cap, plan=plan)
    b = summarize(pqdir, plan=plan)
    for key in ("totals", "flows", "nics", "burstiness", "onoff", "opcodes", "ecn", "matrix", "flow_sizes"):
        assert a[key] == b[key], key
    ma, mb = dict(a["message_sizes"]), dict(b["message_sizes"])
    assert (ma.pop("source"), mb.pop("source")) == ("capture", "messages.parquet")
    assert ma == mb
    assert b["line_rate_bps"] == 400e9


def test_generated_bytes_by_parallelism_and_phase_from_joined_tables(generated):
    _, pqdir = generated
    pk = pq.read_table(pqdir / "packets.parquet", columns=["msg_id", "frame_len"])
    msgs = pq.read_table(pqdir / "messages.parquet", columns=["msg_id", "op_id"])
    coll = pq.read_table(pqdir / "collectives.parquet", columns=["op_id", "parallelism", "phase"])
    coll = coll.cast(pa_schema_strings(coll.schema))
    j = pk.join(msgs, "msg_id").join(coll, "op_id")
    assert j.num_rows == pk.num_rows
    for g in ("parallelism", "phase"):
        want = {r[g]: r["frame_len_sum"] for r in j.group_by(g).aggregate([("frame_len", "sum")]).to_pylist()}
        doc = summarize(pqdir, by=g)
        assert {r[g]: r["bytes"] for r in doc["by"]["rows"]} == want


def pa_schema_strings(schema):
    import pyarrow as pa

    return pa.schema([pa.field(f.name, pa.string() if pa.types.is_dictionary(f.type) else f.type) for f in schema])


def test_generated_pcapng_and_native_ib_erf(generated, tmp_path):
    """The same window as pcap and pcapng summarizes alike; a native InfiniBand ERF capture names
    ports by LID and agrees with its packets table."""
    from wiretrace.plan import load

    t0 = int(np_table(generated[1] / "packets.parquet", ["ts_ns"])["ts_ns"].min())   # first 30 µs of traffic
    window = f"{t0}:{t0 + 30_000}"
    for fmt in ("pcap", "pcapng"):
        r = cli("generate", "--plan", str(PLAN), "-o", str(tmp_path / f"w.{fmt}"), "--window", window, "-q",
                "--no-parquet")
        assert r.returncode == 0, r.stderr
    a, b = summarize(tmp_path / "w.pcap"), summarize(tmp_path / "w.pcapng")
    assert b["input"]["format"] == "pcapng"
    for key in ("totals", "flows", "nics", "burstiness", "opcodes", "message_sizes"):
        assert a[key] == b[key], key

    doc = json.loads(PLAN.read_text())
    doc["transport"] = {"kind": "ib", "path_mtu": 4096}
    ib_plan = tmp_path / "ib.json"
    ib_plan.write_text(json.dumps(doc))
    r = cli("generate", "--plan", str(ib_plan), "-o", str(tmp_path / "ib.erf"), "--window", window, "-q")
    assert r.returncode == 0, r.stderr
    s = summarize(tmp_path / "ib.erf", plan=load(ib_plan))
    assert s["input"]["format"] == "erf"
    pk = np_table(tmp_path / "ib.parquet" / "packets.parquet", ["src_nic", "dst_nic", "dest_qp", "frame_len"])
    assert s["totals"]["packets"] == len(pk["frame_len"]) > 0
    assert s["totals"]["bytes"] == int(pk["frame_len"].sum())
    assert s["totals"]["wire_bytes"] == s["totals"]["bytes"]         # no Ethernet overhead on IB links
    want = {}
    for src, dst, q, fl in zip(pk["src_nic"], pk["dst_nic"], pk["dest_qp"], pk["frame_len"]):
        k = (f"lid {src + 1}", f"lid {dst + 1}", -1, int(q))          # LID = global NIC index + 1
        p, b = want.get(k, (0, 0))
        want[k] = (p + 1, b + int(fl))
    assert {(f["src"], f["dst"], f["udp_sport"], f["dest_qp"]): (f["packets"], f["bytes"]) for f in s["flows"]} == want
    assert [r["nic_index"] for r in s["nics"]] == list(range(8))


def test_reordered_input_is_counted_and_summarized_alike():
    from wiretrace.analysis.summary import Endpoints, Summary

    rng = np.random.default_rng(11)
    n = 3000
    ts = np.sort(rng.integers(0, 2_000_000, n))
    src = rng.integers(0, 3, n)
    batch = dict(ts_ns=ts, src=src, dst=(src + 1) % 3, udp_sport=49200 + src, dest_qp=src + 7,
                 opcode=np.full(n, 0x0A, np.uint8), payload_len=np.full(n, 1000), frame_len=np.full(n, 1070),
                 ecn=np.full(n, 2), dscp=np.full(n, 26))

    def run(order, parts):
        eps = Endpoints()
        for i in range(3):
            eps.get(i, f"nic{i}", i, 0)
        s = Summary(eps, line_rate_bps=100e9)
        for part in np.array_split(order, parts):
            s.add({k: v[part] for k, v in batch.items()})
        return s.result()

    a = run(np.arange(n), 1)
    swapped = np.arange(n)
    swapped[[10, 11]] = swapped[[11, 10]]              # one frame stamped before its predecessor
    b = run(swapped, 1)
    assert a["totals"]["out_of_order_packets"] == 0
    assert b["totals"]["out_of_order_packets"] == int(ts[10] < ts[11])
    for key in ("flows", "nics", "burstiness", "onoff"):
        assert a[key] == b[key], key
    c = run(rng.permutation(n), 1)                     # shuffled within one batch: sorted before use
    assert c["burstiness"] == a["burstiness"] and c["onoff"] == a["onoff"]
    assert c["totals"]["out_of_order_packets"] > n // 2


def test_parquet_directory_with_its_plan(generated, tmp_path):
    """generate writes plan.json beside the tables: summarize and plot take the line rate and the
    NIC addresses from it without --plan."""
    import shutil

    _, pqdir = generated
    assert (pqdir / "plan.json").is_file()
    doc = summarize(pqdir)
    assert doc["line_rate_bps"] == 400e9 and doc["nics"][0]["nic"] == "10.0.0.1"
    pk = np_table(pqdir / "packets.parquet", ["ts_ns", "src_nic", "frame_len"])
    span = int(pk["ts_ns"].max() - pk["ts_ns"].min())
    for r in doc["nics"]:
        wire = pk["frame_len"][pk["src_nic"] == r["nic_index"]].astype(np.int64) + 24
        assert r["tx_utilization"] == pytest.approx(wire.sum() * 8e9 / span / 400e9)
    r = cli("summarize", str(pqdir))
    assert r.returncode == 0, r.stderr
    assert "400.00 Gb/s" in r.stdout and f"{100 * doc['nics'][0]['tx_utilization']:.2f} %" in r.stdout
    r = cli("plot", str(pqdir), "-o", str(tmp_path / "figs"), "--html", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr
    assert "<td>400.00 Gb/s</td>" in (tmp_path / "r.html").read_text()
    # without the plan the tables still summarize, by NIC index and without a line rate
    d = tmp_path / "without_plan"
    shutil.copytree(pqdir, d)
    (d / "plan.json").unlink()
    bare = summarize(d)
    assert bare["line_rate_bps"] is None and bare["nics"][0]["nic"] == "nic0"
    assert bare["nics"][0]["tx_utilization"] is None


def test_acks_naks_and_rnr_naks_from_aeth(tmp_path):
    from scapy.contrib.roce import AETH

    def ack(syndrome, psn):
        p = (Ether() / IP(src="10.1.0.1", dst="10.0.0.1", tos=0x6a) / UDP(sport=50001, dport=4791, chksum=0) /
             BTH(opcode=0x11, dqpn=0x22, psn=psn) / AETH(syndrome=syndrome, msn=psn))
        p.time = 1.0 + psn * 1e-6
        return p
    # ACK (credit count 0x1f), NAK PSN sequence error (0x60), NAK remote access error (0x62),
    # RNR NAK with timer 0x0e (0x2e), IBTA vol. 1 table 44
    frames = [ack(0x1F, 0), ack(0x1F, 1), ack(0x60, 2), ack(0x62, 3), ack(0x2E, 4)]
    wrpcap(str(tmp_path / "acks.pcap"), frames)
    doc = summarize(tmp_path / "acks.pcap")
    assert doc["acks"] == 5 and doc["opcodes"] == {"RC_ACKNOWLEDGE": 5}
    assert doc["naks"] == {"rnr_nak": 1, "nak_psn_sequence_error": 1, "nak_other": 1}
    assert doc["message_sizes"]["count"] == 0


def test_non_roce_frames_are_counted_and_skipped(capture_file, tmp_path):
    from scapy.layers.inet import TCP
    from scapy.layers.l2 import ARP

    path, frames, sizes = capture_file
    other = [Ether() / ARP(pdst="10.0.0.2"), Ether() / IP(src="10.0.0.1", dst="10.0.0.9") / TCP(dport=22),
             Ether() / IP(src="10.0.0.1", dst="10.0.0.9") / UDP(sport=1234, dport=53) / Raw(b"x" * 20)]
    for i, p in enumerate(other):
        p.time = frames[0].time + (i + 1) * 1e-7
    mixed = tmp_path / "mixed.pcap"
    wrpcap(str(mixed), [frames[0], *other, *frames[1:]])
    doc = summarize(mixed)
    assert doc["input"]["frames"] == len(frames) + 3
    assert doc["input"]["skipped"] == {"not RoCEv2/InfiniBand": 3}
    assert doc["totals"]["packets"] == len(frames)
    assert doc["message_sizes"]["sum"] == sum(sizes)
    r = cli("summarize", str(mixed))
    assert r.returncode == 0 and "frames skipped: 3 not RoCEv2/InfiniBand" in r.stdout


@pytest.mark.parametrize("cmd", ["summarize", "plot"])
@pytest.mark.parametrize("args, msg", [
    (["--timescales", "0us"], "error: --timescales 0us: a window width must be at least 1 ns"),
    (["--timescales", "1us,0.1ns"], "error: --timescales 0.1ns: a window width must be at least 1 ns"),
    (["--timescales", " , "], "error: --timescales: expected window widths like 1us,10us,1ms, got ' , '"),
    (["--timescales", "1us,1000ns"], "error: --timescales: 1000ns is given twice"),
    (["--timescales", "fast"], "error: --timescales: expected a duration like 2us or 500ns, got 'fast'"),
    (["--idle-gap", "-1us"], "error: --idle-gap: expected a duration like 2us or 500ns, got '-1us'"),
    (["--line-rate", "0Gbps"], "error: --line-rate: expected a rate above zero, got '0Gbps'"),
])
def test_bad_analysis_options_are_one_line_exit_2(capture_file, tmp_path, cmd, args, msg):
    extra = ["-o", str(tmp_path / "figs")] if cmd == "plot" else []
    r = cli(cmd, str(capture_file[0]), *extra, *args)
    assert r.returncode == 2 and r.stderr.strip() == msg, r.stderr
    assert not (tmp_path / "figs").exists()


def test_bad_summarize_and_plot_targets_are_one_line_exit_2(capture_file, tmp_path):
    r = cli("summarize", str(capture_file[0]), "--flows", "-3")
    assert r.returncode == 2 and r.stderr.strip() == "error: --flows -3: expected 0 or more flows to list"
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    r = cli("plot", str(capture_file[0]), "-o", str(afile))
    assert r.returncode == 2 and r.stderr.strip() == f"error: -o {afile}: is a file; expected a directory for the figures"
    r = cli("plot", str(capture_file[0]), "-o", str(tmp_path / "figs"), "--html", str(tmp_path / "no" / "r.html"))
    assert r.returncode == 2 and r.stderr.strip() == (f"error: --html {tmp_path / 'no' / 'r.html'}: directory "
                                                      f"{tmp_path / 'no'} does not exist")
    assert not (tmp_path / "figs").exists()           # refused before any figure was written


def test_burstiness_refuses_zero_timescale_with_wiretrace_error():
    from wiretrace.errors import WiretraceError

    with pytest.raises(WiretraceError, match="at least 1 ns"):
        Burstiness(timescales_ns=(0, 1000))
    with pytest.raises(WiretraceError, match="at least 0 ns"):
        Burstiness(idle_gap_ns=-1)


def test_by_node_needs_the_plan_for_captures(generated, tmp_path):
    cap, pqdir = generated
    # beside the tables generate wrote (X.parquet/plan.json): that plan is used, and said so
    beside = cap.with_name(cap.stem + ".parquet") / "plan.json"
    assert beside.is_file()
    r = cli("summarize", str(cap), "--by", "node")
    assert r.returncode == 0 and r.stderr.splitlines() == [
        f"note: using the plan {beside} (give --plan to choose another)"]
    # alone, it needs --plan
    alone = tmp_path / "alone.pcap"
    alone.write_bytes(cap.read_bytes())
    r = cli("summarize", str(alone), "--by", "node")
    assert r.returncode == 2 and r.stderr.strip() == (f"error: --by node needs the plan {alone} was generated "
                                                      "from (--plan PLAN) to map NIC addresses to nodes")
    assert r.stdout == ""
    # a capture whose addresses are not the plan's NICs
    other = tmp_path / "other.pcap"
    wrpcap(str(other), send_message_frames(3000, 50001, 0x11, 0, src="192.168.7.1", dst="192.168.7.2"))
    r = cli("summarize", str(other), "--by", "node", "--plan", str(PLAN))
    assert r.returncode == 2 and "--by node: 2 address(es)" in r.stderr and "(first: 192.168.7.1)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # with the plan: nodes by the plan's placement (4 NICs per node), same bytes as the tables
    r = cli("summarize", str(cap), "--by", "node", "--plan", str(PLAN), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["by"]["rows"]
    pk = np_table(pqdir / "packets.parquet", ["src_nic", "frame_len"])
    assert [x["node"] for x in rows] == ["node0", "node1"]
    assert [x["tx_bytes"] for x in rows] == [int(pk["frame_len"][pk["src_nic"] // 4 == n].sum()) for n in (0, 1)]
    # a Parquet directory knows each NIC's node from its messages table
    r = cli("summarize", str(pqdir), "--by", "node", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["by"]["rows"] == rows


def test_timescale_longer_than_the_capture_has_no_variability(capture_file):
    """The capture spans about 1.5 ms: at 10 ms there is one window, so peak-to-mean, CoV and IDC
    are undefined (None, "n/a"), not 1 and 0; at 1 ms there are two."""
    path, frames, _ = capture_file
    span_ns = (frames[-1].time - frames[0].time) * 1e9
    assert 1e6 < span_ns < 2e6
    doc = summarize(path)
    rows = {r["timescale_ns"]: r for r in doc["burstiness"] if r["direction"] == "tx"}
    assert rows[10_000_000]["windows"] == 1
    assert (rows[10_000_000]["peak_to_mean"], rows[10_000_000]["cov"], rows[10_000_000]["index_of_dispersion"]) == \
        (None, None, None)
    assert rows[1_000_000]["windows"] == 2 and rows[1_000_000]["cov"] > 0
    r = cli("summarize", str(path))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "10 ms" in x and "tx" in x)
    assert "n/a (fewer than 2 windows)" in line


def test_cut_off_capture_is_one_warning_line(capture_file, tmp_path):
    """A capture that ends inside a record (still being written, or cut by a copy) is summarized
    up to its last complete frame with one warning line, not a Python warning."""
    path, frames, _ = capture_file
    data = path.read_bytes()
    cut = tmp_path / "c_trunc.pcap"
    cut.write_bytes(data[:-100])                  # the last record loses its last 100 bytes
    r = cli("summarize", str(cut), "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == f"warning: {cut} is cut off after {len(frames) - 1:,} frames; summarized what was complete\n"
    doc = json.loads(r.stdout)
    assert doc["input"]["cut_off_after_frames"] == len(frames) - 1
    assert doc["totals"]["packets"] == len(frames) - 1
    assert doc["totals"]["bytes"] == sum(len(bytes(p)) for p in frames[:-1])
    r = cli("plot", str(cut), "-o", str(tmp_path / "figs"))
    assert r.returncode == 0 and r.stderr.startswith(f"warning: {cut} is cut off after") and \
        len(r.stderr.splitlines()) == 1
    assert "cut_off_after_frames" not in summarize(path)["input"]
