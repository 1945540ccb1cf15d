"""Transport stage: header declarations, ICRC/VCRC, QPs, packetization, rendering, tshark decoding.

Expected values come from the protocol documents, from the real frames in ../shared/real, from
independent plain-Python re-implementations written here (bitwise CRCs, the kernel's UDP port
formula), from scapy.contrib.roce, and from tshark's dissectors — never from the code under test.
"""

from __future__ import annotations

import importlib
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from wiretrace import plan as P
from wiretrace import tables, topology
from wiretrace.errors import WiretraceError
from wiretrace.io import write_capture
from wiretrace.transport import assign_qps, headers as H, icrc as C, packetize, render
from wiretrace.transport.packetize import TEMPLATE_COLUMN
from wiretrace.transport.qp import udp_sport

from conftest import REAL, require_tool

# ------------------------------------------------------------------------------------------------
# helpers


def make_plan(transport: dict | None = None, nodes: int = 2, nics: int = 2, seed: int = 0,
              qps: int = 1, subnets: int = 1):
    doc = {"name": "t", "seed": seed,
           "cluster": {"nodes": nodes, "gpus_per_node": nics, "nics_per_node": nics,
                       "nic_rate": "400Gbps", "latency": "2us", "subnets": subnets},
           "collectives": {"qps_per_connection": qps},
           "transport": dict({"path_mtu": 1024}, **(transport or {}))}
    plan = P.from_dict(doc, require_model=False)
    return plan, topology.build(plan)


def make_messages(sizes, src, dst, t_start, kind=None, channel=None, rate_bps=400e9, latency=2000):
    """A network messages table built directly from the declared columns."""
    n = len(sizes)
    m = {c: np.zeros(n, dtype=tables.numpy_dtype("messages", c)) for c in tables.column_names("messages")}
    m["msg_id"] = np.arange(n, dtype=np.int64)
    m["src_nic"] = np.asarray(src, dtype=np.int32)
    m["dst_nic"] = np.asarray(dst, dtype=np.int32)
    m["link"] = np.array(["network"] * n, dtype=object)
    m["kind"] = np.array(kind or ["data"] * n, dtype=object)
    m["bytes"] = np.asarray(sizes, dtype=np.int64)
    m["wire_bytes"] = np.asarray(sizes, dtype=np.int64)
    m["verb"] = np.array([""] * n, dtype=object)
    m["channel"] = np.asarray(channel if channel is not None else [0] * n, dtype=np.int16)
    m["qpn"][:] = -1
    m["udp_sport"][:] = -1
    m["t_start_ns"] = np.asarray(t_start, dtype=np.int64)
    # serialization including generous header overhead, then one hop
    pk = np.maximum(1, -(-m["bytes"] // 1024))
    dur = np.ceil((m["bytes"] + pk * 100) * 8 / rate_bps * 1e9).astype(np.int64)
    m["t_end_ns"] = m["t_start_ns"] + dur + latency
    return m


def serial_messages(sizes, src=0, dst=2, gap=0, **kw):
    """Messages sent one after another from one NIC to another."""
    starts, t = [], 0
    for s in sizes:
        starts.append(t)
        t += int(np.ceil((s + 100 * max(1, -(-s // 1024))) * 8 / 400)) + gap
    return make_messages(sizes, [src] * len(sizes), [dst] * len(sizes), starts, **kw)


def all_packets(messages, topo, plan, **kw) -> dict:
    chunks = list(packetize(messages, topo, plan, **kw))
    return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


def tshark_fields(path: Path, fields: list[str], extra: list[str] = ()) -> list[list[str]]:
    exe = require_tool("tshark")
    cmd = [exe, "-r", str(path), "-T", "fields", "-E", "occurrence=f", *extra]
    for f in fields:
        cmd += ["-e", f]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [line.split("\t") for line in out.splitlines()]


def tshark_expert_problems(path: Path) -> list[str]:
    """Expert-info entries of severity warning or error (empty when Wireshark is content)."""
    exe = require_tool("tshark")
    # Wireshark 4.0's RPC-over-RDMA heuristic reads past SEND payloads shorter than 4 bytes and
    # reports its own exception as a malformed packet; NFS-over-RDMA is not in these captures.
    out = subprocess.run([exe, "-r", str(path), "--disable-protocol", "rpcordma", "-q", "-z", "expert,warn"],
                         capture_output=True,
                         text=True, check=True).stdout
    return [ln for ln in out.splitlines() if ln.strip().startswith(("Errors", "Warns")) or "Malformed" in ln]


def real_frames() -> list[bytes]:
    lines = [ln.strip() for ln in (REAL / "roce_packets" / "scapy_roce_test_vectors.hex").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    return [bytes.fromhex(ln) for ln in lines]


# ------------------------------------------------------------------------------------------------
# header declarations


def test_header_lengths_follow_the_specifications():
    assert {n: h.length for n, h in H.HEADERS.items()} == {
        "eth": 14, "vlan": 4, "ipv4": 20, "ipv6": 40, "udp": 8, "lrh": 8, "grh": 40, "bth": 12,
        "rdeth": 4, "deth": 8, "reth": 16, "atomiceth": 28, "aeth": 4, "atomicacketh": 8,
        "immdt": 4, "ieth": 4, "cnp": 16}


def test_opcodes_are_transport_plus_operation():
    # IBTA vol. 1 table 38
    assert H.opcode("RC_SEND_FIRST") == 0x00
    assert H.opcode("RC_RDMA_WRITE_FIRST") == 0x06
    assert H.opcode("RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE") == 0x0B
    assert H.opcode("RC_RDMA_READ_REQUEST") == 0x0C
    assert H.opcode("RC_RDMA_READ_RESPONSE_ONLY") == 0x10
    assert H.opcode("RC_ACKNOWLEDGE") == 0x11
    assert H.opcode("UC_SEND_ONLY") == 0x24
    assert H.opcode("UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE") == 0x2B
    assert H.opcode("RD_SEND_ONLY") == 0x44
    assert H.opcode("UD_SEND_ONLY") == 0x64
    assert H.opcode("UD_SEND_ONLY_WITH_IMMEDIATE") == 0x65
    assert H.CNP_OPCODE == 0x81 and H.OPCODES[0x81].name == "CNP"
    assert "UC_RDMA_READ_REQUEST" not in H.OPCODE_BY_NAME and "UD_SEND_FIRST" not in H.OPCODE_BY_NAME
    ext = {name: H.OPCODES[code].ext for name, code in H.OPCODE_BY_NAME.items()}
    assert ext["RC_RDMA_WRITE_FIRST"] == ("reth",)
    assert ext["RC_RDMA_WRITE_MIDDLE"] == ()
    assert ext["RC_RDMA_WRITE_LAST_WITH_IMMEDIATE"] == ("immdt",)
    assert ext["RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE"] == ("reth", "immdt")
    assert ext["RC_RDMA_READ_RESPONSE_FIRST"] == ("aeth",)
    assert ext["RC_RDMA_READ_RESPONSE_MIDDLE"] == ()
    assert ext["UD_SEND_ONLY_WITH_IMMEDIATE"] == ("deth", "immdt")
    assert ext["RD_RDMA_WRITE_FIRST"] == ("rdeth", "deth", "reth")
    assert int(H.EXT_LEN[0x0B]) == 20 and int(H.EXT_LEN[0x11]) == 4 and int(H.EXT_LEN[0x81]) == 16


@pytest.mark.parametrize("name", sorted(H.HEADERS))
def test_pack_then_parse_gives_the_columns_back(name):
    hdr = H.HEADERS[name]
    rng = np.random.default_rng(len(name))
    n = 257
    values = {}
    for f in hdr.fields:
        if f.bits > 64:
            values[f.name] = rng.integers(0, 256, (n, f.bits // 8), dtype=np.uint8)
        else:
            values[f.name] = rng.integers(0, 1 << min(f.bits, 63), n, dtype=np.uint64) & np.uint64((1 << f.bits) - 1)
    rows = hdr.pack(n, values)
    wide = np.zeros((n, hdr.length + 5), dtype=np.uint8)
    wide[:, 3:3 + hdr.length] = rows
    back = hdr.parse(wide, 3)
    for f in hdr.fields:
        np.testing.assert_array_equal(np.asarray(back[f.name], dtype=np.uint64) if f.bits <= 64 else back[f.name],
                                      values[f.name] if f.bits > 64 else values[f.name].astype(np.uint64), err_msg=f.name)
    # per-row offsets read the same values
    offs = rng.integers(0, 6, n)
    shifted = np.zeros((n, hdr.length + 5), dtype=np.uint8)
    for i in range(n):
        shifted[i, offs[i]:offs[i] + hdr.length] = rows[i]
    back2 = hdr.parse(shifted, offs)
    for f in hdr.fields:
        np.testing.assert_array_equal(back2[f.name], back[f.name])


def test_bth_bit_layout_matches_the_wire():
    # opcode 0x0A, SE 1, M 0, PadCnt 3, TVer 0, P_Key 0x8001, BECN, DestQP 0x123456, AckReq, PSN 0xABCDEF
    row = H.BTH.pack(1, {"opcode": 0x0A, "se": 1, "migreq": 0, "padcnt": 3, "pkey": 0x8001,
                         "becn": 1, "destqp": 0x123456, "ackreq": 1, "psn": 0xABCDEF})
    assert row.tobytes().hex() == "0ab080014012345680abcdef"


def test_scalar_values_are_checked():
    with pytest.raises(ValueError):
        H.BTH.pack(1, {"padcnt": 4})
    with pytest.raises(KeyError):
        H.BTH.pack(1, {"nosuch": 1})


# ------------------------------------------------------------------------------------------------
# the two real frames, byte for byte


def test_real_uc_send_only_frame_rebuilt_byte_for_byte():
    frame = real_frames()[0]
    payload = frame[54:54 + 18]
    n = 1
    eth = H.ETHERNET.pack(n, {"dst": bytes.fromhex("248a07a8fa22"), "src": bytes.fromhex("248a07a8fa22")})
    ip = H.IPV4.pack(n, {"dscp": 0, "ecn": 1, "total_length": 64, "id": 0x0478,
                         "src": 0xC0A80007, "dst": 0xC0A80007})
    ip[:, 10:12] = np.frombuffer(int(H.ipv4_checksum(ip)[0]).to_bytes(2, "big"), np.uint8)
    udp = H.UDP.pack(n, {"sport": 49152, "length": 44})
    bth = H.BTH.pack(n, {"opcode": H.opcode("UC_SEND_ONLY"), "migreq": 1, "padcnt": int(H.pad_count(18)),
                         "destqp": 211, "psn": 13571856})
    body = np.concatenate([ip, udp, bth, np.frombuffer(payload + b"\0\0", np.uint8)[None, :]], axis=1)
    crc = C.icrc_bytes(C.icrc_rocev2(body, 4))
    ip_udp = np.concatenate([body, crc], axis=1)
    ip_udp[:, 26:28] = np.frombuffer(int(H.udp_checksum_ipv4(ip_udp)[0]).to_bytes(2, "big"), np.uint8)
    built = np.concatenate([eth, ip_udp], axis=1).tobytes()
    assert built == frame
    assert int(H.ipv4_checksum(ip)[0]) == 0xB4D5 and built[-4:] == bytes.fromhex("78f353f3")


def test_real_connectx_cnp_rebuilt_byte_for_byte():
    frame = real_frames()[1]
    n = 1
    eth = H.ETHERNET.pack(n, {"dst": bytes.fromhex("e41d2dab2bc2"), "src": bytes.fromhex("7cfe90643b32")})
    ip = H.IPV4.pack(n, {"dscp": 48, "ecn": 2, "total_length": 60, "id": 0x718C,
                         "src": 0x0A001101, "dst": 0x0A001201})
    ip[:, 10:12] = np.frombuffer(int(H.ipv4_checksum(ip)[0]).to_bytes(2, "big"), np.uint8)
    udp = H.UDP.pack(n, {"sport": 0, "length": 40})
    bth = H.BTH.pack(n, {"opcode": H.CNP_OPCODE, "migreq": 0, "becn": 1, "destqp": 0x118, "psn": 0})
    body = np.concatenate([ip, udp, bth, H.CNP.pack(n)], axis=1)
    built = np.concatenate([eth, body, C.icrc_bytes(C.icrc_rocev2(body, 4))], axis=1).tobytes()
    assert built == frame
    assert built[-4:] == bytes.fromhex("82fd002a")


def test_parser_reads_the_real_frames():
    f1, f2 = real_frames()
    rows = np.zeros((2, 80), dtype=np.uint8)
    rows[0, :len(f1)] = np.frombuffer(f1, np.uint8)
    rows[1, :len(f2)] = np.frombuffer(f2, np.uint8)
    bth = H.BTH.parse(rows, 42)
    assert bth["opcode"].tolist() == [0x24, 0x81]
    assert bth["destqp"].tolist() == [211, 0x118]
    assert bth["psn"].tolist() == [13571856, 0]
    assert bth["becn"].tolist() == [0, 1] and bth["padcnt"].tolist() == [2, 0]
    ip = H.IPV4.parse(rows, 14)
    assert ip["dscp"].tolist() == [0, 48] and ip["ecn"].tolist() == [1, 2]
    assert H.ipv4_checksum_ok(rows[:, 14:34]).all()


# ------------------------------------------------------------------------------------------------
# CRCs against independent implementations


def _crc16_bitwise_msb_first(data: bytes) -> int:
    """IB VCRC the long way: polynomial 0x100B, non-reflected register over bit-reversed bytes,
    init 0xFFFF, result bit-reversed and complemented (IBTA vol. 1 7.8.2)."""
    reg = 0xFFFF
    for byte in data:
        rev = int(f"{byte:08b}"[::-1], 2)
        for i in range(7, -1, -1):
            top = (reg >> 15) ^ ((rev >> i) & 1)
            reg = ((reg << 1) & 0xFFFF) ^ (0x100B if top else 0)
    return int(f"{reg:016b}"[::-1], 2) ^ 0xFFFF


def test_crc32_rows_of_any_length_equal_zlib():
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, (300, 97), dtype=np.uint8)
    lens = rng.integers(0, 98, 300)
    got = C.CRC32.of_rows(buf, lens) ^ np.uint32(0xFFFFFFFF)
    assert got.tolist() == [zlib.crc32(buf[i, :lens[i]].tobytes()) for i in range(300)]


def test_vcrc_equals_bitwise_crc16():
    rng = np.random.default_rng(8)
    buf = rng.integers(0, 256, (60, 41), dtype=np.uint8)
    lens = rng.integers(1, 42, 60)
    got = C.vcrc(buf, lens)
    assert got.tolist() == [_crc16_bitwise_msb_first(buf[i, :lens[i]].tobytes()) for i in range(60)]


def test_crc_shift_through_zeros_is_linear_and_invertible():
    rng = np.random.default_rng(9)
    s = rng.integers(0, 2**32, 100, dtype=np.uint32)
    k = rng.integers(0, 5000, 100)
    fwd = C.CRC32.shift(s, k)
    for i in range(0, 100, 17):
        assert int(fwd[i]) == C.CRC32.register(int(s[i]), bytes(int(k[i]))) ^ C.CRC32.register(0, bytes(int(k[i])))
    np.testing.assert_array_equal(C.CRC32.shift(fwd, k, inverse=True), s)


# ------------------------------------------------------------------------------------------------
# QPs and UDP source ports


def _kernel_udp_sport(lqpn: int, rqpn: int) -> int:
    # include/rdma/ib_verbs.h: rdma_calc_flow_label + rdma_flow_label_to_udp_sport
    fl = (lqpn * rqpn) & 0xFFFFFFFFFFFFFFFF
    fl ^= fl >> 20
    fl ^= fl >> 40
    fl &= 0xFFFFF
    low, high = fl & 0x3FFF, fl & 0xFC000
    return (low ^ (high >> 14)) | 0xC000


def test_udp_source_port_is_linux_rdma_get_udp_sport():
    rng = np.random.default_rng(3)
    a = rng.integers(1, 1 << 24, 500)
    b = rng.integers(1, 1 << 24, 500)
    got = udp_sport(a, b)
    assert got.tolist() == [_kernel_udp_sport(int(x), int(y)) for x, y in zip(a, b)]
    assert ((got >= 49152) & (got <= 65535)).all()
    np.testing.assert_array_equal(udp_sport(b, a), got)  # symmetric: both directions agree


def test_assign_qps_one_qp_pair_per_connection_and_channel():
    plan, topo = make_plan()
    m = make_messages([100] * 6, [0, 0, 0, 2, 1, 2], [2, 2, 2, 0, 3, 0], [0, 10, 20, 30, 40, 50],
                      kind=["data", "data", "data", "cts", "data", "data"], channel=[0, 0, 1, 0, 0, 0])
    m["link"][4] = "nvlink"
    out = assign_qps(m, topo, plan)
    q, s = out["qpn"], out["udp_sport"]
    assert q[0] == q[1] != q[2]              # same connection, other channel
    assert q[4] == -1 and s[4] == -1 and out["verb"][4] == ""
    assert out["verb"][3] == "write" and out["verb"][0] == "write_imm"
    # the cts (2 -> 0) travels on the data connection 0 -> 2: same UDP port, DestQP on NIC 0
    assert s[3] == s[0]
    # data from 2 to 0 is another connection (NCCL's other direction)
    assert q[5] != q[3] and s[5] != s[0]
    assert ((s[s >= 0] >= 49152)).all()


def test_qps_per_connection_round_robin():
    plan, topo = make_plan(qps=2)
    m = serial_messages([100] * 4)
    out = assign_qps(m, topo, plan)
    assert out["qpn"][0] == out["qpn"][2] != out["qpn"][1] == out["qpn"][3]
    assert out["udp_sport"][0] != out["udp_sport"][1]
    p = all_packets(out, topo, plan)
    data = p["opcode"] != 0x11
    for q in np.unique(p["dest_qp"][data]):
        psn = p["psn"][data & (p["dest_qp"] == q)]
        assert psn.tolist() == list(range(len(psn)))    # each QP its own PSN space


# ------------------------------------------------------------------------------------------------
# packetization


SIZES = [0, 1, 3, 1023, 1024, 1025, 3 * 1024 + 5]


def test_segmentation_opcodes_reth_pad_and_conservation():
    plan, topo = make_plan()
    m = serial_messages(SIZES)
    p = all_packets(m, topo, plan)
    data = p["opcode"] != 0x11
    assert int(p["payload_len"][data].sum()) == sum(SIZES)
    for i, size in enumerate(SIZES):
        sel = data & (p["msg_id"] == i)
        ops = p["opcode"][sel].tolist()
        pay = p["payload_len"][sel].tolist()
        n = max(1, -(-size // 1024))
        assert len(ops) == n
        if n == 1:
            assert ops == [0x0B] and pay == [size]
        else:
            assert ops == [0x06] + [0x07] * (n - 2) + [0x09]
            assert pay[:-1] == [1024] * (n - 1) and pay[-1] == size - 1024 * (n - 1)
        assert p["dma_len"][sel].tolist() == [size] + [-1] * (n - 1)
        assert p["pad"][sel].tolist() == [(-x) % 4 for x in pay]
        assert p["ack_req"][sel].tolist() == [False] * (n - 1) + [True]
    # frame length = 14 + 20 + 8 + 12 + ext + payload + pad + 4
    ext = np.select([p["opcode"] == 0x06, p["opcode"] == 0x09, p["opcode"] == 0x0B, p["opcode"] == 0x11],
                    [16, 4, 20, 4], 0)
    np.testing.assert_array_equal(p["frame_len"], 58 + ext + p["payload_len"] + p["pad"])


def test_psn_contiguous_per_qp_and_one_ack_per_message_with_msn():
    plan, topo = make_plan()
    m = serial_messages(SIZES * 3)
    p = all_packets(m, topo, plan)
    data = p["opcode"] != 0x11
    psn = p["psn"][data]
    assert psn.tolist() == list(range(len(psn)))
    acks = ~data
    assert int(acks.sum()) == len(SIZES) * 3
    order = np.argsort(p["msg_id"][acks])
    assert p["msn"][acks][order].tolist() == list(range(1, len(SIZES) * 3 + 1))
    # each ACK names the last PSN of its message and goes back to the sender's QP
    last_psn = {int(mid): int(s) for mid, s in zip(p["msg_id"][data], p["psn"][data])}
    assert all(int(s) == last_psn[int(mid)] for mid, s in zip(p["msg_id"][acks], p["psn"][acks]))
    assert (p["src_nic"][acks] == 2).all() and (p["dst_nic"][acks] == 0).all()
    assert len(np.unique(p["dest_qp"][acks])) == 1 and p["dest_qp"][acks][0] != p["dest_qp"][data][0]
    # an ACK leaves once its message has arrived: at t_end, and never before the last data
    # packet's last bit (its frame + 24 bytes of Ethernet overhead at 400 Gb/s, then 2 us)
    ack_ts = dict(zip(p["msg_id"][acks].tolist(), p["ts_ns"][acks].tolist()))
    last = np.r_[p["msg_id"][data][1:] != p["msg_id"][data][:-1], True]
    for mid, ts, fl in zip(p["msg_id"][data][last], p["ts_ns"][data][last], p["frame_len"][data][last]):
        arrived = ts + (fl + 24) * 8 / 400 + 2000
        due = max(m["t_end_ns"][mid], arrived)
        assert due <= ack_ts[mid] <= due + 3, (mid, ack_ts[mid], due)


def test_psn_wraps_at_2_to_the_24(tmp_path):
    plan, topo = make_plan({"initial_psn": (1 << 24) - 3})
    m = serial_messages([10 * 1024])
    p = all_packets(m, topo, plan)
    data = p["opcode"] != 0x11
    assert p["psn"][data].tolist() == [16777213, 16777214, 16777215, 0, 1, 2, 3, 4, 5, 6]
    assert p["psn"][~data].tolist() == [6]
    path = tmp_path / "wrap.pcap"
    write_capture(path, [p], topo, plan)
    assert [int(r[0]) for r in tshark_fields(path, ["infiniband.bth.psn"])] == p["psn"].tolist()


def test_random_initial_psn_is_seeded():
    m = serial_messages([100])
    psn = []
    for seed in (1, 1, 2):
        plan, topo = make_plan({"initial_psn": "random"}, seed=seed)
        psn.append(int(all_packets(m, topo, plan)["psn"][0]))
    assert psn[0] == psn[1] != psn[2]
    assert all(0 <= x < (1 << 24) for x in psn)


def test_packet_times_fill_the_message_wire_time():
    plan, topo = make_plan()
    m = serial_messages([8 * 1024 + 7, 100, 5000], gap=10)   # the link is idle at each start
    p = all_packets(m, topo, plan)
    data = p["opcode"] != 0x11
    for i in range(3):
        sel = data & (p["msg_id"] == i)
        ts = p["ts_ns"][sel]
        assert ts[0] == m["t_start_ns"][i]
        assert (np.diff(ts) > 0).all()
        # the last packet's last bit leaves at t_end - latency (Ethernet adds 24 bytes on the wire)
        last_bits = ts[-1] + (p["frame_len"][sel][-1] + 24) * 8 / 400
        assert abs(last_bits - (m["t_end_ns"][i] - 2000)) <= 2


def assert_links_never_overlap(p, rate_bps=400e9, extra=24):
    """Per sending NIC, each frame starts after the previous one has left: frame + ``extra``
    bytes of Ethernet (preamble+SFD 8, FCS 4, inter-frame gap 12) at ``rate_bps``. Times are
    whole ns (the exact start rounded up), so a gap may fall short by less than 1 ns; over any
    run of frames the wire time adds up exactly."""
    for nic in np.unique(p["src_nic"]):
        sel = p["src_nic"] == nic
        ts = p["ts_ns"][sel].astype(np.float64)
        wire = (p["frame_len"][sel] + extra) * 8 / rate_bps * 1e9
        assert (np.diff(ts) > wire[:-1] - 1).all(), nic
        before = np.cumsum(wire) - wire
        slack = ts - before             # start minus the wire time of all earlier frames
        assert (slack > np.maximum.accumulate(slack) - 1).all(), nic


@pytest.mark.parametrize("transport", [{}, {"verb": "read"}, {"ack": {"every_packets": 2}},
                                       {"ecn_marking": {"fraction": 0.3, "cnp_interval": "1us"}},
                                       {"kind": "ib"}])
def test_each_nic_sends_at_most_at_line_rate(transport):
    plan, topo = make_plan(transport)
    rng = np.random.default_rng(3)
    n = 300
    # both directions at once on every NIC pair, faster than the line rate: data, ACKs, READ
    # requests and CNPs all compete for each NIC's link
    src = rng.integers(0, 4, n)
    dst = (src + 2) % 4
    m = make_messages(rng.integers(0, 30000, n), src, dst, np.sort(rng.integers(0, 100_000, n)))
    p = all_packets(m, topo, plan)
    assert (np.diff(p["ts_ns"]) >= 0).all()
    extra = 2 if transport.get("kind") == "ib" else 24
    assert_links_never_overlap(p, extra=extra)
    # everything is sent: one frame per packet of each message, plus its ACK or READ request
    data = np.isin(p["opcode"], [0x81, 0x11, 0x0C], invert=True)
    assert int(data.sum()) == int(np.maximum(1, -(-m["wire_bytes"] // 1024)).sum())
    # an ACK never leaves before the packet it acknowledges has arrived
    acks = np.flatnonzero(p["opcode"] == 0x11)
    key = p["msg_id"].astype(np.int64) * (1 << 24) + p["psn"]
    sent = dict(zip(key[data].tolist(), (p["ts_ns"][data] + (p["frame_len"][data] + extra) * 8 / 400).tolist()))
    for i in acks:
        assert p["ts_ns"][i] >= sent[int(key[i])] + 2000


def test_acks_queue_behind_the_data_their_nic_sends():
    plan, topo = make_plan()
    # NIC 0 -> 2 small messages (ACKed by NIC 2) while NIC 2 -> 0 sends one large message
    small = make_messages([64] * 50, [0] * 50, [2] * 50, np.arange(50) * 20)
    big = make_messages([400_000], [2], [0], [2000])
    m = {k: np.concatenate([small[k], big[k]]) for k in small}
    m["msg_id"] = np.arange(51)
    p = all_packets(m, topo, plan)
    from_2 = p["src_nic"] == 2
    assert len(np.unique(p["ts_ns"][from_2])) == int(from_2.sum())
    assert_links_never_overlap(p)


def test_chunks_are_time_ordered_and_independent_of_chunk_size():
    plan, topo = make_plan()
    rng = np.random.default_rng(5)
    n = 200
    m = make_messages(rng.integers(0, 9000, n), rng.integers(0, 2, n), rng.integers(2, 4, n),
                      np.sort(rng.integers(0, 200_000, n)))
    small = list(packetize(m, topo, plan, chunk_packets=7))
    big = all_packets(m, topo, plan, chunk_packets=1 << 20)
    assert len(small) > 10
    last = -1
    for c in small:
        assert (np.diff(c["ts_ns"]) >= 0).all() and c["ts_ns"][0] >= last
        last = c["ts_ns"][-1]
    joined = {k: np.concatenate([c[k] for c in small]) for k in small[0]}
    for k in big:
        np.testing.assert_array_equal(joined[k], big[k], err_msg=k)
    assert set(big) == set(tables.column_names("packets")) | {TEMPLATE_COLUMN}
    tables.to_arrow("packets", big)     # every declared column, right types; private ones left out


def test_lexsort_paths_give_numpy_lexsort_order():
    """The packed-key sorts behind packetize's orders equal ``np.lexsort`` (ties in row order):
    mostly sorted or shuffled rows, keys that fit 63 bits with the row index or only without it,
    keys that do not fit at all, and known bounds (too wide ones are measured instead)."""
    PK = importlib.import_module("wiretrace.transport.packetize")
    rng = np.random.default_rng(3)
    n = 5000
    cases = {
        "small": (rng.integers(0, 4, n), rng.integers(0, 50, n), np.sort(rng.integers(0, 10**6, n))),
        "wide": (rng.integers(0, 1 << 24, n), rng.integers(0, 4, n), rng.integers(0, 1 << 40, n)),
        "huge": (rng.integers(0, 1 << 40, n), rng.integers(0, 1 << 40, n), rng.integers(0, 1 << 20, n)),
    }
    for name, keys in cases.items():
        want = np.lexsort(keys)
        for runs in (True, False):
            np.testing.assert_array_equal(PK._lexsort(keys, runs=runs), want, err_msg=f"{name} {runs}")
        bounds = tuple((0, 1 << 41) for _ in keys)
        np.testing.assert_array_equal(PK._lexsort(keys, bounds=bounds), want, err_msg=f"{name} bounds")
    keys = cases["small"]
    np.testing.assert_array_equal(PK._lexsort(keys, bounds=((0, 4), (0, 50), None)), np.lexsort(keys))


class _Wire:
    """Link parameters for :class:`_Links` in the tests: 400 Gb/s, 20 bytes of preamble, SFD,
    FCS and gap per frame, 2 us hop latency."""
    rate = 400e9
    wire_extra = 20
    latency = 2000

    def wire_ns(self, frame_len):
        return np.ceil((np.asarray(frame_len, dtype=np.int64) + 20) * 8 / 400e9 * 1e9).astype(np.int64)


def links_oracle(p: dict, n_nics: int) -> np.ndarray:
    """Start times (ns) by a frame-by-frame simulation of the rules :class:`_Links` states: frames
    taken in the order they were first ready (ties: ACK, data, READ request, CNP; then PSN; then
    row), each starting (in ps) no earlier than it is ready, than its NIC's link is free, and
    (an answer) than what it answers has arrived (its start rounded up to the ns, its on-wire
    time, one latency)."""
    rank = np.array([1, 0, 2, 3])[p["_kind"]]
    order = np.lexsort((p["psn"], rank, p["_ots"]))
    busy = [None] * n_nics
    start_ps = {}
    wire = _Wire()
    for i in order.tolist():
        ready = int(p["ts_ns"][i])
        d = int(p["_dep"][i])
        if d >= 0:
            ready = max(ready, -(-start_ps[d] // 1000) + int(wire.wire_ns([p["frame_len"][d]])[0]) + 2000)
        st = ready * 1000
        nic = int(p["src_nic"][i])
        if busy[nic] is not None:
            st = max(st, busy[nic])
        bits = (int(p["frame_len"][i]) + 20) * 8
        busy[nic] = st + int(np.ceil(bits * (1e12 / 400e9)))
        start_ps[i] = st
    return np.array([-(-start_ps[i] // 1000) for i in range(len(order))], dtype=np.int64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_link_schedules_equal_a_frame_by_frame_simulation(seed):
    """The windowed schedule (given rows in serving order, or shuffled) and the whole-batch one
    give the starts of a plain frame-by-frame simulation, with answers chained over several hops
    (an answer delays the frames behind it on its NIC, whose answers are delayed in turn)."""
    PK = importlib.import_module("wiretrace.transport.packetize")
    rng = np.random.default_rng(seed)
    n, nics = 3000, 6
    ots = np.sort(rng.integers(0, 400_000, n)).astype(np.int64)
    kind = rng.choice([0, 1, 2], n, p=[0.6, 0.3, 0.1]).astype(np.uint8)
    dep = np.full(n, -1, dtype=np.int64)
    for i in np.flatnonzero(kind == 1).tolist():        # an ACK answers a frame a hop or more earlier
        cand = np.flatnonzero(ots[:i] <= ots[i] - 2000)
        if len(cand):
            dep[i] = int(rng.choice(cand[-50:]))
    p = {"ts_ns": ots.copy(), "_ots": ots, "src_nic": rng.integers(0, nics, n).astype(np.int32),
         "psn": rng.integers(0, 1 << 24, n).astype(np.int32), "_kind": kind, "_dep": dep,
         "frame_len": rng.choice([62, 1086, 4154], n).astype(np.int32)}
    rank = np.array([1, 0, 2, 3])[kind]
    served = np.lexsort((p["psn"], rank, ots))
    at = np.empty(n, dtype=np.int64)
    at[served] = np.arange(n)

    def rows(order):
        q = {k: v[order] for k, v in p.items()}
        q["_dep"] = np.where(q["_dep"] >= 0, at_of(order)[np.maximum(q["_dep"], 0)], -1)
        return q

    def at_of(order):
        a = np.empty(n, dtype=np.int64)
        a[order] = np.arange(n)
        return a

    want = links_oracle(p, nics)
    assert (dep >= 0).sum() > 500 and len(np.unique(want)) > n // 2
    shuffled = rng.permutation(n)
    for order, how in ((served, "served"), (shuffled, "shuffled")):
        for method in ("windows", "whole"):
            q = rows(order)
            links = PK._Links(nics, _Wire())
            if method == "windows":
                links.schedule_windows(q, served=how == "served")
            else:
                assert links._schedule_whole(q, max_passes=10_000, served=how == "served")
            np.testing.assert_array_equal(q["ts_ns"], want[order], err_msg=f"{method} {how}")


def test_segmented_running_maximum_with_and_without_the_lift():
    """:meth:`_Links._run_segments` equals a per-segment running maximum, also when the values
    are too wide for the one-pass lift and each segment is taken on its own."""
    PK = importlib.import_module("wiretrace.transport.packetize")
    rng = np.random.default_rng(4)
    for scale in (10**6, 1 << 61):
        v = rng.integers(-scale, scale, 1000, dtype=np.int64)
        h = np.r_[0, np.sort(rng.choice(np.arange(1, 1000), 30, replace=False))]
        seg = np.cumsum(np.isin(np.arange(1000), h)) - 1 + 7
        floor = rng.integers(-scale, scale, len(h), dtype=np.int64)
        want = v.copy()
        want[h] = np.maximum(want[h], floor)
        for lo, hi in zip(h.tolist(), h[1:].tolist() + [1000]):
            want[lo:hi] = np.maximum.accumulate(want[lo:hi])
        np.testing.assert_array_equal(PK._Links._run_segments(v.copy(), h, floor, seg), want, err_msg=str(scale))


@pytest.mark.parametrize("transport,chunk,windowed", [
    ({}, 7, False), ({}, 1 << 16, False), ({"verb": "read"}, 5, False),
    ({"ack": {"every_packets": 3}, "initial_psn": 16777000}, 11, False),
    ({"ack": {"window": "3us"}, "verb": "send_imm"}, 9, False),
    ({"kind": "ib", "grh": True}, 13, False), ({"ip_version": 6, "initial_psn": "random"}, 64, False),
    ({"verb": "read", "ack": {"every_packets": 2}}, 17, True),
])
def test_single_pool_engine_equals_the_general_loop(monkeypatch, transport, chunk, windowed):
    """Runs without ECN marking go through one pool per step (packetize.SINGLE_POOL); their
    packets equal those of the general loop (which ECN-marked runs use), column by column, with
    contention on the links (messages of one NIC overlapping), READ dependencies, ACKs every N
    packets or per window, PSN wrap, steps as small as a few packets, and (``windowed``) every
    step falling back to the windowed schedule."""
    PK = importlib.import_module("wiretrace.transport.packetize")
    plan, topo = make_plan(transport, nodes=2, nics=2, qps=2)
    rng = np.random.default_rng(23)
    n = 120
    m = make_messages(rng.integers(0, 40_000, n), rng.integers(0, 4, n), rng.integers(0, 4, n),
                      np.sort(rng.integers(0, 150_000, n)))
    m["dst_nic"] = np.where(m["dst_nic"] // 2 == m["src_nic"] // 2, (m["dst_nic"] + 2) % 4, m["dst_nic"])
    if windowed:
        monkeypatch.setattr(PK._Links, "settle", lambda self, *a, **k: None)
    single = all_packets(m, topo, plan, chunk_packets=chunk)
    monkeypatch.setattr(PK, "SINGLE_POOL", False)
    general = all_packets(m, topo, plan, chunk_packets=chunk)
    assert set(single) == set(general)
    assert len(single["ts_ns"]) > 1000
    for k in general:
        np.testing.assert_array_equal(single[k], general[k], err_msg=k)


@pytest.mark.parametrize("verb,first,middle,last,only", [
    ("write", 0x06, 0x07, 0x08, 0x0A),
    ("write_imm", 0x06, 0x07, 0x09, 0x0B),
    ("send", 0x00, 0x01, 0x02, 0x04),
    ("send_imm", 0x00, 0x01, 0x03, 0x05),
])
def test_verbs_opcode_sequences(verb, first, middle, last, only):
    plan, topo = make_plan({"verb": verb})
    m = serial_messages([3000, 10])
    p = all_packets(m, topo, plan)
    assert p["opcode"][p["msg_id"] == 0].tolist() == [first, middle, last, 0x11]
    assert p["opcode"][p["msg_id"] == 1].tolist() == [only, 0x11]


def test_rdma_read_request_consumes_one_psn_per_response():
    plan, topo = make_plan({"verb": "read"})
    m = serial_messages([3000, 10, 2048], gap=5000)
    m["t_start_ns"] += 10_000
    m["t_end_ns"] += 10_000
    p = all_packets(m, topo, plan)
    req = p["opcode"] == 0x0C
    assert int(req.sum()) == 3 and not (p["opcode"] == 0x11).any()
    # requests go from the data receiver (NIC 2) to the data sender (NIC 0), with RETH = length
    assert (p["src_nic"][req] == 2).all() and p["dma_len"][req].tolist() == [3000, 10, 2048]
    assert p["psn"][req].tolist() == [0, 3, 4]
    resp = ~req
    assert p["opcode"][resp].tolist() == [0x0D, 0x0E, 0x0F, 0x10, 0x0D, 0x0F]
    assert p["psn"][resp].tolist() == [0, 1, 2, 3, 4, 5]
    assert (p["src_nic"][resp] == 0).all()
    assert p["msn"][resp].tolist() == [0, -1, 1, 2, 2, 3]
    for i in range(3):   # each request precedes its responses
        assert p["ts_ns"][req & (p["msg_id"] == i)][0] < p["ts_ns"][resp & (p["msg_id"] == i)].min()


def test_ack_every_n_packets():
    plan, topo = make_plan({"ack": {"every_packets": 3}})
    m = serial_messages([7 * 1024, 2 * 1024])
    p = all_packets(m, topo, plan)
    data = p["opcode"] != 0x11
    acked = p["psn"][data & p["ack_req"]].tolist()
    assert acked == [2, 5, 6, 8]        # every 3rd packet of the QP and each message's last
    assert sorted(p["psn"][~data].tolist()) == acked
    assert p["msn"][~data][np.argsort(p["psn"][~data])].tolist() == [0, 0, 1, 2]


def test_ack_window_coalesces_per_qp():
    plan, topo = make_plan({"ack": {"window": "100us"}})
    m = serial_messages([100] * 20)
    p = all_packets(m, topo, plan)
    acks = p["opcode"] == 0x11
    assert int(acks.sum()) == 1           # all 20 complete within one window
    assert p["msn"][acks].tolist() == [20] and p["ts_ns"][acks].tolist() == [100_000]


def test_ack_window_one_ack_per_window_at_its_end_for_the_last_message_completed():
    """transport.ack {"window": w} as schemas/plan.schema.json states it: time from the iteration
    start cut into windows of w; per QP at most one ACK per window, sent at the window's end,
    acknowledging the last message completed in it."""
    import json

    from conftest import ROOT

    plan, topo = make_plan({"ack": {"window": "2us"}})
    m = serial_messages([1000] * 10, gap=700)
    p = all_packets(m, topo, plan)
    acks = p["opcode"] == 0x11
    t_end = m["t_end_ns"]
    expected = {}                          # window -> (ACK time, MSN of the last message done in it)
    for i in np.argsort(t_end, kind="stable"):
        w = int(t_end[i]) // 2000
        expected[w] = ((w + 1) * 2000, int(i) + 1)
    assert len(expected) >= 3 and len(expected) < len(t_end)
    got = sorted(zip(p["ts_ns"][acks].tolist(), p["msn"][acks].tolist()))
    assert got == sorted(expected.values())
    schema = json.loads((ROOT / "schemas" / "plan.schema.json").read_text())
    text = schema["properties"]["transport"]["properties"]["ack"]["description"]
    for phrase in ("at most one", "per QP", "at the window's end", "last message completed in it"):
        assert phrase in text, phrase


def test_ecn_marks_and_rate_limited_cnps():
    plan, topo = make_plan({"ecn_marking": {"fraction": 1.0, "cnp_interval": "4us"}})
    m = serial_messages([64 * 1024] * 12)
    p = all_packets(m, topo, plan)
    data = (p["opcode"] != 0x11) & (p["opcode"] != 0x81)
    assert (p["ecn"][data] == 3).all()
    cnp = p["opcode"] == 0x81
    assert cnp.any()
    assert (p["dscp"][cnp] == 48).all() and (p["ecn"][cnp] == 2).all() and (p["udp_sport"][cnp] == 0).all()
    assert (p["src_nic"][cnp] == 2).all() and (p["psn"][cnp] == 0).all()
    # CNPs go to the sending QP with at least 4 us between two of them (a minimum gap, not a
    # time slot): the receiver answers the first marked arrival, then the first arrival 4 us or
    # more after its last CNP, and so on
    arrivals = p["ts_ns"][data] + np.ceil((p["frame_len"][data] + 24) * 8 / 400) + 2000
    expected, last = [], None
    for a in arrivals.tolist():
        if last is None or a >= last + 4000:
            expected.append(a)
            last = a
    got = p["ts_ns"][cnp]
    assert len(got) == len(expected) > 3
    # each CNP leaves when it is made, or a few ns later behind an ACK on the same link
    assert (got >= expected).all() and (got <= np.asarray(expected) + 10).all()
    assert (np.diff(got) >= 4000 - 10).all()
    assert (np.diff(p["ts_ns"]) >= 0).all()


def test_cnp_gap_is_measured_from_the_previous_cnp_not_a_time_slot():
    plan, topo = make_plan({"ecn_marking": {"fraction": 1.0, "cnp_interval": "4us"}})
    # one marked packet every 3 us: CNPs at 0, 6, 12 us (a 4 us slot grid would answer 0, 3 (a new
    # slot begins at 4), 9, 12 ... two of them 3 us apart)
    m = make_messages([64] * 9, [0] * 9, [2] * 9, np.arange(9) * 3000)
    p = all_packets(m, topo, plan)
    cnp = p["opcode"] == 0x81
    np.testing.assert_array_equal(p["msg_id"][cnp], [0, 2, 4, 6, 8])
    assert (np.diff(p["ts_ns"][cnp]) == 6000).all()


def test_ecn_queue_rule_marks_incast_only():
    plan, topo = make_plan({"ecn_marking": {"queue_bytes": "20KiB"}}, nodes=3)
    # one sender: the port drains as fast as it fills; two senders into NIC 4: the queue grows
    alone = make_messages([256 * 1024], [0], [4], [0])
    p = all_packets(alone, topo, plan)
    assert not (p["ecn"] == 3).any()
    incast = make_messages([256 * 1024, 256 * 1024], [0, 2], [4, 4], [0, 0])
    p = all_packets(incast, topo, plan)
    marked = p["ecn"] == 3
    assert marked.sum() > 50 and (p["opcode"] == 0x81).any()
    # the first ~20 KiB of the burst pass unmarked
    first = np.argmax(marked)
    assert p["ts_ns"][first] > 0


def test_errors_name_the_problem():
    plan, topo = make_plan()
    m = serial_messages([10])
    m["verb"] = np.array(["teleport"], dtype=object)
    m["qpn"][:] = 257
    with pytest.raises(WiretraceError, match="teleport"):
        list(packetize(m, topo, plan))
    with pytest.raises(WiretraceError, match="modelled for RoCEv2"):      # refused with the plan
        make_plan({"kind": "ib", "ecn_marking": {"fraction": 0.5}})


# ------------------------------------------------------------------------------------------------
# rendering: ICRC against scapy, tshark decoding


KINDS = [
    ("ipv4", {}), ("ipv6", {"ip_version": 6}), ("vlan", {"vlan": 100, "pcp": 3}),
    ("read", {"verb": "read"}), ("send_imm", {"verb": "send_imm"}), ("send", {"verb": "send"}),
    ("write", {"verb": "write"}), ("cnp", {"ecn_marking": {"fraction": 0.3}}),
]


def _mixed_messages():
    return serial_messages([0, 1, 2, 3, 1023, 1024, 1025, 2 * 1024 + 2, 5000], gap=3000)


@pytest.mark.parametrize("label,transport", KINDS, ids=[k for k, _ in KINDS])
def test_whole_frames_icrc_equals_scapy(label, transport):
    from scapy.contrib.roce import BTH
    from scapy.layers.l2 import Ether

    plan, topo = make_plan(transport)
    p = all_packets(_mixed_messages(), topo, plan)
    buf, off, cap, orig = render(p, topo, plan, snaplen=0)
    np.testing.assert_array_equal(cap, p["frame_len"])
    rng = np.random.default_rng(11)
    for i in sorted(set(rng.choice(len(cap), min(len(cap), 25), replace=False).tolist())
                    | set(np.unique(p["opcode"], return_index=True)[1].tolist())):
        frame = bytes(buf[off[i]:off[i + 1]])
        pkt = Ether(frame)
        pkt[BTH].icrc = None
        assert bytes(pkt)[-4:] == frame[-4:], (label, i, int(p["opcode"][i]))
        assert C.icrc_scalar(frame, 18 if "vlan" in transport else 14) == int.from_bytes(frame[-4:], "little")
        rebuilt = bytes(Ether(frame))
        assert rebuilt == frame


@pytest.mark.parametrize("label,transport", KINDS, ids=[k for k, _ in KINDS])
def test_tshark_decodes_every_frame_and_fields_equal_the_table(tmp_path, label, transport):
    plan, topo = make_plan(transport)
    p = all_packets(_mixed_messages(), topo, plan)
    path = tmp_path / "t.pcap"
    write_capture(path, [p], topo, plan, snaplen=0)
    rows = tshark_fields(path, ["udp.dstport", "infiniband.bth.opcode", "infiniband.bth.psn",
                                "infiniband.bth.destqp", "infiniband.reth.dmalen", "infiniband.aeth.msn",
                                "infiniband.bth.padcnt", "infiniband.bth.a", "ip.dsfield.dscp",
                                "ipv6.tclass.dscp", "vlan.id", "vlan.priority", "frame.len"])
    assert len(rows) == len(p["ts_ns"])
    assert [int(r[0]) for r in rows] == [4791] * len(rows)
    assert [int(r[1]) for r in rows] == p["opcode"].tolist()
    assert [int(r[2]) for r in rows] == p["psn"].tolist()
    assert [int(r[3], 16) for r in rows] == p["dest_qp"].tolist()
    assert [int(r[4]) if r[4] else -1 for r in rows] == p["dma_len"].tolist()
    assert [int(r[5]) if r[5] else -1 for r in rows] == p["msn"].tolist()
    assert [int(r[6]) for r in rows] == p["pad"].tolist()
    assert [r[7] in ("1", "True") for r in rows] == p["ack_req"].tolist()
    dscp = [int(r[8] or r[9]) for r in rows]
    assert dscp == p["dscp"].tolist()
    if "vlan" in transport:
        assert {(int(r[10]), int(r[11])) for r in rows} == {(100, 3)}
    assert [int(r[12]) for r in rows] == p["frame_len"].tolist()
    assert tshark_expert_problems(path) == []


@pytest.mark.parametrize("verb", ["write_imm", "send_imm"])
def test_immediate_data_is_the_message_size_as_nccl_posts_it(tmp_path, verb):
    # NCCL's ncclIbMultiSend (src/transport/net_ib.cc), one request: imm_data = reqs[0]->send.size
    plan, topo = make_plan({"verb": verb})
    sizes = [0, 1, 1024, 2500, 70_000]
    m = serial_messages(sizes, gap=3000)
    m["msg_id"] = np.arange(len(sizes)) + 7_000_000_000      # ids above 32 bits do not leak in
    p = all_packets(m, topo, plan)
    has = p["imm"] >= 0
    assert int(has.sum()) == len(sizes)
    assert p["imm"][has].tolist() == sizes
    path = tmp_path / "imm.pcap"
    write_capture(path, [p], topo, plan, snaplen=0)
    rows = tshark_fields(path, ["infiniband.immdt"])
    got = [int(r[0].replace(":", ""), 16) for r in rows if r and r[0]]
    assert got == sizes


def test_pcp_without_vlan_gives_priority_tagged_frames(tmp_path):
    # IEEE 802.1Q: a priority-tagged frame carries VLAN ID 0 and the priority in PCP
    plan, topo = make_plan({"pcp": 3})
    p = all_packets(_mixed_messages(), topo, plan)
    plain, plain_topo = make_plan()
    np.testing.assert_array_equal(p["frame_len"], all_packets(_mixed_messages(), plain_topo, plain)["frame_len"] + 4)
    path = tmp_path / "prio.pcap"
    write_capture(path, [p], topo, plan, snaplen=0)
    rows = tshark_fields(path, ["vlan.id", "vlan.priority", "infiniband.bth.psn", "frame.len"])
    assert {(int(r[0]), int(r[1])) for r in rows} == {(0, 3)}
    assert [int(r[2]) for r in rows] == p["psn"].tolist()
    assert [int(r[3]) for r in rows] == p["frame_len"].tolist()
    from wiretrace.transport.validate import validate_capture
    assert validate_capture(path).ok


@pytest.mark.parametrize("transport,message", [
    ({"kind": "ib", "ip_version": 6}, r"\$\.transport\.ip_version: native InfiniBand frames have no IP header"),
    ({"kind": "ib", "vlan": 5}, r"\$\.transport\.vlan: native InfiniBand frames have no 802\.1Q tag"),
    ({"grh": True}, r"\$\.transport\.grh: a GRH belongs to native InfiniBand"),
    ({"ack": {"every_packets": 4, "window": "2us"}}, r"\$\.transport\.ack: give either every_packets or window"),
    ({"ack": {}}, r"\$\.transport\.ack: \{\} should be non-empty"),
    ({"ack": {"every_packets": 0}}, r"\$\.transport\.ack\.every_packets: 0 is less than the minimum of 1 \(expected: "
                                    r"\"message\".*every_packets"),
    ({"ack": {"window": "abc"}}, r"\$\.transport\.ack\.window: 'abc' does not match .* \(expected: A duration"),
    ({"initial_psn": 16777216}, r"\$\.transport\.initial_psn: 16777216 is greater than the maximum of 16777215"),
])
def test_transport_settings_that_cannot_apply_are_plan_errors(transport, message):
    with pytest.raises(P.PlanError, match=message) as e:
        make_plan(transport)
    assert "is not valid under any of the given schemas" not in str(e.value)


def test_ip_checksums_and_lengths_verified_by_tshark(tmp_path):
    plan, topo = make_plan()
    p = all_packets(_mixed_messages(), topo, plan)
    path = tmp_path / "c.pcap"
    write_capture(path, [p], topo, plan, snaplen=0)
    rows = tshark_fields(path, ["ip.checksum.status", "ip.flags.df", "ip.ttl", "udp.length", "udp.checksum",
                                "infiniband.bth.p_key"],
                         ["-o", "ip.check_checksum:TRUE"])
    assert {r[0] for r in rows} == {"1"}                  # 1 = good, 0 = bad, 2 = unverified
    assert {r[1] for r in rows} <= {"1", "True"} and {r[2] for r in rows} == {"64"}
    assert [int(r[3]) for r in rows] == (p["frame_len"] - 34).tolist()
    assert {r[4] for r in rows} == {"0x0000"} and {r[5] for r in rows} == {"65535"}


def test_snaplen_truncates_but_keeps_the_frame_length():
    plan, topo = make_plan()
    p = all_packets(_mixed_messages(), topo, plan)
    full, foff, fcap, _ = render(p, topo, plan, snaplen=0)
    buf, off, cap, orig = render(p, topo, plan, snaplen=64)
    np.testing.assert_array_equal(orig, p["frame_len"])
    np.testing.assert_array_equal(cap, np.minimum(p["frame_len"], 64))
    for i in range(len(cap)):
        assert bytes(buf[off[i]:off[i + 1]]) == bytes(full[foff[i]:foff[i] + cap[i]])


def test_payload_bytes_are_deterministic():
    plan, topo = make_plan()
    p = all_packets(serial_messages([2000]), topo, plan)
    buf, off, cap, _ = render(p, topo, plan, snaplen=0)
    first = bytes(buf[off[0]:off[1]])
    assert first[70:70 + 1024] == bytes(i % 256 for i in range(1024))   # after Eth+IP+UDP+BTH+RETH


# ------------------------------------------------------------------------------------------------
# native InfiniBand


def _ib_icrc_plain(frame: bytes, grh: bool) -> int:
    b = bytearray(frame[:-6])
    b[0] |= 0xF0                       # VL
    bth = 8
    if grh:   # a global packet's ICRC leaves the whole LRH out (routers rebuild it)
        b[0:8] = b"\xff" * 8
        b[8] |= 0x0F
        b[9:12] = b"\xff\xff\xff"
        b[15] = 0xFF
        bth = 48
    b[bth + 4] = 0xFF
    return zlib.crc32(bytes(b))


@pytest.mark.parametrize("grh", [False, True])
def test_native_ib_frames_lrh_grh_icrc_vcrc(tmp_path, grh):
    plan, topo = make_plan({"kind": "ib", "grh": grh})
    p = all_packets(_mixed_messages(), topo, plan)
    assert (p["udp_sport"] == -1).all() and (p["dscp"] == 0).all()
    buf, off, cap, orig = render(p, topo, plan, snaplen=0)
    for i in range(len(cap)):
        frame = bytes(buf[off[i]:off[i + 1]])
        assert len(frame) == int(p["frame_len"][i])
        assert int.from_bytes(frame[-6:-2], "little") == _ib_icrc_plain(frame, grh)
        assert int.from_bytes(frame[-2:], "little") == _crc16_bitwise_msb_first(frame[:-2])
        assert (frame[1] & 3) == (3 if grh else 2)
    for suffix in (".erf", ".pcap", ".pcapng"):
        path = tmp_path / f"ib{suffix}"
        write_capture(path, [p], topo, plan, snaplen=0)
        rows = tshark_fields(path, ["infiniband.lrh.dlid", "infiniband.lrh.slid", "infiniband.lrh.pktlen",
                                    "infiniband.bth.opcode", "infiniband.bth.psn", "infiniband.bth.destqp",
                                    "infiniband.reth.dmalen", "infiniband.aeth.msn", "infiniband.grh.dgid"])
        assert len(rows) == len(cap)
        assert [int(r[0]) for r in rows] == (topo.nic_lid[p["dst_nic"]]).tolist()
        assert [int(r[1]) for r in rows] == (topo.nic_lid[p["src_nic"]]).tolist()
        assert [int(r[2]) for r in rows] == ((p["frame_len"] - 2) // 4).tolist()
        assert [int(r[3]) for r in rows] == p["opcode"].tolist()
        assert [int(r[4]) for r in rows] == p["psn"].tolist()
        assert [int(r[5], 16) for r in rows] == p["dest_qp"].tolist()
        assert [int(r[6]) if r[6] else -1 for r in rows] == p["dma_len"].tolist()
        assert [int(r[7]) if r[7] else -1 for r in rows] == p["msn"].tolist()
        assert all(bool(r[8]) == grh for r in rows)
        assert tshark_expert_problems(path) == []


def test_ib_grh_when_routed_between_subnets():
    plan, topo = make_plan({"kind": "ib"}, nodes=2, subnets=2)
    m = make_messages([100, 100], [0, 0], [1, 2], [0, 10])    # NIC 1 same node, NIC 2 other subnet
    p = all_packets(m, topo, plan)
    buf, off, cap, _ = render(p, topo, plan, snaplen=0)
    lnh = {int(p["dst_nic"][i]): buf[off[i] + 1] & 3 for i in range(len(cap)) if p["opcode"][i] != 0x11}
    assert lnh == {1: 2, 2: 3}


@pytest.mark.parametrize("transport", [{}, {"ip_version": 6}, {"kind": "ib"}, {"vlan": 5}])
@pytest.mark.parametrize("snaplen", [0, 64, 128])
def test_rendering_in_blocks_gives_the_same_bytes(monkeypatch, transport, snaplen):
    import importlib

    R = importlib.import_module("wiretrace.transport.render")  # the module (the package exports the function)
    plan, topo = make_plan(transport)
    p = all_packets(_mixed_messages(), topo, plan)
    whole = render(p, topo, plan, snaplen=snaplen)
    monkeypatch.setattr(R, "BLOCK_ROWS", 5)
    blocked = render(p, topo, plan, snaplen=snaplen)
    for a, b in zip(whole, blocked):
        np.testing.assert_array_equal(a, b)
    if snaplen == 0 and transport.get("kind") != "ib":
        buf, off = blocked[0], blocked[1]
        l3 = 18 if "vlan" in transport else 14
        for i in range(len(off) - 1):
            frame = bytes(buf[off[i]:off[i + 1]])
            assert C.icrc_scalar(frame, l3) == int.from_bytes(frame[-4:], "little")


def test_large_messages_and_late_times():
    plan, topo = make_plan({"path_mtu": 4096})
    hour = 3600 * 10**9
    m = make_messages([1 << 30], [0], [2], [hour])
    m["t_end_ns"][0] = hour + 10 * 10**9          # a slow link: 10 s for 1 GiB
    p = all_packets(m, topo, plan)
    data = p["opcode"] != 0x11
    assert int(data.sum()) == (1 << 30) // 4096 and int(p["payload_len"][data].sum()) == 1 << 30
    ts = p["ts_ns"][data]
    assert ts[0] == hour and (np.diff(ts) > 0).all()
    share = 10 * 10**9 // ((1 << 30) // 4096)        # one packet's part of the 10 s
    assert share <= (m["t_end_ns"][0] - 2000) - ts[-1] < 2 * share
    big = make_messages([(1 << 31) + 1], [0], [2], [0])
    with pytest.raises(WiretraceError, match="2 GiB"):
        list(packetize(big, topo, plan))


def test_pack_truncates_arrays_to_the_field_width():
    wide = np.array([0x1FF, 0x12345], dtype=np.int64)        # too wide for 8 and 16 bits
    rows = H.UDP.pack(2, {"sport": wide, "dport": wide, "length": np.array([1, 2], np.uint16)})
    assert rows[0].tobytes().hex() == "01ff01ff00010000"
    assert rows[1].tobytes().hex() == "2345234500020000"
    bth = H.BTH.pack(1, {"opcode": np.array([0x1AB]), "psn": np.array([0x1FFFFFF])})
    assert bth.tobytes().hex() == "ab40ffff00000000" + "00ffffff"


@pytest.mark.parametrize("transport", [
    {"ecn_marking": {"fraction": 0.2, "cnp_interval": "1us"}},
    {"ecn_marking": {"queue_bytes": "8KiB"}},
    {"verb": "read"},
    {"ack": {"every_packets": 4}},
    {"ack": {"window": "3us"}},
])
def test_output_does_not_depend_on_chunk_size(transport):
    plan, topo = make_plan(transport, nodes=3)
    rng = np.random.default_rng(12)
    n = 150
    src = rng.integers(0, 6, n)
    dst = (src + 2 + rng.integers(0, 2, n)) % 6
    m = make_messages(rng.integers(0, 20000, n), src, dst, np.sort(rng.integers(10_000, 300_000, n)))
    small = list(packetize(m, topo, plan, chunk_packets=5))
    big = all_packets(m, topo, plan, chunk_packets=1 << 20)
    joined = {k: np.concatenate([c[k] for c in small]) for k in small[0]}
    for k in big:
        np.testing.assert_array_equal(joined[k], big[k], err_msg=k)
    assert (np.diff(big["ts_ns"]) >= 0).all()


@pytest.mark.parametrize("transport", [{}, {"ip_version": 6}, {"kind": "ib"}, {"kind": "ib", "grh": True},
                                       {"vlan": 3, "verb": "read"}])
def test_every_snap_length_keeps_a_prefix_of_the_whole_frame(transport):
    plan, topo = make_plan(transport)
    p = all_packets(_mixed_messages(), topo, plan)
    full, foff, _, _ = render(p, topo, plan, snaplen=0)
    for snap in (1, 10, 20, 57, 66, 100):
        buf, off, cap, orig = render(p, topo, plan, snaplen=snap)
        np.testing.assert_array_equal(orig, p["frame_len"])
        for i in range(len(cap)):
            assert bytes(buf[off[i]:off[i + 1]]) == bytes(full[foff[i]:foff[i] + cap[i]])


@pytest.mark.parametrize("snaplen", [0, 128])
def test_ipv6_udp_checksum_verified_by_tshark(tmp_path, snaplen):
    plan, topo = make_plan({"ip_version": 6, "ecn_marking": {"fraction": 0.3}})
    p = all_packets(_mixed_messages(), topo, plan)
    path = tmp_path / "v6.pcap"
    write_capture(path, [p], topo, plan, snaplen=0)
    rows = tshark_fields(path, ["udp.checksum.status", "ipv6.plen"], ["-o", "udp.check_checksum:TRUE"])
    assert {r[0] for r in rows} == {"1"}                  # 1 = good
    assert [int(r[1]) for r in rows] == (p["frame_len"] - 54).tolist()
    if snaplen:   # the checksum of a truncated frame is the whole frame's
        cut = tmp_path / "cut.pcap"
        write_capture(cut, [p], topo, plan, snaplen=snaplen)
        a = tshark_fields(path, ["udp.checksum"])
        b = tshark_fields(cut, ["udp.checksum"])
        assert a == b


def test_ack_syndrome_is_an_ack_with_credits(tmp_path):
    plan, topo = make_plan()
    p = all_packets(serial_messages([100, 5000]), topo, plan)
    path = tmp_path / "ack.pcap"
    write_capture(path, [p], topo, plan)
    rows = [r for r in tshark_fields(path, ["infiniband.bth.opcode", "infiniband.aeth.syndrome.opcode",
                                            "infiniband.aeth.syndrome.credit_count"]) if r[0] == "17"]
    # AETH syndrome 0b0_00_CCCCC: ACK, credit code 16 = 256 receive WQEs (IBTA 9.7.5.1.4)
    assert rows and all(int(r[1]) == 0 and int(r[2]) == 16 for r in rows)


@pytest.mark.parametrize("transport,bits", [
    ({}, 12),
    ({"vlan": 7, "pcp": 3, "initial_psn": 16777200, "ack": {"every_packets": 3},
      "ecn_marking": {"fraction": 0.2}}, 12),
    ({"initial_psn": "random", "verb": "send"}, 1),           # two hash slots: most rows collide
])
def test_middle_frames_from_templates_equal_frames_rendered_field_by_field(monkeypatch, transport, bits):
    """MIDDLE frames are copied from a per-connection template and patched (IPv4 id and checksum,
    AckReq, PSN): the captured bytes equal those rendered header by header, across PSN wrap,
    AckReq on MIDDLE packets, CE-marked rows of one connection, VLAN tags and hash collisions;
    every IPv4 header checksum verifies (RFC 1071: the one's complement sum is 0xFFFF)."""
    R = importlib.import_module("wiretrace.transport.render")

    plan, topo = make_plan(transport, nodes=2, nics=2, qps=2)
    sizes = [300_000, 70_000, 1_000_000, 5_000, 250_000, 130_000] * 2
    src = [0, 1, 2, 3, 0, 1] * 2
    dst = [2, 3, 0, 1, 3, 2] * 2
    starts = np.arange(12) * 700
    p = all_packets(make_messages(sizes, src, dst, starts), topo, plan)
    assert (R._MIDDLE[p["opcode"]]).mean() > 0.6
    used = []
    real = R._render_roce_templated
    monkeypatch.setattr(R, "TEMPLATE_BITS", bits)
    monkeypatch.setattr(R, "TEMPLATE_SLOTS", 1 << bits)
    def spy(*a):
        out = real(*a)
        used.append(out is not None)
        return out

    monkeypatch.setattr(R, "_render_roce_templated", spy)
    # packetize names each message's MIDDLE rows (the template column); without it the renderer
    # finds the groups by comparing columns (hash slots, collisions): both give the same bytes
    assert (p[TEMPLATE_COLUMN] >= 0).sum() == (R._MIDDLE[p["opcode"]] & (p["ecn"] != 3)).sum()
    bare = {k: v for k, v in p.items() if k != TEMPLATE_COLUMN}
    hinted = render(p, topo, plan, snaplen=96)
    fast = render(bare, topo, plan, snaplen=96)
    assert used and all(used)
    # headers cut; and the ICRC of MIDDLE frames partly captured (their rows rendered whole)
    mid_len = int(p["frame_len"][R._MIDDLE[p["opcode"]]].max())
    snaps = (1, 42, 57, 58, mid_len - 2)
    cut = {(snap, hint): render(p if hint else bare, topo, plan, snaplen=snap)
           for snap in snaps for hint in (True, False)}
    monkeypatch.setattr(R, "_render_roce_templated", lambda *a: None)
    slow = render(bare, topo, plan, snaplen=96)
    for got in (fast, hinted):
        assert np.array_equal(got[1], slow[1]) and np.array_equal(got[0], slow[0])
    for (snap, hint), got in cut.items():
        want = render(bare, topo, plan, snaplen=snap)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (snap, hint)
    buf, off = fast[0], fast[1]
    l2 = 18 if "vlan" in transport else 14
    ip = np.stack([buf[off[i] + l2: off[i] + l2 + 20] for i in range(len(off) - 1)]).astype(np.uint32)
    s = ((ip[:, 0::2] << 8) | ip[:, 1::2]).sum(axis=1)
    while (s >> 16).any():
        s = (s & 0xFFFF) + (s >> 16)
    assert (s == 0xFFFF).all()
    assert ((ip[:, 4] << 8) | ip[:, 5]).tolist() == (p["psn"] & 0xFFFF).tolist()
