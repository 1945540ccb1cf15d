"""Capture writers: pcap (ns), pcapng (interface per NIC), ERF type 21, split per NIC, rotation,
atomic output, determinism. Files are read back with dpkt, with plain ``struct`` parsing of the
published layouts, and with tshark."""

from __future__ import annotations

import struct

import dpkt
import numpy as np
import pytest

from wiretrace.errors import WiretraceError
from wiretrace.io import write_capture
from wiretrace.io import pcap as pcap_mod
from wiretrace.transport import render

from test_transport import all_packets, make_messages, make_plan, serial_messages, tshark_fields


@pytest.fixture(scope="module")
def roce():
    plan, topo = make_plan(nodes=2, nics=2)
    m = make_messages([5000, 100, 3000, 8000, 64, 2_000_000_123 % 10_000],
                      [0, 1, 2, 3, 0, 1], [2, 3, 0, 1, 3, 2],
                      [1_000_000_000 - 5, 20, 1_500_000_000, 40, 50, 60])
    p = all_packets(m, topo, plan)
    return plan, topo, p


def _chunks(p, size=5):
    n = len(p["ts_ns"])
    return [{k: v[i:i + size] for k, v in p.items()} for i in range(0, n, size)]


def test_pcap_header_records_and_nanosecond_times(tmp_path, roce):
    plan, topo, p = roce
    path = tmp_path / "a.pcap"
    stats = write_capture(path, _chunks(p), topo, plan, snaplen=80)
    data = path.read_bytes()
    magic, major, minor, zone, sigfigs, snap, link = struct.unpack("<IHHiIII", data[:24])
    assert (magic, major, minor, zone, snap, link) == (0xA1B23C4D, 2, 4, 0, 80, 1)
    assert data[:4] == bytes.fromhex("4d3cb2a1")
    assert stats["packets"] == len(p["ts_ns"]) and stats["bytes"] == len(data)
    # walk the records by the published layout
    off, i = 24, 0
    buf, foff, cap, orig = render(p, topo, plan, snaplen=80)
    while off < len(data):
        sec, nsec, incl, olen = struct.unpack("<IIII", data[off:off + 16])
        assert sec * 1_000_000_000 + nsec == p["ts_ns"][i]
        assert incl == min(80, p["frame_len"][i]) and olen == p["frame_len"][i]
        assert data[off + 16:off + 16 + incl] == bytes(buf[foff[i]:foff[i + 1]])
        off += 16 + incl
        i += 1
    assert i == len(p["ts_ns"])
    # dpkt reads it as a nanosecond pcap
    with open(path, "rb") as fh:
        r = dpkt.pcap.Reader(fh)
        assert r.datalink() == 1
        ts = [t for t, _ in r]
    assert float(ts[0]) == pytest.approx(p["ts_ns"][0] / 1e9)
    rows = tshark_fields(path, ["frame.time_epoch", "frame.len", "frame.cap_len"])
    assert [int(r[0].replace(".", "")) for r in rows] == p["ts_ns"].tolist()
    assert [int(r[1]) for r in rows] == p["frame_len"].tolist()
    assert [int(r[2]) for r in rows] == np.minimum(p["frame_len"], 80).tolist()


def test_whole_frames_with_snaplen_zero(tmp_path, roce):
    plan, topo, p = roce
    path = tmp_path / "w.pcap"
    write_capture(path, [p], topo, plan, snaplen=0)
    with open(path, "rb") as fh:
        frames = [bytes(b) for _, b in dpkt.pcap.Reader(fh)]
    assert [len(f) for f in frames] == p["frame_len"].tolist()
    eth = dpkt.ethernet.Ethernet(frames[0])
    assert isinstance(eth.data, dpkt.ip.IP) and eth.data.udp.dport == 4791
    assert eth.data.ttl == 64 and eth.data.df == 1


def test_pcapng_one_interface_per_nic(tmp_path, roce):
    plan, topo, p = roce
    path = tmp_path / "a.pcapng"
    write_capture(path, _chunks(p, 4), topo, plan, snaplen=96)
    data = path.read_bytes()
    off, idbs, epbs = 0, [], []
    while off < len(data):
        btype, total = struct.unpack("<II", data[off:off + 8])
        assert struct.unpack("<I", data[off + total - 4:off + total])[0] == total and total % 4 == 0
        body = data[off + 8:off + total - 4]
        if btype == 0x0A0D0D0A:
            assert struct.unpack("<I", body[:4])[0] == 0x1A2B3C4D
        elif btype == 1:
            link, _, snap = struct.unpack("<HHI", body[:8])
            opts, o = {}, 8
            while o < len(body):
                code, ln = struct.unpack("<HH", body[o:o + 4])
                if code == 0:
                    break
                opts[code] = body[o + 4:o + 4 + ln]
                o += 4 + ln + ((-ln) & 3)
            idbs.append((link, snap, opts[2].decode(), opts[9]))
        elif btype == 6:
            iface, hi, lo, caplen, origlen = struct.unpack("<IIIII", body[:20])
            epbs.append((iface, (hi << 32) | lo, caplen, origlen))
        off += total
    assert [i[2] for i in idbs] == [topo.nic_name(k) for k in range(topo.num_nics)]
    assert {(i[0], i[1], i[3]) for i in idbs} == {(1, 96, b"\x09")}
    assert [e[0] for e in epbs] == p["src_nic"].tolist()
    assert [e[1] for e in epbs] == p["ts_ns"].tolist()
    assert [e[2] for e in epbs] == np.minimum(p["frame_len"], 96).tolist()
    assert [e[3] for e in epbs] == p["frame_len"].tolist()
    rows = tshark_fields(path, ["frame.interface_name", "infiniband.bth.psn", "frame.time_epoch"])
    assert [r[0] for r in rows] == [topo.nic_name(int(k)) for k in p["src_nic"]]
    assert [int(r[1]) for r in rows] == p["psn"].tolist()
    # nanosecond resolution as tshark reads it (seconds.nanoseconds)
    assert [int(r[2].replace(".", "")) for r in rows] == p["ts_ns"].tolist()


def test_erf_type21_records_for_native_ib(tmp_path):
    plan, topo = make_plan({"kind": "ib"})
    p = all_packets(serial_messages([3000, 10]), topo, plan)
    path = tmp_path / "ib.erf"
    write_capture(path, [p], topo, plan, snaplen=0)
    data = path.read_bytes()
    off, i = 0, 0
    while off < len(data):
        ts, rtype, flags, rlen, lctr, wlen = struct.unpack("<QBBHHH", data[off:off + 16])
        rlen, wlen = struct.unpack(">H", data[off + 10:off + 12])[0], struct.unpack(">H", data[off + 14:off + 16])[0]
        assert rtype == 21 and flags & 0x04
        assert rlen == 16 + p["frame_len"][i] and wlen == p["frame_len"][i]
        sec, frac = ts >> 32, ts & 0xFFFFFFFF
        assert abs(sec * 1e9 + frac / 2**32 * 1e9 - p["ts_ns"][i]) < 1
        lrh = data[off + 16:off + 24]
        assert lrh[1] & 3 == 2 and struct.unpack(">H", lrh[2:4])[0] == topo.nic_lid[p["dst_nic"][i]]
        off += rlen
        i += 1
    assert i == len(p["ts_ns"])
    # the same records inside a pcap use link type 197 (LINKTYPE_ERF)
    path2 = tmp_path / "ib.pcap"
    write_capture(path2, [p], topo, plan, snaplen=0)
    assert struct.unpack("<I", path2.read_bytes()[20:24])[0] == 197
    rows = tshark_fields(path, ["erf.types.type", "infiniband.bth.opcode"])
    assert [int(r[1]) for r in rows] == p["opcode"].tolist()


def test_erf_for_rocev2_uses_ethernet_records(tmp_path, roce):
    plan, topo, p = roce
    path = tmp_path / "r.erf"
    write_capture(path, [p], topo, plan, snaplen=0)
    rows = tshark_fields(path, ["infiniband.bth.psn", "frame.len"])
    assert [int(r[0]) for r in rows] == p["psn"].tolist()


@pytest.mark.parametrize("open_files", [256, 1])
def test_split_per_nic(tmp_path, roce, monkeypatch, open_files):
    import wiretrace.io.write as W

    monkeypatch.setattr(W, "MAX_OPEN_FILES", open_files)   # 1: files are closed and reopened
    plan, topo, p = roce
    d = tmp_path / "split"
    stats = write_capture(d, _chunks(p, 3), topo, plan, snaplen=0, split="nic")
    assert stats["packets"] == len(p["ts_ns"])
    seen = 0
    for nic in range(topo.num_nics):
        f = d / (topo.nic_name(nic).replace("/", "-") + ".pcap")
        want = p["src_nic"] == nic
        if not want.any():
            assert not f.exists()
            continue
        with open(f, "rb") as fh:
            recs = list(dpkt.pcap.Reader(fh))
        assert len(recs) == int(want.sum())
        assert [round(float(t) * 1e9) for t, _ in recs] == p["ts_ns"][want].tolist()
        assert all(dpkt.ethernet.Ethernet(b).src == bytes(topo.nic_mac[nic]) for _, b in recs)
        seen += len(recs)
    assert seen == len(p["ts_ns"])


def test_rotation_at_max_file_size(tmp_path, roce):
    plan, topo, p = roce
    path = tmp_path / "r.pcap"
    limit = 3000
    stats = write_capture(path, _chunks(p, 4), topo, plan, snaplen=0, max_file_size=limit)
    files = [tmp_path / "r.pcap"] + [tmp_path / f"r.pcap{i}" for i in range(1, len(stats["files"]))]
    assert [str(f) for f in files] == stats["files"] and len(files) > 3
    total = []
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            recs = list(dpkt.pcap.Reader(fh))
        assert size <= limit or len(recs) == 1          # a lone record may exceed the limit
        total += [len(b) for _, b in recs]
    assert total == p["frame_len"].tolist()


def test_nothing_left_behind_on_error(tmp_path, roce):
    plan, topo, p = roce

    def failing():
        yield _chunks(p)[0]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_capture(tmp_path / "x.pcap", failing(), topo, plan)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(WiretraceError, match="format"):
        write_capture(tmp_path / "x.pcap", [p], topo, plan, fmt="cap")
    with pytest.raises(WiretraceError, match="snaplen"):
        write_capture(tmp_path / "x.pcap", [p], topo, plan, snaplen=-1)
    assert list(tmp_path.iterdir()) == []


def test_same_input_same_bytes(tmp_path, roce):
    plan, topo, p = roce
    for suffix in (".pcap", ".pcapng", ".erf"):
        a, b = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
        write_capture(a, _chunks(p, 2), topo, plan, snaplen=0)
        write_capture(b, [p], topo, plan, snaplen=0)
        assert a.read_bytes() == b.read_bytes()


def test_pcap_write_function_and_progress(tmp_path, roce):
    plan, topo, p = roce
    seen = []
    stats = pcap_mod.write(tmp_path / "p.pcap", _chunks(p, 5), topo, plan, snaplen=128, progress=seen.append)
    assert seen[-1] == stats["packets"] == len(p["ts_ns"])
    assert seen == sorted(seen)
    assert oct((tmp_path / "p.pcap").stat().st_mode & 0o777) != "0o600"


@pytest.mark.parametrize("split", [None, "nic"])
def test_frames_rendered_in_small_pieces_give_the_same_files(tmp_path, roce, monkeypatch, split):
    import wiretrace.io.write as W

    plan, topo, p = roce
    a, b = tmp_path / "a", tmp_path / "b"
    write_capture(a / "x.pcapng" if split is None else a, [p], topo, plan, snaplen=0, split=split)
    monkeypatch.setattr(W, "SLOT_BYTES", 3000)          # about one 1 KiB frame per piece
    write_capture(b / "x.pcapng" if split is None else b, [p], topo, plan, snaplen=0, split=split)
    names = sorted(f.name for f in a.iterdir())
    assert names == sorted(f.name for f in b.iterdir()) and names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes()


@pytest.mark.parametrize("snaplen,max_file_size", [(0, None), (70, None), (0, 6_000)])
def test_rendering_on_the_callers_thread_gives_the_same_files(tmp_path, roce, monkeypatch, snaplen, max_file_size):
    """With one usable CPU (``taskset -c 0``) frames are rendered and written on the caller's
    thread instead of a rendering and a writing thread: the files are byte for byte the same,
    rotated or not."""
    import wiretrace.io.write as W

    plan, topo, p = roce
    chunks = [{k: np.asarray(v)[i:i + 40] for k, v in p.items()} for i in range(0, len(p["ts_ns"]), 40)]
    a, b = tmp_path / "a", tmp_path / "b"
    assert W.usable_cpus() >= 1
    write_capture(a / "x.pcap", iter(chunks), topo, plan, snaplen=snaplen, max_file_size=max_file_size)
    threads = []
    real = W.ThreadPoolExecutor.submit
    monkeypatch.setattr(W.ThreadPoolExecutor, "submit", lambda self, fn, *x: threads.append(fn.__name__) or
                        real(self, fn, *x))
    monkeypatch.setattr(W, "usable_cpus", lambda: 1)
    write_capture(b / "x.pcap", iter(chunks), topo, plan, snaplen=snaplen, max_file_size=max_file_size)
    assert not threads                                    # one CPU: rendered and written in turn
    names = sorted(f.name for f in a.iterdir())
    assert names == sorted(f.name for f in b.iterdir())
    assert (len(names) > 1) == (max_file_size is not None)
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.mark.parametrize("fmt,split,snaplen,kind", [("pcap", None, 0, "rocev2"), ("pcapng", "nic", 0, "rocev2"),
                                                    ("erf", None, 1000, "rocev2"), ("erf", None, 0, "ib"),
                                                    ("pcapng", None, 0, "ib")])
def test_payload_sent_from_the_pattern_gives_the_same_files(tmp_path, roce, monkeypatch, fmt, split, snaplen, kind):
    """Whole frames go out with their payload taken from the pattern by writev (not rendered
    into every row): the files are byte for byte those of rendered payloads, and dpkt reads the
    payload as byte i = i mod 256."""
    import wiretrace.io.write as W

    plan, topo, p = roce
    if kind == "ib":
        plan, topo = make_plan({"kind": "ib"}, subnets=2)
        p = all_packets(serial_messages([5000, 100, 3001, 8000]), topo, plan)
    a, b = tmp_path / "a", tmp_path / "b"
    name = f"x.{fmt}"
    monkeypatch.setattr(W, "BY_REFERENCE_BYTES", 1 << 30)       # never: payload rendered
    write_capture(a / name if split is None else a, [p], topo, plan, snaplen=snaplen, fmt=fmt, split=split,
                  max_file_size=6_000)
    calls = []
    real = W._hole_iovecs
    monkeypatch.setattr(W, "_hole_iovecs", lambda *x: calls.append(1) or real(*x))
    monkeypatch.setattr(W, "BY_REFERENCE_BYTES", 0)             # always: payload from the pattern
    write_capture(b / name if split is None else b, [p], topo, plan, snaplen=snaplen, fmt=fmt, split=split,
                  max_file_size=6_000)
    assert calls
    names = sorted(f.name for f in a.iterdir())
    assert len(names) > 1 and names == sorted(f.name for f in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    if fmt == "pcap":
        with open(b / name, "rb") as fh:
            frames = [bytes(x) for _, x in dpkt.pcap.Reader(fh)]
        mid = [f for f, op in zip(frames, p["opcode"]) if op == 0x07]      # RDMA WRITE MIDDLE
        assert mid and all(f[54:54 + 1024] == bytes(range(256)) * 4 for f in mid)


@pytest.mark.parametrize("suffix", [".pcap", ".pcapng"])
def test_split_per_nic_rotates_each_nic_at_max_file_size(tmp_path, roce, suffix):
    plan, topo, p = roce
    d = tmp_path / "split"
    limit = 3000
    # one chunk holding every frame: a NIC's frames of one chunk still spread over several files
    stats = write_capture(d, [p], topo, plan, snaplen=0, split="nic", max_file_size=limit,
                          fmt=suffix[1:])
    assert stats["packets"] == len(p["ts_ns"])
    assert sorted(stats["files"]) == sorted(str(f) for f in d.iterdir())
    reader = dpkt.pcapng.Reader if suffix == ".pcapng" else dpkt.pcap.Reader
    seen = rotated = 0
    for nic in range(topo.num_nics):
        base = topo.nic_name(nic).replace("/", "-") + suffix
        want = p["src_nic"] == nic
        if not want.any():
            continue
        # tcpdump -C names: base, base1, base2, ... with no gap
        files = [d / base]
        while (d / f"{base}{len(files)}").exists():
            files.append(d / f"{base}{len(files)}")
        rotated += len(files) > 1
        lens = []
        for f in files:
            with open(f, "rb") as fh:
                recs = list(reader(fh))
            assert f.stat().st_size <= limit or len(recs) == 1
            lens += [len(b) for _, b in recs]
        assert lens == p["frame_len"][want].tolist()
        seen += len(lens)
    assert seen == len(p["ts_ns"]) and rotated >= 2


def _pcapng_interfaces(path):
    """(if_name of each Interface Description Block, interface id of each Enhanced Packet Block)."""
    data = path.read_bytes()
    off, names, ifaces = 0, [], []
    while off < len(data):
        btype, total = struct.unpack("<II", data[off:off + 8])
        if btype == 1:                      # IDB: linktype, reserved, snaplen, then options
            o = off + 16
            while o < off + total - 4:
                code, ln = struct.unpack("<HH", data[o:o + 4])
                if code == 2:
                    names.append(data[o + 4:o + 4 + ln].decode())
                if code == 0:
                    break
                o += 4 + ln + ((-ln) & 3)
        elif btype == 6:
            ifaces.append(struct.unpack("<I", data[off + 8:off + 12])[0])
        off += total
    return names, ifaces


def test_split_per_nic_pcapng_declares_only_its_nic(tmp_path, roce):
    plan, topo, p = roce
    d = tmp_path / "split"
    write_capture(d, _chunks(p, 3), topo, plan, snaplen=0, split="nic", fmt="pcapng")
    for nic in np.unique(p["src_nic"]).tolist():
        f = d / (topo.nic_name(nic).replace("/", "-") + ".pcapng")
        names, ifaces = _pcapng_interfaces(f)
        assert names == [topo.nic_name(nic)]
        assert ifaces == [0] * int((p["src_nic"] == nic).sum())
        rows = tshark_fields(f, ["frame.interface_name"])
        assert {r[0] for r in rows} == {topo.nic_name(nic)}
    # one capture of everything keeps one interface per NIC
    names, ifaces = _pcapng_interfaces(_whole(tmp_path, p, topo, plan))
    assert names == [topo.nic_name(i) for i in range(topo.num_nics)]
    assert ifaces == p["src_nic"].tolist()


def _whole(tmp_path, p, topo, plan):
    path = tmp_path / "all.pcapng"
    write_capture(path, [p], topo, plan, snaplen=0)
    return path


def test_payload_by_reference_needs_about_two_iovecs_a_record(roce, monkeypatch):
    """Whole frames: a record's headers, the payload pattern, then its trailer run on into the
    next record's headers as one range: 2 iovecs a record with payload, 1 more for each record
    without, and they hold exactly the records' bytes."""
    import wiretrace.io.write as W

    plan, topo, p = roce
    monkeypatch.setattr(W, "BY_REFERENCE_BYTES", 0)
    fmt = W.make_format("pcap", topo, plan, 0)
    slots, reclen, holes = W._records(fmt, p, None)
    assert holes is not None
    n = len(reclen)
    with_payload = int((holes[1] > 0).sum())
    iov = W._hole_iovecs(slots, np.arange(n), reclen, holes)
    assert int(iov[:, 1].sum()) == int(reclen.sum())
    assert len(iov) <= 2 * with_payload + 2 * (n - with_payload) + 1
    assert len(iov) < 3 * with_payload
