"""The validator and the frame parser against independent oracles.

Good frames are built with scapy (``scapy.contrib.roce`` computes the ICRC), native IB frames from
the IBTA layout with ``zlib`` and a bitwise CRC-16 written here; bad captures are made by editing
bytes of good frames (then, where only one check must fire, letting scapy recompute the ICRC).
tshark is the reference for the parsed fields.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import dpkt
import numpy as np
import pytest

from conftest import require_tool
from click.testing import CliRunner
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Raw, raw

from wiretrace.cli import main
from wiretrace.transport.parse import format_address, read_packets
from wiretrace.transport.validate import CHECKS, validate_capture

REAL = Path(__file__).resolve().parents[2] / "shared" / "real" / "roce_packets"

A, B = "10.0.0.1", "10.0.0.2"
A6, B6 = "fd00::1", "fd00::2"
QP_A, QP_B, QP_UC, QP_6 = 0x000011, 0x000022, 0x000033, 0x000044
PMTU = 1024
TOS_DATA = (26 << 2) | 2   # DSCP 26, ECT(0)
TOS_CNP = (48 << 2) | 2    # DSCP 48, ECT(0)


def tshark() -> str:
    return require_tool("tshark")


# -- frames -----------------------------------------------------------------------------------

def rocev2(opcode, psn, dqpn, payload=b"", ext=b"", ackreq=0, pad=None, src=A, dst=B,
           sport=49200, tos=TOS_DATA, becn=0, vlan=None) -> bytes:
    """A RoCEv2 frame built by scapy (IPv4, or IPv6 for ':' addresses), ICRC by scapy."""
    pad = (-len(payload) & 3) if pad is None else pad
    l2 = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    if vlan is not None:
        l2 = l2 / Dot1Q(vlan=vlan, prio=3)
    if ":" in src:
        l3 = IPv6(src=src, dst=dst, tc=tos, fl=0, hlim=64)
    else:
        l3 = IP(src=src, dst=dst, tos=tos, flags="DF", ttl=64, id=0)
    bth = BTH(opcode=opcode, padcount=pad, migreq=1, dqpn=dqpn, psn=psn, ackreq=ackreq, becn=becn)
    return raw(l2 / l3 / UDP(sport=sport, dport=4791, chksum=0) / bth / Raw(ext + payload + bytes(pad)))


def reth(dma_len, va=0x7F0000001000, rkey=0x1234) -> bytes:
    return struct.pack(">QII", va, rkey, dma_len)


def aeth(msn, syndrome=0x1F) -> bytes:
    return struct.pack(">I", (syndrome << 24) | msn)


def data(n, seed=0) -> bytes:
    return bytes((seed + 7 * i) & 0xFF for i in range(n))


def good_frames() -> list[bytes]:
    """A conversation between A (QP 0x11) and B (QP 0x22), PSNs wrapping at 2^24, PMTU 1024."""
    f = []
    # RDMA WRITE of 2500 bytes: FIRST, MIDDLE, LAST WITH IMMEDIATE (PSN 0xfffffe, 0xffffff, 0)
    f.append(rocev2(0x06, 0xFFFFFE, QP_B, data(1024), reth(2500)))
    f.append(rocev2(0x07, 0xFFFFFF, QP_B, data(1024, 1)))
    f.append(rocev2(0x09, 0x000000, QP_B, data(452, 2), struct.pack(">I", 0xCAFE), ackreq=1))
    f.append(rocev2(0x11, 0, QP_A, ext=aeth(1), src=B, dst=A))                  # ACK, MSN 1
    f.append(rocev2(0x04, 1, QP_B, data(18, 3), ackreq=1))                      # SEND ONLY + pad 2
    f.append(rocev2(0x11, 1, QP_A, ext=aeth(2), src=B, dst=A))
    f.append(rocev2(0x0C, 2, QP_B, ext=reth(2100)))                             # READ: PSNs 2..4
    f.append(rocev2(0x0D, 2, QP_A, data(1024, 4), aeth(2), src=B, dst=A))
    f.append(rocev2(0x0E, 3, QP_A, data(1024, 5), src=B, dst=A))
    f.append(rocev2(0x0F, 4, QP_A, data(52, 6), aeth(3), src=B, dst=A))
    f.append(rocev2(0x0A, 5, QP_B, data(61, 7), reth(61), ackreq=1))            # WRITE ONLY, pad 3
    f.append(rocev2(0x11, 5, QP_A, ext=aeth(4), src=B, dst=A))
    f.append(rocev2(0x81, 0, QP_A, ext=bytes(16), src=B, dst=A, sport=0, tos=TOS_CNP, becn=1))
    f.append(rocev2(0x24, 100, QP_UC, data(7, 8), src=B, dst=A))               # UC SEND ONLY
    f.append(rocev2(0x24, 101, QP_UC, data(8, 9), src=B, dst=A))
    f.append(rocev2(0x04, 10, QP_6, data(30, 10), src=A6, dst=B6, vlan=100))   # IPv6 + VLAN
    f.append(rocev2(0x00, 11, QP_6, data(1024, 11), src=A6, dst=B6, vlan=100))
    f.append(rocev2(0x02, 12, QP_6, data(3, 12), src=A6, dst=B6, vlan=100))
    return f


# Expected packets-table fields of good_frames(), written from the construction above.
GOOD_FIELDS = {
    "opcode": [0x06, 0x07, 0x09, 0x11, 0x04, 0x11, 0x0C, 0x0D, 0x0E, 0x0F, 0x0A, 0x11, 0x81,
               0x24, 0x24, 0x04, 0x00, 0x02],
    "psn": [0xFFFFFE, 0xFFFFFF, 0, 0, 1, 1, 2, 2, 3, 4, 5, 5, 0, 100, 101, 10, 11, 12],
    "payload_len": [1024, 1024, 452, 0, 18, 0, 0, 1024, 1024, 52, 61, 0, 0, 7, 8, 30, 1024, 3],
    "pad": [0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 3, 0, 0, 1, 0, 2, 0, 1],
    "dma_len": [2500, -1, -1, -1, -1, -1, 2100, -1, -1, -1, 61, -1, -1, -1, -1, -1, -1, -1],
    "msn": [-1, -1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 4, -1, -1, -1, -1, -1, -1],
}


def write_pcap(path: Path, frames, snaplen=65535, cut=None) -> Path:
    with open(path, "wb") as fh:
        w = dpkt.pcap.Writer(fh, snaplen=snaplen, nano=True)
        for i, fr in enumerate(frames):
            ts = 1_700_000_000 + i * 1e-6
            if cut is not None and len(fr) > cut:
                # dpkt writes caplen = len(data); fix the original length afterwards
                w.writepkt(fr[:cut], ts=ts)
            else:
                w.writepkt(fr, ts=ts)
    if cut is not None:
        buf = bytearray(path.read_bytes())
        pos = 24
        for fr in frames:
            caplen = struct.unpack_from("<I", buf, pos + 8)[0]
            struct.pack_into("<I", buf, pos + 12, len(fr))
            pos += 16 + caplen
        path.write_bytes(bytes(buf))
    return path


def refix_icrc(frame: bytes) -> bytes:
    """Let scapy recompute the ICRC of an edited frame (IP checksum left as it is)."""
    p = Ether(frame)
    p[BTH].icrc = None
    return raw(p)


def edit(frame: bytes, offset: int, value: bytes, fix_icrc=True) -> bytes:
    b = bytearray(frame)
    b[offset:offset + len(value)] = value
    return refix_icrc(bytes(b)) if fix_icrc else bytes(b)


def run_cli(*args):
    return CliRunner().invoke(main, ["validate", *map(str, args)])


def only(report, check, n=1):
    """The report has exactly ``n`` violations, all of ``check``."""
    assert report.counts[check] == n, report.as_dict()
    assert report.total_violations == n, report.as_dict()
    return [v for v in report.violations if v.check == check]


BTH_AT = 14 + 20 + 8  # IPv4 frames without VLAN


# -- the good captures ------------------------------------------------------------------------

def test_real_frames_pass(tmp_path):
    rep = validate_capture(REAL / "scapy_roce_test_vectors.pcap")
    assert rep.ok and rep.frames == 2 and rep.roce_frames == 2
    assert rep.checked["icrc"] == 2 and rep.checked["ipv4_checksum"] == 2
    res = run_cli(REAL / "scapy_roce_test_vectors.pcap", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["frames"] == 2 and doc["roce_frames"] == 2 and doc["violations"] == []
    assert set(doc["counts"]) == set(CHECKS)


def test_real_frames_parsed_fields():
    c = read_packets(REAL / "scapy_roce_test_vectors.pcap")
    # frame 1: UC SEND ONLY, 18 B + 2 pad, dest QP 211, PSN 13571856; frame 2: CNP, BECN, QP 0x118
    assert c["opcode"].tolist() == [0x24, 0x81]
    assert c["payload_len"].tolist() == [18, 0] and c["pad"].tolist() == [2, 0]
    assert c["dest_qp"].tolist() == [211, 0x118] and c["psn"].tolist() == [13571856, 0]
    assert c["becn"].tolist() == [False, True] and c["udp_sport"].tolist() == [49152, 0]
    assert c["dscp"].tolist() == [0, 48] and c["ecn"].tolist() == [1, 2]
    assert c["frame_len"].tolist() == [78, 74]
    assert [format_address(a) for a in c["src_addr"]] == ["192.168.0.7", "10.0.17.1"]


def test_good_conversation_is_clean(tmp_path):
    path = write_pcap(tmp_path / "good.pcap", good_frames())
    rep = validate_capture(path)
    assert rep.ok, rep.as_dict()
    assert rep.frames == 18 and rep.roce_frames == 18
    assert rep.checked["icrc"] == 18
    assert rep.checked["reth_length"] == 3   # WRITE of 2500, READ of 2100, WRITE ONLY of 61
    assert rep.checked["ack_msn"] == 5
    res = run_cli(path)
    assert res.exit_code == 0 and "clean" in res.output


def test_parsed_fields_of_good_frames(tmp_path):
    frames = good_frames()
    path = write_pcap(tmp_path / "good.pcap", frames)
    c = read_packets(path)
    for name, want in GOOD_FIELDS.items():
        assert c[name].tolist() == want, name
    assert c["frame_len"].tolist() == [len(f) for f in frames]
    assert c["vlan"].tolist() == [-1] * 15 + [100] * 3
    assert c["dscp"].tolist() == [26] * 12 + [48] + [26] * 5


def test_parsed_fields_equal_tshark(tmp_path):
    path = write_pcap(tmp_path / "good.pcap", good_frames())
    fields = ["frame.number", "infiniband.bth.opcode", "infiniband.bth.psn",
              "infiniband.bth.destqp", "infiniband.bth.padcnt", "infiniband.bth.a",
              "infiniband.reth.dmalen", "infiniband.aeth.msn", "udp.srcport", "frame.len",
              "ip.dsfield.dscp", "ipv6.tclass.dscp", "ip.dsfield.ecn", "ipv6.tclass.ecn"]
    cmd = [tshark(), "-r", str(path), "-T", "fields", "-E", "separator=|"]
    for f in fields:
        cmd += ["-e", f]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [line.split("|") for line in out]
    c = read_packets(path)
    assert len(rows) == len(c["frame"])

    def num(s):
        return -1 if s == "" else int(s, 0)

    col = {f: [r[i] for r in rows] for i, f in enumerate(fields)}
    assert [num(x) for x in col["frame.number"]] == c["frame"].tolist()
    assert [num(x) for x in col["infiniband.bth.opcode"]] == c["opcode"].tolist()
    assert [num(x) for x in col["infiniband.bth.psn"]] == c["psn"].tolist()
    assert [num(x) for x in col["infiniband.bth.destqp"]] == c["dest_qp"].tolist()
    assert [num(x) for x in col["infiniband.bth.padcnt"]] == c["pad"].tolist()
    assert [x in ("1", "True") for x in col["infiniband.bth.a"]] == c["ack_req"].tolist()
    assert [num(x) for x in col["infiniband.reth.dmalen"]] == c["dma_len"].tolist()
    assert [num(x) for x in col["infiniband.aeth.msn"]] == c["msn"].tolist()
    assert [num(x) for x in col["udp.srcport"]] == c["udp_sport"].tolist()
    assert [num(x) for x in col["frame.len"]] == c["frame_len"].tolist()
    dscp = [num(a if a else b) for a, b in zip(col["ip.dsfield.dscp"], col["ipv6.tclass.dscp"])]
    ecn = [num(a if a else b) for a, b in zip(col["ip.dsfield.ecn"], col["ipv6.tclass.ecn"])]
    assert dscp == c["dscp"].tolist() and ecn == c["ecn"].tolist()


# -- one fault at a time ----------------------------------------------------------------------

def test_flipped_icrc_byte(tmp_path):
    frames = good_frames()
    frames[4] = frames[4][:-2] + bytes([frames[4][-2] ^ 0x01]) + frames[4][-1:]
    rep = validate_capture(write_pcap(tmp_path / "icrc.pcap", frames))
    (v,) = only(rep, "icrc")
    assert v.frame == 5 and v.qp == QP_B
    stored = struct.unpack("<I", frames[4][-4:])[0]
    assert v.message.startswith(f"ICRC {stored:#010x} (wire bytes ") and "expected 0x" in v.message
    res = run_cli(tmp_path / "icrc.pcap")
    assert res.exit_code == 1 and "icrc" in res.output


def test_psn_gap(tmp_path):
    frames = good_frames()
    # the second UC SEND ONLY (frame 15) at PSN 101 -> 104
    frames[14] = edit(frames[14], BTH_AT + 8, struct.pack(">I", 104))
    rep = validate_capture(write_pcap(tmp_path / "psn.pcap", frames))
    (v,) = only(rep, "psn")
    assert (v.frame, v.qp) == (15, QP_UC)
    # the stream's only earlier packet is its first in the capture: it may be the wrong one
    hint = "; or frame 14, the first packet of this QP in the capture, carries a wrong PSN"
    assert v.message == "PSN gap: expected 101, got 104 (3 PSN(s) missing)" + hint
    res = run_cli(tmp_path / "psn.pcap", "--json")
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert doc["counts"]["psn"] == 1
    assert doc["violations"] == [{"frame": 15, "qp": QP_UC, "check": "psn",
                                  "message": "PSN gap: expected 101, got 104 (3 PSN(s) missing)" + hint}]


def test_a_wrong_first_psn_is_named_as_a_possible_cause(tmp_path):
    """The first packet of a QP carries a wrong PSN (0xFFFFFE -> 0x20000): the next packet is
    reported, once, and the message names the first packet as the possible culprit; a gap later
    in the stream does not."""
    frames = good_frames()
    frames[0] = edit(frames[0], BTH_AT + 8, struct.pack(">I", 0x20000))
    rep = validate_capture(write_pcap(tmp_path / "first.pcap", frames))
    (v,) = only(rep, "psn")
    assert v.frame == 2 and v.message.endswith(
        "; or frame 1, the first packet of this QP in the capture, carries a wrong PSN")
    frames = good_frames()
    frames[2] = edit(frames[2], BTH_AT + 8, struct.pack(">I", 5))          # the third packet
    rep = validate_capture(write_pcap(tmp_path / "third.pcap", frames), batch_frames=2)
    assert [v.message for v in rep.violations if v.check == "psn"][0] == \
        "PSN gap: expected 0, got 5 (5 PSN(s) missing)"


def test_psn_jump_on_rc_also_breaks_msn_accounting(tmp_path):
    frames = good_frames()
    # SEND ONLY (frame 5) at PSN 1 -> 4: a gap, then the READ at PSN 2 goes back; the ACK of
    # PSN 1 (frame 6) now counts no new message although its MSN says one more
    frames[4] = edit(frames[4], BTH_AT + 8, struct.pack(">I", 4))
    rep = validate_capture(write_pcap(tmp_path / "psn.pcap", frames))
    assert rep.counts["psn"] == 2 and rep.counts["ack_msn"] == 1 and rep.total_violations == 3
    v = sorted(rep.violations, key=lambda v: v.frame)
    assert (v[0].frame, v[0].message) == (5, "PSN gap: expected 1, got 4 (3 PSN(s) missing)")
    assert (v[1].frame, v[1].check) == (6, "ack_msn")
    assert v[1].message == ("MSN 2 acknowledging PSN 1, expected 1 "
                            "(0 request message(s) completed since the previous ACK)")
    assert v[2].frame == 7 and "goes back" in v[2].message


def test_psn_gap_after_read_request(tmp_path):
    frames = good_frames()
    # the READ of 2100 bytes at PSN 2 consumes 3 PSNs (1024-byte MTU); the WRITE ONLY after it
    # is at 5. Moving it to 3 (as if the READ consumed one PSN) is a violation.
    frames[10] = edit(frames[10], BTH_AT + 8, struct.pack(">I", 3))
    rep = validate_capture(write_pcap(tmp_path / "rd.pcap", frames))
    (v,) = only(rep, "psn")
    assert v.frame == 11
    assert v.message == "PSN 3 goes back 2 from expected 5 (retransmission or reordering)"


def test_reads_of_two_qps_at_one_psn_are_told_apart_by_udp_port(tmp_path):
    """Two QPs of one connection (same addresses) each issue a READ at PSN 0: the responses are
    paired with their own request by the UDP source port (a RoCEv2 NIC sends a QP's requests and
    responses from one port), so both DMA lengths check out; a response with the wrong length is
    still caught."""
    req1 = rocev2(0x0C, 0, QP_B, ext=reth(2100), sport=49200)
    req2 = rocev2(0x0C, 0, 0x25, ext=reth(500), sport=49300)
    resp1 = [rocev2(0x0D, 0, QP_A, data(1024, 1), aeth(0), src=B, dst=A, sport=49200),
             rocev2(0x0E, 1, QP_A, data(1024, 2), src=B, dst=A, sport=49200),
             rocev2(0x0F, 2, QP_A, data(52, 3), aeth(1), src=B, dst=A, sport=49200)]
    resp2 = rocev2(0x10, 0, 0x12, data(500, 4), aeth(1), src=B, dst=A, sport=49300)
    rep = validate_capture(write_pcap(tmp_path / "two.pcap", [req1, req2, *resp1, resp2]))
    assert rep.ok and rep.checked["reth_length"] == 2, rep.as_dict()
    short = rocev2(0x10, 0, 0x12, data(496, 4), aeth(1), src=B, dst=A, sport=49300)
    rep = validate_capture(write_pcap(tmp_path / "bad.pcap", [req1, req2, *resp1, short]))
    (v,) = only(rep, "reth_length")
    assert v.frame == 6 and v.message == "RETH DMA length 500 (frame 2) but the RDMA READ carries 496 bytes"


def test_one_wrong_msn_is_one_violation(tmp_path):
    """The first ACK of a stream carries a wrong MSN (4 for 1): the next ACK is reported going
    back from it, and the ACKs after that are judged against the corrected count again, not
    reported one by one."""
    frames = good_frames()
    frames[3] = edit(frames[3], BTH_AT + 12, aeth(4))
    rep = validate_capture(write_pcap(tmp_path / "msn.pcap", frames))
    (v,) = only(rep, "ack_msn")
    assert (v.frame, v.message) == (6, "MSN 2 goes back from 4")
    assert rep.checked["ack_msn"] == 5


def test_a_lost_first_packet_does_not_lengthen_the_message_before(tmp_path):
    """Two WRITEs on one QP; the second loses its FIRST packet. The orphaned MIDDLE and LAST are
    reported (no FIRST, PSN gap) and are not added to the first WRITE, which stays clean."""
    frames = [rocev2(0x06, 0, QP_B, data(1024), reth(1500)),
              rocev2(0x08, 1, QP_B, data(476, 1)),
              # rocev2(0x06, 2, QP_B, data(1024, 2), reth(2100)) is lost
              rocev2(0x07, 3, QP_B, data(1024, 3)),
              rocev2(0x08, 4, QP_B, data(52, 4))]
    rep = validate_capture(write_pcap(tmp_path / "lost.pcap", frames))
    assert rep.checked["reth_length"] == 1 and rep.total_violations == 2, rep.as_dict()
    assert sorted((v.frame, v.check, v.message) for v in rep.violations) == [
        (3, "opcode_sequence", "RC_RDMA_WRITE_MIDDLE without a FIRST (previous packet was LAST)"),
        (3, "psn", "PSN gap: expected 2, got 3 (1 PSN(s) missing)")]


def test_wrong_pad_count(tmp_path):
    frames = good_frames()
    # WRITE ONLY of 61 bytes carries pad 3; claim pad 2 (payload then looks like 62 bytes)
    b4 = bytes([(frames[10][BTH_AT + 1] & ~0x30) | (2 << 4)])
    frames[10] = edit(frames[10], BTH_AT + 1, b4)
    rep = validate_capture(write_pcap(tmp_path / "pad.pcap", frames))
    (v,) = only(rep, "pad")
    assert v.frame == 11
    assert v.message == "pad count 2 on the last packet of a RDMA WRITE of 61 bytes, expected 3"
    assert run_cli(tmp_path / "pad.pcap").exit_code == 1


def test_pad_on_first_packet(tmp_path):
    frames = good_frames()
    frames[0] = edit(frames[0], BTH_AT + 1, bytes([frames[0][BTH_AT + 1] | 0x30]))
    rep = validate_capture(write_pcap(tmp_path / "pad1.pcap", frames))
    assert rep.counts["pad"] >= 1
    msgs = [v.message for v in rep.violations if v.check == "pad" and v.frame == 1]
    assert "pad count 3 on RC_RDMA_WRITE_FIRST, expected 0" in msgs


def test_reth_length_mismatch(tmp_path):
    frames = good_frames()
    # WRITE ONLY: RETH DMA length 61 -> 100 (RETH follows the BTH; DMA length is its last word)
    frames[10] = edit(frames[10], BTH_AT + 12 + 12, struct.pack(">I", 100))
    rep = validate_capture(write_pcap(tmp_path / "reth.pcap", frames))
    (v,) = only(rep, "reth_length")
    assert v.frame == 11 and v.qp == QP_B
    assert v.message == "RETH DMA length 100 but the RDMA WRITE carries 61 bytes"


def test_reth_length_of_multi_packet_write_and_read(tmp_path):
    frames = good_frames()
    frames[0] = edit(frames[0], BTH_AT + 12 + 12, struct.pack(">I", 2600))   # WRITE FIRST
    # READ request: 2049 bytes still take 3 responses of 1024, so only the length is wrong
    frames[6] = edit(frames[6], BTH_AT + 12 + 12, struct.pack(">I", 2049))
    rep = validate_capture(write_pcap(tmp_path / "reth2.pcap", frames))
    v = only(rep, "reth_length", 2)
    assert [x.frame for x in v] == [3, 10]
    assert v[0].message == "RETH DMA length 2600 (frame 1) but the RDMA WRITE carries 2500 bytes"
    assert v[1].message == "RETH DMA length 2049 (frame 7) but the RDMA READ carries 2100 bytes"


def test_ipv4_checksum(tmp_path):
    frames = good_frames()
    frames[2] = edit(frames[2], 14 + 8, b"\x3f", fix_icrc=False)  # TTL is masked out of the ICRC
    rep = validate_capture(write_pcap(tmp_path / "ip.pcap", frames))
    (v,) = only(rep, "ipv4_checksum")
    assert v.frame == 3 and v.message.startswith("IPv4 header checksum")


def test_opcode_sequence(tmp_path):
    frames = good_frames()
    frames[1] = edit(frames[1], BTH_AT, b"\x01")  # RDMA WRITE MIDDLE -> SEND MIDDLE
    rep = validate_capture(write_pcap(tmp_path / "seq.pcap", frames))
    v = only(rep, "opcode_sequence", 2)
    assert (v[0].frame, v[0].message) == (2, "RC_SEND_MIDDLE continues a RDMA WRITE message")
    assert (v[1].frame, v[1].message) == (
        3, "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE continues a SEND message")


def test_msn_going_back(tmp_path):
    frames = good_frames()
    frames[11] = edit(frames[11], BTH_AT + 12, aeth(1))  # last ACK: MSN 4 -> 1
    rep = validate_capture(write_pcap(tmp_path / "msn.pcap", frames))
    (v,) = only(rep, "ack_msn")
    assert v.frame == 12 and v.qp == QP_A and v.message == "MSN 1 goes back from 3"


def test_msn_off_by_one(tmp_path):
    frames = good_frames()
    # second ACK (PSN 1): MSN 2 -> 1. The MSN neither goes back nor runs ahead of the PSNs, but
    # the SEND ONLY at PSN 1 completed a second message since the first ACK (MSN 1 at PSN 0)
    frames[5] = edit(frames[5], BTH_AT + 12, aeth(1))
    rep = validate_capture(write_pcap(tmp_path / "msn1.pcap", frames))
    (v,) = only(rep, "ack_msn")
    assert v.frame == 6 and v.qp == QP_A
    assert v.message == ("MSN 1 acknowledging PSN 1, expected 2 "
                         "(1 request message(s) completed since the previous ACK)")


def test_truncated_file(tmp_path):
    path = write_pcap(tmp_path / "cut.pcap", good_frames())
    path.write_bytes(path.read_bytes()[:-10])
    rep = validate_capture(path)
    (v,) = only(rep, "capture")
    assert v.frame == 18 and v.message.startswith("capture truncated: record of frame 18")
    assert rep.frames == 17
    res = run_cli(path)
    assert res.exit_code == 1 and "capture truncated" in res.output


@pytest.mark.parametrize("keep,message", [
    (66, "needs 4170 frame bytes, only 50 present"),         # the record header and 50 bytes
    (10, "needs 16 record bytes, only 10 present"),          # inside the record header
])
def test_truncated_record_counts_frame_bytes_on_both_sides(tmp_path, keep, message):
    big = rocev2(0x06, 1, 0x99, data(4096), reth(8192))
    assert len(big) == 4170
    frames = good_frames()[:2] + [big]
    path = write_pcap(tmp_path / "cut.pcap", frames)
    whole = path.read_bytes()
    start = len(whole) - 16 - len(big)
    path.write_bytes(whole[:start + keep])
    rep = validate_capture(path)
    (v,) = [v for v in rep.violations if v.check == "capture"]
    assert v.frame == 3
    assert v.message == f"capture truncated: record of frame 3 at byte {start} {message}"
    res = run_cli(path, "--json")
    assert res.exit_code == 1
    assert json.loads(res.output)["violations"][0]["message"] == v.message


def test_unreadable_file_exit_2(tmp_path):
    bad = tmp_path / "notes.pcap"
    bad.write_text("not a capture\n")
    res = run_cli(bad)
    assert res.exit_code == 2
    assert res.output.startswith("error: ") and "not a capture" in res.output
    assert run_cli(tmp_path / "missing.pcap").exit_code == 2


def test_snaplen_truncated_frames_checked_as_far_as_they_go(tmp_path):
    frames = good_frames()
    path = write_pcap(tmp_path / "snap.pcap", frames, snaplen=80, cut=80)
    rep = validate_capture(path)
    assert rep.ok, rep.as_dict()
    assert rep.truncated == sum(len(f) > 80 for f in frames)
    assert rep.checked["icrc"] == sum(len(f) <= 80 for f in frames)
    c = read_packets(path)
    assert c["payload_len"].tolist() == GOOD_FIELDS["payload_len"]  # from the length fields
    assert c["frame_len"].tolist() == [len(f) for f in frames]
    # a PSN gap is still found in headers-only frames
    frames[14] = edit(frames[14], BTH_AT + 8, struct.pack(">I", 104))
    rep = validate_capture(write_pcap(tmp_path / "snap2.pcap", frames, snaplen=80, cut=80))
    assert rep.counts["psn"] == 1 and rep.total_violations == 1


def test_non_roce_frames_are_counted_and_skipped(tmp_path):
    arp = bytes.fromhex("ffffffffffff020000000001 0806".replace(" ", "")) + bytes(46)
    dns = raw(Ether() / IP(src=A, dst=B) / UDP(sport=5353, dport=53) / Raw(b"q" * 20))
    frames = good_frames()[:3] + [arp, dns]
    rep = validate_capture(write_pcap(tmp_path / "mixed.pcap", frames))
    assert rep.ok and rep.frames == 5 and rep.roce_frames == 3 and rep.non_roce_frames == 2


@pytest.mark.parametrize("snap", [14, 20, 30, 40])
def test_frames_cut_before_the_bth_are_not_checked_and_not_clean(tmp_path, snap):
    # snap 14: only Ethernet; 20: part of IPv4; 30: IPv4 without UDP; 40: the UDP ports too
    frames = good_frames()
    dns = raw(Ether() / IP(src=A, dst=B) / UDP(sport=5353, dport=53) / Raw(b"q" * 60))
    tcp = bytes.fromhex("020000000002020000000001 0800".replace(" ", "")) + raw(IP(src=A, dst=B, proto=6) / Raw(b"t" * 60))
    path = write_pcap(tmp_path / "cut.pcap", frames + [dns, tcp], snaplen=snap, cut=snap)
    rep = validate_capture(path)
    # RoCE as far as the bytes go: every RoCE frame (but a VLAN-tagged one whose tag is cut at
    # 14 bytes: nothing says what it carries); DNS and TCP once the IP protocol shows they are not
    tagged = sum(fr[12:14] == b"\x81\x00" for fr in frames)
    assert tagged == 3
    not_roce = {14: tagged, 20: 0, 30: 1, 40: 2}[snap]
    assert rep.roce_frames == 0
    assert rep.cut_before_bth == len(frames) + 2 - not_roce
    assert rep.non_roce_frames == not_roce
    assert rep.nothing_checked and not rep.ok
    (v,) = only(rep, "capture")
    assert v.frame == 0 and v.message.startswith(f"nothing checked: {rep.cut_before_bth} frame(s) cut by the snap "
                                                 f"length before the BTH, RoCE/IB as far as")
    res = run_cli(path)
    assert res.exit_code == 1
    assert (f"0 RoCE/IB, {rep.cut_before_bth} cut before the BTH (RoCE/IB as far as captured; not checked)"
            in " ".join(res.output.split()))
    assert "nothing checked" in res.output and "clean" not in res.output
    doc = json.loads(run_cli(path, "--json").output)
    assert doc["nothing_checked"] is True and doc["ok"] is False and doc["cut_before_bth"] == rep.cut_before_bth


def test_udp_port_4791_decides_when_the_bth_is_cut(tmp_path):
    frames = good_frames()
    dns = raw(Ether() / IP(src=A, dst=B) / UDP(sport=5353, dport=53) / Raw(b"q" * 60))
    # 80 bytes: every RoCE frame through its BTH (parsed, checked as far as it goes); the DNS
    # frame shows its port 53: other traffic
    rep = validate_capture(write_pcap(tmp_path / "c.pcap", frames + [dns], snaplen=80, cut=80))
    assert rep.non_roce_frames == 1 and rep.cut_before_bth == 0 and rep.roce_frames == len(frames)
    assert not rep.nothing_checked and rep.checked["psn"] > 0 and rep.ok


def test_capture_without_roce_is_not_clean(tmp_path):
    dns = raw(Ether() / IP(src=A, dst=B) / UDP(sport=5353, dport=53) / Raw(b"q" * 20))
    rep = validate_capture(write_pcap(tmp_path / "dns.pcap", [dns] * 3))
    assert rep.nothing_checked and rep.non_roce_frames == 3 and rep.cut_before_bth == 0
    (v,) = only(rep, "capture")
    assert v.message == "nothing checked: no RoCEv2 / InfiniBand frame in it (3 frame(s) in the capture)"


def test_native_ib_records_cut_inside_the_lrh(tmp_path):
    frames = [f[:6] for f in ib_frames()]
    path = erf_file(tmp_path / "lrh.erf", frames)
    # the ERF wire length still names the whole frame
    buf = bytearray(path.read_bytes())
    pos = 0
    for f in ib_frames():
        struct.pack_into(">H", buf, pos + 14, len(f))
        pos += struct.unpack_from(">H", buf, pos + 10)[0]
    path.write_bytes(bytes(buf))
    rep = validate_capture(path)
    assert rep.cut_before_bth == len(frames) and rep.roce_frames == 0 and rep.non_roce_frames == 0


@pytest.mark.parametrize("keep", [8, 10, 12])   # padded to 8 bytes: at most 16 of the 20
def test_native_ib_records_cut_after_the_lrh_are_not_clean(tmp_path, keep):
    """An LRH (and a bit more) but no whole BTH: the LRH lengths are checked, the transport is
    not, so the capture is "nothing checked" (exit 1), as a RoCEv2 capture cut before the BTH."""
    frames = ib_frames()
    path = erf_file(tmp_path / "lrh.erf", [f[:keep] for f in frames])
    buf = bytearray(path.read_bytes())
    pos = 0
    for f in frames:
        struct.pack_into(">H", buf, pos + 14, len(f))
        pos += struct.unpack_from(">H", buf, pos + 10)[0]
    path.write_bytes(bytes(buf))
    rep = validate_capture(path)
    assert rep.cut_before_bth == 4 and rep.roce_frames == 0 and rep.non_roce_frames == 0
    assert rep.checked["length"] == 4 and rep.counts["length"] == 0
    assert rep.nothing_checked and not rep.ok
    (v,) = only(rep, "capture")
    assert v.message == ("nothing checked: 4 frame(s) cut by the snap length before the BTH, RoCE/IB as far as "
                         "their captured headers go (4 frame(s) in the capture)")
    res = run_cli(path)
    assert res.exit_code == 1 and "nothing checked" in res.output and "clean" not in res.output
    doc = json.loads(run_cli(path, "--json").output)
    assert doc["ok"] is False and doc["nothing_checked"] is True


def test_json_says_when_the_violation_list_was_cut(tmp_path):
    frames = good_frames()
    frames = [fr[:-1] + bytes([fr[-1] ^ 0xFF]) for fr in frames]          # every ICRC wrong
    path = write_pcap(tmp_path / "bad.pcap", frames)
    doc = json.loads(run_cli(path, "--json", "--max-violations", "3").output)
    assert doc["violations_total"] == len(frames) and doc["violations_truncated"] is True
    assert len(doc["violations"]) == 3
    doc = json.loads(run_cli(path, "--json").output)
    assert doc["violations_total"] == len(doc["violations"]) == len(frames)
    assert doc["violations_truncated"] is False


@pytest.mark.parametrize("args", [(), ("--json",)])
@pytest.mark.parametrize("bad", [False, True])
def test_closed_pipe_ends_quietly_with_the_status_found(tmp_path, args, bad):
    frames = good_frames()
    if bad:
        frames = [fr[:-1] + bytes([fr[-1] ^ 0xFF]) for fr in frames]
    path = write_pcap(tmp_path / "p.pcap", frames)
    exe = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "wiretrace"
    p = subprocess.Popen([str(exe), "validate", str(path), "-q", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()             # the reader is gone before the report is written (`| head -0`)
    err = p.stderr.read().decode()
    assert p.wait() == (1 if bad else 0)
    assert "Traceback" not in err and "Broken pipe" not in err and "Exception" not in err


@pytest.mark.parametrize("fault", ["none", "psn", "reth", "pad"])
def test_batches_carry_stream_state(tmp_path, fault):
    # the same findings over batches of 1, 2, 3 and 5 frames: messages, READs and PSNs span
    # batch boundaries
    frames = good_frames()
    if fault == "psn":  # also upsets the MSN accounting of the ACKs
        frames[4] = edit(frames[4], BTH_AT + 8, struct.pack(">I", 4))
    elif fault == "reth":
        frames[0] = edit(frames[0], BTH_AT + 12 + 12, struct.pack(">I", 2600))
    elif fault == "pad":
        frames[2] = edit(frames[2], BTH_AT + 1, bytes([frames[2][BTH_AT + 1] | 0x10]))
    path = write_pcap(tmp_path / "b.pcap", frames)
    whole = validate_capture(path).as_dict()
    assert whole["ok"] == (fault == "none")
    for k in (1, 2, 3, 5):
        small = validate_capture(path, batch_frames=k).as_dict()
        assert small["counts"] == whole["counts"], k
        assert small["violations"] == whole["violations"], k
        assert small["checked"] == whole["checked"], k


# -- native InfiniBand in ERF -----------------------------------------------------------------

def crc16_vcrc(data: bytes) -> int:
    """IB VCRC, bit by bit: polynomial 0x100B (reflected 0xD008), init 0xFFFF, complemented, as
    Endace's capture library computes it (dagcrc.c, dagcrc_infiniband_vcrc16_r). Sent least
    significant byte first here, like the ICRC (the byte order is wiretrace's assumption)."""
    c = 0xFFFF
    for byte in data:
        c ^= byte
        for _ in range(8):
            c = (c >> 1) ^ 0xD008 if c & 1 else c >> 1
    return c ^ 0xFFFF


SGID = bytes.fromhex("fe800000000000000002c90300001111")
DGID = bytes.fromhex("fe800000000000000002c90300002222")


def ib_frame(opcode, psn, dqpn, payload=b"", ext=b"", dlid=3, slid=7, vl=0, sl=2,
             grh=False, paylen_error=0) -> bytes:
    """LRH (LNH 2, or 3 with a GRH) + BTH + ext + payload + pad + ICRC + VCRC (IBTA layout)."""
    pad = -len(payload) & 3
    body = struct.pack(">BBHI", opcode, 0x40 | (pad << 4), 0xFFFF, dqpn)
    body += struct.pack(">I", psn) + ext + payload + bytes(pad)
    g = b""
    if grh:  # IPVer 6, TClass 0x0a, FlowLabel 0x12345, PayLen, NxtHdr 0x1B, HopLmt 9
        g = struct.pack(">IHBB", (6 << 28) | (0x0A << 20) | 0x12345,
                        len(body) + 4 + paylen_error, 0x1B, 9)
        g += SGID + DGID
    words = (8 + len(g) + len(body) + 4) // 4
    lrh = struct.pack(">BBHHH", (vl << 4), (sl << 4) | (3 if grh else 2), dlid, words, slid)
    masked = bytearray(lrh + g + body)
    masked[0] |= 0xF0                      # VL
    if grh:  # a global packet's ICRC leaves out the whole LRH (routers rebuild it)
        masked[0:8] = b"\xff" * 8
        masked[8] |= 0x0F                  # TClass (low nibble of byte 0, high of byte 1)
        masked[9:12] = b"\xff\xff\xff"      # TClass, FlowLabel
        masked[15] = 0xFF                  # HopLmt
    masked[8 + len(g) + 4] = 0xFF          # BTH FECN, BECN, reserved
    icrc = zlib.crc32(bytes(masked)) & 0xFFFFFFFF
    pkt = lrh + g + body + struct.pack("<I", icrc)
    return pkt + struct.pack("<H", crc16_vcrc(pkt))


def erf_file(path: Path, frames) -> Path:
    out = []
    for i, fr in enumerate(frames):
        body = fr + bytes(-(16 + len(fr)) % 8)
        ts = ((1_700_000_000 + i) << 32)
        out.append(struct.pack("<Q", ts) + struct.pack(">BBHHH", 21, 0x04, 16 + len(body), 0,
                                                        len(fr)) + body)
    path.write_bytes(b"".join(out))
    return path


def ib_frames() -> list[bytes]:
    return [ib_frame(0x06, 10, 0x99, data(256), reth(300)),
            ib_frame(0x08, 11, 0x99, data(44, 1)),
            ib_frame(0x04, 12, 0x99, data(5, 2)),
            ib_frame(0x11, 12, 0x55, ext=aeth(2), dlid=7, slid=3)]


def test_native_ib_erf_clean_and_fields(tmp_path):
    path = erf_file(tmp_path / "ib.erf", ib_frames())
    rep = validate_capture(path)
    assert rep.ok, rep.as_dict()
    assert rep.checked["icrc"] == 4 and rep.checked["vcrc"] == 4 and rep.checked["reth_length"] == 1
    c = read_packets(path)
    assert c["opcode"].tolist() == [0x06, 0x08, 0x04, 0x11]
    assert c["payload_len"].tolist() == [256, 44, 5, 0] and c["pad"].tolist() == [0, 0, 3, 0]
    assert c["udp_sport"].tolist() == [-1] * 4 and c["dscp"].tolist() == [0] * 4
    assert c["frame_len"].tolist() == [len(f) for f in ib_frames()]
    cmd = [tshark(), "-r", str(path), "-T", "fields", "-E", "separator=|", "-e", "infiniband.lrh.dlid",
           "-e", "infiniband.lrh.slid", "-e", "infiniband.lrh.pktlen", "-e", "infiniband.bth.opcode",
           "-e", "infiniband.bth.psn", "-e", "infiniband.bth.destqp", "-e", "infiniband.reth.dmalen"]
    rows = [r.split("|") for r in subprocess.run(cmd, capture_output=True, text=True,
                                                 check=True).stdout.splitlines()]
    assert [int(r[0]) for r in rows] == c["dlid"].tolist()
    assert [int(r[1]) for r in rows] == c["slid"].tolist()
    assert [int(r[2]) for r in rows] == c["lrh_pktlen"].tolist()
    assert [int(r[3]) for r in rows] == c["opcode"].tolist()
    assert [int(r[4]) for r in rows] == c["psn"].tolist()
    assert [int(r[5], 0) for r in rows] == c["dest_qp"].tolist()
    assert [int(r[6]) if r[6] else -1 for r in rows] == c["dma_len"].tolist()


def test_native_ib_vcrc_and_icrc_faults(tmp_path):
    frames = ib_frames()
    frames[1] = frames[1][:-1] + bytes([frames[1][-1] ^ 0x80])        # VCRC
    rep = validate_capture(erf_file(tmp_path / "v.erf", frames))
    (v,) = only(rep, "vcrc")
    stored = struct.unpack("<H", frames[1][-2:])[0]
    assert v.frame == 2 and v.message.startswith(f"VCRC {stored:#06x}, expected 0x")
    frames = ib_frames()
    f = bytearray(frames[2])
    f[-6] ^= 0x01                                                      # ICRC (VCRC then wrong too)
    frames[2] = bytes(f)
    rep = validate_capture(erf_file(tmp_path / "i.erf", frames))
    assert rep.counts["icrc"] == 1 and rep.counts["vcrc"] == 1 and rep.total_violations == 2
    # changing the VL is invisible to the ICRC, not to the VCRC
    frames = ib_frames()
    frames[0] = bytes([frames[0][0] | 0x30]) + frames[0][1:]
    rep = validate_capture(erf_file(tmp_path / "vl.erf", frames))
    only(rep, "vcrc")


def test_native_ib_with_grh(tmp_path):
    frames = [ib_frame(0x04, 1, 0x77, data(100), grh=True),
              ib_frame(0x04, 2, 0x77, data(9, 1), grh=True)]
    path = erf_file(tmp_path / "grh.erf", frames)
    rep = validate_capture(path)
    assert rep.ok and rep.checked["icrc"] == 2 and rep.checked["vcrc"] == 2, rep.as_dict()
    c = read_packets(path)
    assert c["bth_offset"].tolist() == [48, 48]
    assert [format_address(a) for a in c["src_addr"]] == ["fe80::2:c903:0:1111"] * 2
    assert [format_address(a) for a in c["dst_addr"]] == ["fe80::2:c903:0:2222"] * 2
    assert c["payload_len"].tolist() == [100, 9] and c["frame_len"].tolist() == [len(f) for f in frames]
    # the GRH hop limit and the whole LRH (a router rewrites DLID and SLID) are outside the
    # ICRC of a global packet, but inside the VCRC
    f = bytearray(frames[1])
    f[15] = 1
    g = bytearray(frames[0])
    g[2:4] = b"\x00\x63"  # DLID 0x63
    g[6:8] = b"\x00\x64"  # SLID 0x64
    rep = validate_capture(erf_file(tmp_path / "grh2.erf", [bytes(g), bytes(f)]))
    assert sorted(v.frame for v in only(rep, "vcrc", 2)) == [1, 2]
    # a GRH PayLen that disagrees with the LRH PktLen (CRCs recomputed over the wrong value)
    rep = validate_capture(erf_file(tmp_path / "grh3.erf",
                                    [ib_frame(0x04, 1, 0x77, data(100), grh=True, paylen_error=4)]))
    (v,) = only(rep, "length")
    assert v.message == "GRH PayLen 120 but the LRH PktLen leaves 116 bytes after the GRH"
    shown = subprocess.run([tshark(), "-r", str(path), "-T", "fields", "-e", "infiniband.grh.sgid",
                            "-e", "infiniband.grh.dgid", "-e", "infiniband.bth.psn"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert shown == ["fe80::2:c903:0:1111", "fe80::2:c903:0:2222", "1",
                     "fe80::2:c903:0:1111", "fe80::2:c903:0:2222", "2"]


def test_packets_table_columns(tmp_path):
    from wiretrace.tables import column_names, numpy_dtype
    from wiretrace.transport.parse import as_packets

    path = write_pcap(tmp_path / "good.pcap", good_frames())
    p = as_packets(read_packets(path))
    assert list(p) == column_names("packets")
    for name, col in p.items():
        assert col.dtype == numpy_dtype("packets", name), name
    assert p["msg_id"].tolist() == [-1] * 18 and p["src_nic"].tolist() == [-1] * 18
    assert p["opcode"].tolist() == GOOD_FIELDS["opcode"]
    assert p["payload_len"].tolist() == GOOD_FIELDS["payload_len"]


# -- captures written by `wiretrace generate` ----------------------------------------------------

SAMPLE_PLAN = Path(__file__).resolve().parents[1] / "samples" / "plans" / "gpt2-small-2x4.json"


def generate(*args):
    res = CliRunner().invoke(main, ["generate", *map(str, args), "--quiet"])
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def demo_capture(tmp_path_factory) -> Path:
    """The demo iteration, headers only (the default snap length), with its Parquet tables."""
    out = tmp_path_factory.mktemp("demo") / "iter.pcap"
    generate("--plan", SAMPLE_PLAN, "-o", out)
    return out


def test_generated_capture_validates_and_parses_to_its_packets_table(demo_capture):
    import pyarrow.parquet as pq
    from wiretrace.transport.parse import as_packets

    table = pq.read_table(demo_capture.with_suffix(".parquet") / "packets.parquet").to_pydict()
    rep = validate_capture(demo_capture)
    assert rep.ok, rep.as_dict()
    assert rep.frames == rep.roce_frames == len(table["ts_ns"])
    assert rep.checked["psn"] > 0 and rep.checked["reth_length"] > 0 and rep.checked["ack_msn"] > 0
    parsed = as_packets(read_packets(demo_capture))
    for name in ("ts_ns", "udp_sport", "dest_qp", "psn", "opcode", "ack_req", "payload_len", "pad",
                 "frame_len", "dscp", "ecn"):
        assert parsed[name].tolist() == table[name], name


@pytest.mark.parametrize("transport,snaplen,frames", [
    ({"kind": "ib"}, 10, 2096),          # the LRH and 2 bytes of the BTH
    ({"ip_version": 6}, 20, 2072),       # Ethernet and part of the IPv6 header
    ({}, 50, 2088),                      # Ethernet, IPv4 and UDP, 8 bytes of the BTH
])
def test_generated_captures_cut_before_the_bth_are_nothing_checked(tmp_path, transport, snaplen, frames):
    plan = json.loads(SAMPLE_PLAN.read_text())
    plan["transport"].update(transport)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    out = tmp_path / "cut.pcap"
    generate("--plan", plan_path, "-o", out, "--snaplen", snaplen, "--window", "5.3ms:5.4ms",
             "--no-parquet")
    res = run_cli(out, "--json")
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert doc["frames"] == doc["cut_before_bth"] == frames and doc["roce_frames"] == 0
    assert doc["ok"] is False and doc["nothing_checked"] is True
    assert doc["violations"] == [{"frame": 0, "qp": None, "check": "capture", "message":
                                  f"nothing checked: {frames} frame(s) cut by the snap length before the "
                                  f"BTH, RoCE/IB as far as their captured headers go ({frames} frame(s) in the "
                                  f"capture)"}]
    text = run_cli(out)
    assert text.exit_code == 1 and "nothing checked" in text.output and "clean" not in text.output


@pytest.mark.parametrize("transport,suffix", [
    ({}, "pcapng"),
    ({"ip_version": 6, "vlan": 100, "pcp": 3, "initial_psn": 16777200}, "pcap"),
    ({"kind": "ib"}, "erf"),
])
def test_generated_whole_frames_validate(tmp_path, demo_capture, transport, suffix):
    import pyarrow.parquet as pq

    ts = np.sort(pq.read_table(demo_capture.with_suffix(".parquet") / "packets.parquet")
                 .column("ts_ns").to_numpy())
    plan = json.loads(SAMPLE_PLAN.read_text())
    plan["transport"].update(transport)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    out = tmp_path / f"w.{suffix}"
    generate("--plan", plan_path, "-o", out, "--snaplen", "0", "--no-parquet",
             "--window", f"0:{int(ts[2000])}")
    rep = validate_capture(out)
    assert rep.ok, rep.as_dict()
    assert rep.frames >= 1000 and rep.checked["icrc"] == rep.frames and rep.truncated == 0
    assert rep.checked["vcrc"] == (rep.frames if transport.get("kind") == "ib" else 0)


@pytest.mark.parametrize("snaplen", [54, 58, 62])
def test_read_requests_cut_before_their_dma_length_leave_the_next_psn_unchecked(tmp_path, snaplen):
    """A READ request consumes one PSN per response, known only from its RETH DMA length: cut
    before it, the next request on the stream is not checked (no false PSN gap), and a real gap
    after a whole READ request is still found (test_psn_gap_after_read_request)."""
    plan = json.loads(SAMPLE_PLAN.read_text())
    plan["transport"].update(verb="read")
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    out = tmp_path / "cut.pcap"
    generate("--plan", plan_path, "-o", out, "--snaplen", snaplen, "--window", "5ms:6ms", "--no-parquet")
    res = run_cli(out, "--json")
    doc = json.loads(res.output)
    assert res.exit_code == 0, doc["violations"][:3]
    assert doc["ok"] is True and doc["roce_frames"] == doc["frames"] == 12728
    assert doc["counts"]["psn"] == 0


@pytest.mark.parametrize("snaplen,suffix", [(1, "pcap"), (13, "pcapng"), (5, "erf")])
def test_frames_cut_inside_the_link_header_are_counted_as_cut_not_other(tmp_path, snaplen, suffix):
    """Frames cut inside their Ethernet header cannot be told apart: they are truncated, not
    "other", and the capture is "nothing checked" saying why (native IB records are known to
    be IB, see test_native_ib_records_cut_inside_the_lrh)."""
    plan_path = SAMPLE_PLAN
    out = tmp_path / f"cut.{suffix}"
    generate("--plan", plan_path, "-o", out, "--snaplen", snaplen, "--window", "5ms:6ms", "--no-parquet")
    res = run_cli(out, "--json")
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert doc["frames"] == doc["truncated"] == doc["cut_before_link_header"] == 11632
    assert doc["non_roce_frames"] == doc["roce_frames"] == doc["cut_before_bth"] == 0
    assert doc["nothing_checked"] is True
    assert doc["violations"][0]["message"] == (
        "nothing checked: 11632 frame(s) cut by the snap length inside their link-layer header (cannot "
        "tell whether they are RoCEv2 / InfiniBand) (11632 frame(s) in the capture)")


def test_an_empty_erf_file_is_an_empty_capture_but_an_empty_pcap_is_not(tmp_path):
    """ERF has no file header, so a 0-byte .erf (a generate window with no packets) is a capture
    of no records: "nothing checked", exit 1, like a pcap with a header and no records; a 0-byte
    .pcap lacks its header and cannot be read (exit 2)."""
    erf = tmp_path / "none.erf"
    erf.write_bytes(b"")
    res = run_cli(erf, "--json")
    doc = json.loads(res.output)
    assert res.exit_code == 1 and doc["format"] == "erf" and doc["frames"] == 0
    assert doc["nothing_checked"] is True
    pcap = tmp_path / "none.pcap"
    pcap.write_bytes(b"")
    res = run_cli(pcap)
    assert res.exit_code == 2 and res.output.startswith("error: ") and "empty file" in res.output


def test_validate_reads_standard_input(tmp_path):
    """CAPTURE '-' reads the capture from standard input (tcpdump -w - | wiretrace validate -)."""
    path = write_pcap(tmp_path / "good.pcap", good_frames())
    r = subprocess.run([sys.executable, "-m", "wiretrace.cli", "validate", "-", "--json"],
                       stdin=path.open("rb"), capture_output=True, text=True, timeout=120)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["file"] == "standard input" and doc["frames"] == 18
    r = subprocess.run([sys.executable, "-m", "wiretrace.cli", "validate", "-"], input="hello\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == ("error: standard input: not a capture: first bytes 68656c6c6f0a "
                                              "are neither pcap nor pcapng magic nor an ERF record header\n")


def test_validate_a_directory_checks_each_capture(tmp_path):
    """A directory (as generate --split nic writes) has each capture checked on its own; the
    status is 1 when any of them has a violation, and the last line names it."""
    d = tmp_path / "split"
    d.mkdir()
    write_pcap(d / "node0-mlx5_0.pcap", good_frames())
    frames = good_frames()
    frames[0] = frames[0][:-1] + bytes([frames[0][-1] ^ 1])                 # flip an ICRC byte
    write_pcap(d / "node1-mlx5_0.pcap", frames)
    (d / "notes.txt").write_text("not a capture")
    r = subprocess.run([sys.executable, "-m", "wiretrace.cli", "validate", str(d), "--json"],
                       capture_output=True, text=True, timeout=120)
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["ok"] is False
    assert [(Path(c["file"]).name, c["ok"]) for c in doc["captures"]] == [("node0-mlx5_0.pcap", True),
                                                                         ("node1-mlx5_0.pcap", False)]
    r = subprocess.run([sys.executable, "-m", "wiretrace.cli", "validate", str(d)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout.splitlines()[-1] == f"{d}: 2 captures, 1 clean, 1 not (node1-mlx5_0.pcap)"
    # a file that is not a capture: the others are still reported, the status is 2
    (d / "node2-mlx5_0.pcap").write_bytes(b"garbage, not a capture")
    write_pcap(d / "node2-mlx5_0.pcap1", good_frames())
    write_pcap(d / "node2-mlx5_0.pcap10", good_frames())
    write_pcap(d / "node2-mlx5_0.pcap2", good_frames())
    r = subprocess.run([sys.executable, "-m", "wiretrace.cli", "validate", str(d), "--json"],
                       capture_output=True, text=True, timeout=120)
    doc = json.loads(r.stdout)
    assert r.returncode == 2
    assert [Path(c["file"]).name for c in doc["captures"]] == [
        "node0-mlx5_0.pcap", "node1-mlx5_0.pcap", "node2-mlx5_0.pcap", "node2-mlx5_0.pcap1",
        "node2-mlx5_0.pcap2", "node2-mlx5_0.pcap10"]                     # in rotation order
    assert doc["captures"][2]["error"].endswith("are neither pcap nor pcapng magic nor an ERF record header")
    r = subprocess.run([sys.executable, "-m", "wiretrace.cli", "validate", str(d)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout.splitlines()[-1] == (
        f"{d}: 6 captures, 4 clean, 1 not (node1-mlx5_0.pcap), 1 not read (node2-mlx5_0.pcap)")


@pytest.mark.parametrize("kind,suffix", [("rocev2", "pcap"), ("ib", "erf")])
def test_generated_reads_over_several_qps_per_connection_are_clean(tmp_path, kind, suffix):
    """RDMA READ over 4 QPs per connection: the QPs of one connection issue requests at the same
    PSNs; every response is paired with its own request (by UDP port over RoCEv2; over native IB,
    which has no port, by the request whose length it carries), so the capture is clean and every
    READ's length is checked."""
    from conftest import SAMPLES

    plan = json.loads((SAMPLES / "gpt2-small-2x4.json").read_text())
    plan["transport"] = {"kind": kind, "verb": "read"}
    plan.setdefault("collectives", {})["qps_per_connection"] = 4
    (tmp_path / "p.json").write_text(json.dumps(plan))
    out = tmp_path / f"r.{suffix}"
    g = subprocess.run([sys.executable, "-m", "wiretrace.cli", "generate", "--plan", str(tmp_path / "p.json"),
                        "-o", str(out), "-q"], capture_output=True, text=True, timeout=300)
    assert g.returncode == 0, g.stderr
    import pyarrow.parquet as pq

    op = pq.read_table(tmp_path / "r.parquet" / "packets.parquet").column("opcode").to_numpy()
    rep = validate_capture(out)
    assert rep.ok, rep.as_dict()
    assert rep.checked["reth_length"] == int((op == 0x0C).sum()) > 100
