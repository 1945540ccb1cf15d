"""Capture reading: pcap (µs/ns, both byte orders), pcapng (interfaces, resolutions, SPB), ERF.

Files are built here byte by byte from the published format descriptions (libpcap file format,
pcapng draft, Endace ERF) so that the reader is checked against the formats, and tshark reads the
same files as the reference for timestamps, lengths and interfaces.
"""

from __future__ import annotations

import struct
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import require_tool

from wiretrace.errors import InputFormatError
from wiretrace.io import capture
from wiretrace.io.capture import (LINKTYPE_ETHERNET, LINKTYPE_INFINIBAND, TruncatedCaptureWarning,
                                  iter_frames, open_capture)

REAL = Path(__file__).resolve().parents[2] / "shared" / "real" / "roce_packets"


def real_frames() -> list[bytes]:
    lines = (REAL / "scapy_roce_test_vectors.hex").read_text().splitlines()
    return [bytes.fromhex(line) for line in lines if line and not line.startswith("#")]


def tshark() -> str:
    return require_tool("tshark")


def tshark_fields(path: Path, *fields: str) -> list[list[str]]:
    cmd = [tshark(), "-r", str(path), "-T", "fields", "-E", "separator=|"]
    for f in fields:
        cmd += ["-e", f]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [line.split("|") for line in out.splitlines()]


def all_frames(path, **kw):
    out = {k: [] for k in ("ts", "caplen", "origlen", "linktype", "iface", "bytes", "names")}
    for b in iter_frames(path, **kw):
        out["ts"] += b.ts_ns.tolist()
        out["caplen"] += b.caplen.tolist()
        out["origlen"] += b.origlen.tolist()
        out["linktype"] += b.linktype.tolist()
        out["iface"] += b.iface.tolist()
        out["names"] += b.iface_names().tolist()
        out["bytes"] += [b.frame(i) for i in range(len(b))]
    return out


# -- writers used by the tests (from the format descriptions) --------------------------------

def pcap_bytes(frames, ts_ns, order="<", nano=True, linktype=1, snaplen=65535, origlens=None):
    magic = 0xA1B23C4D if nano else 0xA1B2C3D4
    out = [struct.pack(order + "IHHiIII", magic, 2, 4, 0, 0, snaplen, linktype)]
    for i, (f, t) in enumerate(zip(frames, ts_ns)):
        frac = t % 10**9 if nano else (t % 10**9) // 1000
        orig = origlens[i] if origlens else len(f)
        out.append(struct.pack(order + "IIII", t // 10**9, frac, len(f), orig) + f)
    return b"".join(out)


def pad4(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 4)


def ng_block(order, btype, body):
    n = 12 + len(body)
    return struct.pack(order + "II", btype, n) + body + struct.pack(order + "I", n)


def ng_option(order, code, value: bytes):
    return struct.pack(order + "HH", code, len(value)) + pad4(value)


def ng_shb(order):
    return ng_block(order, 0x0A0D0D0A, struct.pack(order + "IHHq", 0x1A2B3C4D, 1, 0, -1))


def ng_idb(order, name, tsresol, linktype=1, snaplen=0):
    opts = ng_option(order, 2, name.encode()) + ng_option(order, 9, bytes([tsresol]))
    opts += ng_option(order, 0, b"")
    return ng_block(order, 1, struct.pack(order + "HHI", linktype, 0, snaplen) + opts)


def ng_epb(order, iface, ts_units, frame, origlen=None):
    body = struct.pack(order + "IIIII", iface, ts_units >> 32, ts_units & 0xFFFFFFFF, len(frame),
                       origlen if origlen is not None else len(frame))
    return ng_block(order, 6, body + pad4(frame))


def ng_spb(order, frame):
    return ng_block(order, 3, struct.pack(order + "I", len(frame)) + pad4(frame))


def erf_record(ts_ns, erf_type, payload, wlen=None, flags=0x04, eth=False):
    sec, ns = divmod(ts_ns, 10**9)
    frac = (ns << 32) // 10**9 + 1  # a hair above, so rounding to nearest gives ns back
    body = (b"\0\0" if eth else b"") + payload
    body += b"\0" * (-(16 + len(body)) % 8)  # records padded to 8 bytes as DAG cards write them
    rlen = 16 + len(body)
    head = struct.pack("<Q", (sec << 32) | frac) + struct.pack(
        ">BBHHH", erf_type, flags, rlen, 0, wlen if wlen is not None else len(payload))
    return head + body


# An InfiniBand packet: LRH (VL 0, LNH 2 = BTH follows, DLID 1, PktLen 7 words, SLID 2), BTH
# (RC SEND ONLY, P_Key 0xFFFF, DestQP 0x000d2a, PSN 7), 4 B payload, ICRC and VCRC (not checked
# here: the frame is only carried).
IB_FRAME = bytes.fromhex("0002 0001 0007 0002 04 00 ffff 00 000d2a 00000007 deadbeef 00000000 0000")


# -- tests ------------------------------------------------------------------------------------

def test_real_pcap_frames_timestamps_and_bytes():
    got = all_frames(REAL / "scapy_roce_test_vectors.pcap")
    assert got["bytes"] == real_frames()
    assert got["caplen"] == [78, 74] and got["origlen"] == [78, 74]
    assert got["linktype"] == [LINKTYPE_ETHERNET] * 2
    # pcap µs header: 0x6b0ccb42 s + 903760 µs, then + 903920 µs
    assert got["ts"] == [0x6B0CCB42 * 10**9 + 903_760_000, 0x6B0CCB42 * 10**9 + 903_920_000]
    shown = tshark_fields(REAL / "scapy_roce_test_vectors.pcap", "frame.time_epoch", "frame.len")
    assert [int(l) for _, l in shown] == got["origlen"]
    assert [round(float(t) * 1e6) for t, _ in shown] == [t // 1000 for t in got["ts"]]


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("nano", [True, False])
def test_pcap_both_byte_orders_and_resolutions(tmp_path, order, nano):
    frames = real_frames() * 3
    ts = [1_700_000_000_123_456_789 + 1001 * i for i in range(6)]
    path = tmp_path / "x.pcap"
    path.write_bytes(pcap_bytes(frames, ts, order=order, nano=nano))
    got = all_frames(path)
    assert got["bytes"] == frames
    want = ts if nano else [t // 1000 * 1000 for t in ts]
    assert got["ts"] == want
    with open_capture(path) as cap:
        assert cap.format == ("pcap-ns" if nano else "pcap")
    shown = tshark_fields(path, "frame.time_epoch")
    # tshark prints 9 decimals; compare as integers of ns via the text, not float arithmetic
    assert [int(t[0].replace(".", "")) for t in shown] == want


def test_pcap_snaplen_truncated_frames_keep_origlen(tmp_path):
    frames = real_frames()
    cut = [f[:54] for f in frames]
    path = tmp_path / "snap.pcap"
    path.write_bytes(pcap_bytes(cut, [0, 1], snaplen=54, origlens=[len(f) for f in frames]))
    got = all_frames(path)
    assert got["caplen"] == [54, 54] and got["origlen"] == [78, 74]
    assert got["bytes"] == cut


@pytest.mark.parametrize("order", ["<", ">"])
def test_pcapng_interfaces_resolutions_and_spb(tmp_path, order):
    f1, f2 = real_frames()
    t = 1_700_000_000_000_000_000
    data = ng_shb(order)
    data += ng_idb(order, "mlx5_0", 9)            # ns
    data += ng_idb(order, "mlx5_1", 6)            # µs
    data += ng_idb(order, "ib0", 0x80 | 30, snaplen=128)  # 2^-30 s
    data += ng_block(order, 5, b"\0" * 20)        # an Interface Statistics Block: skipped
    data += ng_epb(order, 0, t + 5, f1)
    data += ng_epb(order, 1, (t + 7000) // 1000, f2)
    units = ((t + 123_456_789) << 30) // 10**9 + 1
    data += ng_epb(order, 2, units, f1[:40], origlen=len(f1))
    path = tmp_path / "x.pcapng"
    path.write_bytes(data)
    got = all_frames(path)
    assert got["iface"] == [0, 1, 2]
    assert got["names"] == ["mlx5_0", "mlx5_1", "ib0"]
    assert got["ts"] == [t + 5, t + 7000, t + 123_456_789]
    assert got["caplen"] == [78, 74, 40] and got["origlen"] == [78, 74, 78]
    assert got["bytes"] == [f1, f2, f1[:40]]
    shown = tshark_fields(path, "frame.interface_name", "frame.time_epoch", "frame.cap_len")
    assert [s[0] for s in shown] == got["names"]
    assert [int(s[1].replace(".", "")) for s in shown] == got["ts"]
    assert [int(s[2]) for s in shown] == got["caplen"]


def test_pcapng_second_section_and_simple_packet_block(tmp_path):
    f1, f2 = real_frames()
    data = ng_shb("<") + ng_idb("<", "a", 9) + ng_epb("<", 0, 10**18, f1)
    data += ng_spb("<", f2)  # no timestamp: the reader keeps the previous one
    data += ng_shb(">") + ng_idb(">", "b", 9) + ng_epb(">", 0, 10**18 + 50, f2)
    path = tmp_path / "two.pcapng"
    path.write_bytes(data)
    got = all_frames(path)
    assert got["bytes"] == [f1, f2, f2]
    assert got["iface"] == [0, 0, 1] and got["names"] == ["a", "a", "b"]
    assert got["ts"] == [10**18, 10**18, 10**18 + 50]


def test_erf_file_infiniband_and_ethernet_records(tmp_path):
    f1, _ = real_frames()
    t = 1_700_000_000_000_000_007
    data = erf_record(t, 21, IB_FRAME)
    data += erf_record(t + 1, 48, b"\0" * 24)               # padding record: skipped
    data += erf_record(t + 2, 2, f1 + b"\0" * 4, eth=True)  # Ethernet, wlen counts the FCS
    data += erf_record(t + 3, 21 | 0x80, struct.pack(">Q", 0x0F << 56) + IB_FRAME,
                       wlen=len(IB_FRAME), flags=0x05)
    path = tmp_path / "ib.erf"
    path.write_bytes(data)
    got = all_frames(path)
    assert got["linktype"] == [LINKTYPE_INFINIBAND, LINKTYPE_ETHERNET, LINKTYPE_INFINIBAND]
    # the extension header of the third record is not part of the frame
    assert got["bytes"] == [IB_FRAME, f1 + b"\0" * 4, IB_FRAME]
    assert got["ts"] == [t, t + 2, t + 3]
    assert got["origlen"] == [len(IB_FRAME), len(f1) + 4, len(IB_FRAME)]
    assert got["names"] == ["erf0", "erf0", "erf1"]
    with open_capture(path) as cap:
        assert cap.format == "erf"
    shown = tshark_fields(path, "frame.time_epoch", "frame.len", "frame.protocols")
    assert [int(s[0].replace(".", "")) for s in shown] == got["ts"]
    assert [int(s[1]) for s in shown] == got["origlen"]
    assert "infiniband" in shown[0][2] and "eth" in shown[1][2]


def test_erf_records_inside_pcap_linktype_197(tmp_path):
    t = 1_700_000_000_999_999_999
    rec = erf_record(t, 21, IB_FRAME)
    path = tmp_path / "ibdump.pcap"
    # the pcap record time is µs; the frame time comes from the ERF header (ns)
    path.write_bytes(pcap_bytes([rec], [t // 1000 * 1000], nano=False, linktype=197))
    got = all_frames(path)
    assert got["bytes"] == [IB_FRAME]
    assert got["linktype"] == [LINKTYPE_INFINIBAND]
    assert got["ts"] == [t]
    shown = tshark_fields(path, "frame.time_epoch", "frame.protocols")
    assert int(shown[0][0].replace(".", "")) == t
    assert "infiniband" in shown[0][1]


def test_batches_are_bounded_and_numbered(tmp_path, monkeypatch):
    monkeypatch.setattr(capture, "_READ_CHUNK", 100)  # force many window refills
    frames = [f + bytes([i]) for i in range(10) for f in real_frames()[:1]]
    path = tmp_path / "many.pcap"
    path.write_bytes(pcap_bytes(frames, list(range(10))))
    batches = list(iter_frames(path, max_frames=3))
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert [b.first for b in batches] == [0, 3, 6, 9]
    assert batches[1].frame_number.tolist() == [4, 5, 6]
    assert [b.frame(i) for b in batches for i in range(len(b))] == frames
    by_bytes = list(iter_frames(path, max_bytes=200))
    assert [len(b) for b in by_bytes] == [3, 3, 3, 1]  # 79-byte frames: the batch closes past 200
    b = batches[0]
    assert b.offsets.dtype == np.int64 and b.offsets.tolist() == [0, 79, 158, 237]
    assert b.data.dtype == np.uint8 and len(b.data) == 237


@pytest.mark.parametrize("cut", [1, 10, 17, 50])
def test_truncated_last_record_is_reported(tmp_path, cut):
    frames = real_frames()
    whole = pcap_bytes(frames, [0, 1])
    path = tmp_path / "cut.pcap"
    path.write_bytes(whole[:-cut])
    with open_capture(path) as cap:
        got = [b.frame(i) for b in cap.batches() for i in range(len(b))]
        assert got == frames[:1]
        tr = cap.truncated
        assert tr is not None and tr.frame == 2 and tr.offset == 24 + 16 + 78
        assert tr.present == 16 + 74 - cut
        assert tr.needed == (16 + 74 if cut <= 74 else 16)
        # the message counts frame bytes on both sides (the 16-byte record header in neither)
        assert tr.frame_needed == 74 and tr.frame_present == 74 - cut
        assert tr.describe() == f"record of frame 2 at byte 118 needs 74 frame bytes, only {74 - cut} present"
    with pytest.warns(TruncatedCaptureWarning, match="record of frame 2 at byte 118"):
        assert sum(len(b) for b in iter_frames(path)) == 1
    with pytest.raises(InputFormatError, match="cut.pcap: capture truncated"):
        for _ in iter_frames(path, on_truncated="raise"):
            pass


def test_truncated_pcapng_and_erf(tmp_path):
    f1, f2 = real_frames()
    data = ng_shb("<") + ng_idb("<", "a", 9) + ng_epb("<", 0, 1, f1) + ng_epb("<", 0, 2, f2)
    path = tmp_path / "cut.pcapng"
    path.write_bytes(data[:-7])
    with open_capture(path) as cap:
        assert sum(len(b) for b in cap.batches()) == 1
        assert cap.truncated.frame == 2
        # the 74-byte frame sits after the block's 28 header bytes, padded to 76, then 4 trailer bytes
        assert (cap.truncated.needed, cap.truncated.present) == (108, 101)
        at = len(data) - len(ng_epb("<", 0, 2, f2))
        assert cap.truncated.describe() == f"record of frame 2 at byte {at} needs 74 frame bytes, only 73 present"
    erf = erf_record(5, 21, IB_FRAME) * 2
    path = tmp_path / "cut.erf"
    path.write_bytes(erf[:-3])
    with open_capture(path) as cap:
        assert sum(len(b) for b in cap.batches()) == 1
        assert cap.truncated.needed == len(erf) // 2
        # 16-byte ERF header, the 30-byte frame, 2 bytes of padding
        assert (cap.truncated.frame_needed, cap.truncated.frame_present) == (30, 29)
        assert cap.truncated.describe() == "record of frame 2 at byte 48 needs 30 frame bytes, only 29 present"
    for cut, message in ((20, "needs 30 frame bytes, only 12 present"),
                         (2, "holds its 30 frame bytes but ends 2 bytes short of the record's 48")):
        path.write_bytes(erf[:-cut])
        with open_capture(path) as cap:
            assert sum(len(b) for b in cap.batches()) == 1
            assert cap.truncated.describe() == f"record of frame 2 at byte 48 {message}"


def test_not_a_capture(tmp_path):
    cases = {
        "empty.pcap": (b"", "empty file"),
        "text.pcap": (b"hello, this is not a capture at all\n", "not a capture"),
        "short.pcap": (struct.pack("<I", 0xA1B2C3D4) + b"\0" * 6, "truncated pcap file header"),
        "short.pcapng": (ng_shb("<")[:20], "truncated pcapng section header"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(InputFormatError, match=message) as e:
            list(iter_frames(path))
        assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_corrupt_record_length(tmp_path):
    frames = real_frames()
    data = bytearray(pcap_bytes(frames, [0, 1]))
    struct.pack_into("<I", data, 24 + 8, 10**9)  # caplen of frame 1
    path = tmp_path / "bad.pcap"
    path.write_bytes(bytes(data))
    with pytest.raises(InputFormatError, match="frame 1 claims 1000000000 captured bytes"):
        list(iter_frames(path))


def test_no_warning_on_clean_file():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sum(len(b) for b in iter_frames(REAL / "scapy_roce_test_vectors.pcap")) == 2


def test_pcapng_runs_across_buffers_and_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(capture, "_READ_CHUNK", 150)  # many refills inside runs of EPBs
    f1, f2 = real_frames()
    frames, want_ts, want_if, data = [], [], [], ng_shb("<") + ng_idb("<", "a", 9)
    for i in range(7):
        fr = (f1 if i % 2 else f2) + bytes([i])
        data += ng_epb("<", 0, 10**18 + i, fr)
        frames.append(fr)
        want_ts.append(10**18 + i)
        want_if.append(0)
    data += ng_idb("<", "b", 6)          # a second interface declared mid-stream
    data += ng_spb("<", f1)              # interface 0, previous timestamp
    frames.append(f1)
    want_ts.append(10**18 + 6)
    want_if.append(0)
    for i in range(5):
        data += ng_epb("<", 1, 2 * 10**15 + i, f2)
        frames.append(f2)
        want_ts.append((2 * 10**15 + i) * 1000)
        want_if.append(1)
    path = tmp_path / "runs.pcapng"
    path.write_bytes(data)
    for k in (1, 2, 3, 100):
        got = all_frames(path, max_frames=k)
        assert got["bytes"] == frames and got["ts"] == want_ts and got["iface"] == want_if, k
        assert got["names"] == ["a"] * 8 + ["b"] * 5


def test_erf_records_inside_pcapng(tmp_path):
    t = 1_700_000_000_000_000_123
    data = ng_shb("<") + ng_idb("<", "ib0", 9, linktype=197)
    data += ng_epb("<", 0, t, erf_record(t, 21, IB_FRAME))
    data += ng_epb("<", 0, t + 1, erf_record(t + 1, 48, bytes(8)))  # ERF padding: kept as is
    path = tmp_path / "ib.pcapng"
    path.write_bytes(data)
    got = all_frames(path)
    assert got["linktype"] == [LINKTYPE_INFINIBAND, 197]
    assert got["bytes"][0] == IB_FRAME and got["ts"][0] == t
    assert len(tshark_fields(path, "frame.number")) == 2


def test_modified_pcap_records(tmp_path):
    # Kuznetzov's modified pcap (magic 0xa1b2cd34): 24-byte records with ifindex, protocol,
    # packet type and a pad byte after the usual four fields
    frames = real_frames()
    out = [struct.pack("<IHHiIII", 0xA1B2CD34, 2, 4, 0, 0, 65535, 1)]
    for i, f in enumerate(frames):
        out.append(struct.pack("<IIIIIHBB", 1_700_000_000, 10 + i, len(f), len(f), 3, 0x0800, 0, 0)
                   + f)
    path = tmp_path / "mod.pcap"
    path.write_bytes(b"".join(out))
    got = all_frames(path)
    assert got["bytes"] == frames
    assert got["ts"] == [1_700_000_000 * 10**9 + 10_000, 1_700_000_000 * 10**9 + 11_000]
