"""wiretrace replay: frames on a veth pair between two network namespaces, datagrams on loopback.

The interface tests create their own namespaces (``ip netns add``) joined by a veth pair, replay
from one end and capture with tcpdump on the other; the namespaces are removed afterwards, also
on failure. They need root (raw sockets, namespaces), iproute2 and tcpdump: in CI (env CI set)
a missing tool fails the test instead of skipping it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import struct
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import dpkt
import pyarrow.parquet as pq
import pytest

from conftest import require_tool
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Raw
from scapy.utils import RawPcapReader, wrpcap

REAL = Path(__file__).resolve().parents[2] / "shared" / "real" / "roce_packets"
WIRETRACE = [sys.executable, "-m", "wiretrace.cli"]
IN_CI = bool(os.environ.get("CI"))
# Timing assertions run the sender under SCHED_FIFO: the test machine is shared, and without it
# the scheduler may hold a frame for milliseconds (replay --rt-priority, sched(7)).
RT = ("--rt-priority", "10")


def need(tool: str) -> str:
    return require_tool(tool)


def need_root() -> None:
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("replay interface tests need root in CI")
        pytest.skip("needs root")


def roce_frame(i: int, payload: bytes) -> bytes:
    """Frame ``i`` of :func:`roce_frames` with ``payload``, built by scapy (ICRC included)."""
    bth = BTH(opcode=(0, 1, 2)[i % 3], dqpn=0x100 + i % 4, psn=i, padcount=(-len(payload)) % 4)
    pl = payload + bytes((-len(payload)) % 4)
    eth = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:01:01")
    udp = UDP(sport=49152 + i % 4 + 1, dport=4791, chksum=0)
    if i % 5 == 4:
        p = eth / IPv6(src="fd00::1", dst="fd00::2") / udp / bth / Raw(pl)
    elif i % 5 == 3:
        p = eth / Dot1Q(vlan=100, prio=3) / IP(src="10.0.0.1", dst="10.0.0.2", tos=0x6a, flags="DF") / udp / bth / Raw(pl)
    else:
        p = eth / IP(src="10.0.0.1", dst="10.0.0.2", tos=0x6a, flags="DF") / udp / bth / Raw(pl)
    return bytes(p)


def roce_payload(i: int) -> bytes:
    return bytes((i + j) & 0xFF for j in range(64 + (i * 37) % 1400))


def roce_frames(n: int = 300, truncate_every: int = 7, snap: int = 90):
    """RoCEv2 frames built by scapy (independent of wiretrace): RC SEND FIRST/MIDDLE/LAST of
    varying sizes, IPv4, IPv6 and VLAN-tagged; every ``truncate_every``-th frame is cut to ``snap``
    bytes (scapy writes its ``wirelen`` as the original length). Returns (packets, full bytes)."""
    pkts, full = [], []
    for i in range(n):
        raw = roce_frame(i, roce_payload(i))
        full.append(raw)
        out = Ether(raw)
        out.time = 1_700_000_000 + i * 100e-6
        if truncate_every and i % truncate_every == 0:
            out = Ether(raw[:snap])
            out.time = 1_700_000_000 + i * 100e-6
            out.wirelen = len(raw)
        pkts.append(out)
    return pkts, full


@pytest.fixture
def capture(tmp_path):
    pkts, full = roce_frames()
    path = tmp_path / "roce.pcap"
    wrpcap(str(path), pkts)
    return path, full


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture
def netns_pair():
    """Two namespaces joined by a veth pair (MTU 9000, IPv6 off so that nothing else is sent)."""
    need_root()
    need("ip")
    tag = uuid.uuid4().hex[:6]
    a, b = f"wtra{tag}", f"wtrb{tag}"
    ia, ib = f"wva{tag}", f"wvb{tag}"
    try:
        for cmd in (["ip", "netns", "add", a], ["ip", "netns", "add", b],
                    ["ip", "link", "add", ia, "netns", a, "type", "veth", "peer", "name", ib, "netns", b]):
            r = run(cmd)
            assert r.returncode == 0, r.stderr
        for ns, dev in ((a, ia), (b, ib)):
            for cmd in (["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
                        ["sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"],
                        ["ip", "link", "set", dev, "mtu", "9000"], ["ip", "link", "set", dev, "up"]):
                r = run(["ip", "netns", "exec", ns, *cmd])
                assert r.returncode == 0, r.stderr
        yield {"a": a, "b": b, "ia": ia, "ib": ib}
    finally:
        run(["ip", "netns", "del", a])
        run(["ip", "netns", "del", b])


class Tcpdump:
    """tcpdump writing everything received on an interface of a namespace to a pcap."""

    def __init__(self, ns: str, dev: str, out: Path):
        need("tcpdump")
        self.out = out
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, "tcpdump", "-i", dev, "-n", "-U", "-s", "0",
                                      "--immediate-mode", "-B", "65536", "-Q", "in", "-w", str(out)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 20
        line = ""
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if "listening on" in line or not line:
                break
        assert "listening on" in line, f"tcpdump did not start: {line}"

    def stop(self):
        time.sleep(0.3)
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=20)
        self.stats = err
        with open(self.out, "rb") as f:
            return [(ts, bytes(buf)) for ts, buf in dpkt.pcap.Reader(f)]


def replay_in(ns: str, *args) -> subprocess.CompletedProcess:
    return run(["ip", "netns", "exec", ns, *WIRETRACE, "replay", *args])


def padded(full: list[bytes], snap: int = 90, every: int = 7) -> list[bytes]:
    """What replay must send: each truncated frame completed as wiretrace renders frames. The
    captured bytes stay; the payload goes on with byte k of the payload = k mod 256, then the
    pad and an ICRC that scapy computes over the result."""
    out = []
    for i, f in enumerate(full):
        if i % every:
            out.append(f)
            continue
        payload = roce_payload(i)
        start = len(f) - 4 - len(payload) - (-len(payload)) % 4       # payload offset in the frame
        kept = snap - start
        out.append(roce_frame(i, payload[:kept] + bytes(k & 0xFF for k in range(kept, len(payload)))))
        assert out[-1][:snap] == f[:snap] and len(out[-1]) == len(f)
    return out


def test_iface_frames_arrive_byte_identical_at_pps(netns_pair, capture, tmp_path):
    path, full = capture
    dump = Tcpdump(netns_pair["b"], netns_pair["ib"], tmp_path / "rx.pcap")
    r = replay_in(netns_pair["a"], str(path), "--iface", netns_pair["ia"], "--pps", "10000", "--json",
                  *RT)
    got = dump.stop()
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    want = padded(full)
    assert [g for _, g in got] == want
    assert rep["packets"] == len(want) == 300
    assert rep["bytes"] == sum(map(len, want))
    assert rep["padded"] == len(range(0, 300, 7))
    assert abs(rep["achieved_pps"] - 10000) / 10000 < 0.05
    # the receiver's own clock agrees
    rx_pps = (len(got) - 1) / (got[-1][0] - got[0][0])
    assert abs(rx_pps - 10000) / 10000 < 0.05


PLAN = Path(__file__).resolve().parents[1] / "samples" / "plans" / "gpt2-small-2x4.json"


def generate(out: Path, *args) -> None:
    r = run([*WIRETRACE, "generate", "--plan", str(PLAN), "-o", str(out), "-q", *args])
    assert r.returncode == 0, r.stderr


def busy_window(d: Path, plan: Path = PLAN, span_ns: int = 50_000) -> str:
    """``--window`` of the first ``span_ns`` of traffic of ``plan``'s iteration (from the
    packets table, so that the test follows the timing model)."""
    r = run([*WIRETRACE, "generate", "--plan", str(plan), "-o", str(d / "full.pcap"), "-q", "--force"])
    assert r.returncode == 0, r.stderr
    t0 = int(pq.read_table(d / "full.parquet" / "packets.parquet", columns=["ts_ns"]).column(0).to_numpy().min())
    return f"{t0}:{t0 + span_ns}"


def whole_frames(path: Path) -> list[bytes]:
    frames = []
    for data, meta in RawPcapReader(str(path)):
        assert len(data) == meta.wirelen
        frames.append(bytes(data))
    return frames


@pytest.fixture(scope="module")
def generated_capture(tmp_path_factory):
    """50 µs of the demo iteration's traffic: frames cut at 128 bytes (the default snap length),
    and the same window written whole (--snaplen 0), which replay must reproduce."""
    d = tmp_path_factory.mktemp("gen")
    window = busy_window(d)
    generate(d / "window.pcap", "--window", window, "--no-parquet")
    generate(d / "whole.pcap", "--window", window, "--no-parquet", "--snaplen", "0")
    want = whole_frames(d / "whole.pcap")
    assert 200 < len(want) < 20_000 and any(len(f) > 4000 for f in want)
    r = run([*WIRETRACE, "validate", str(d / "whole.pcap"), "--json"])
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout[-2000:]
    return d / "window.pcap", want


def test_iface_generated_capture_at_pps(netns_pair, generated_capture, tmp_path):
    path, want = generated_capture
    dump = Tcpdump(netns_pair["b"], netns_pair["ib"], tmp_path / "rx.pcap")
    r = replay_in(netns_pair["a"], str(path), "--iface", netns_pair["ia"], "--pps", "10000", "--json",
                  *RT)
    got = dump.stop()
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    # completed to the 4,170-byte frames generate --snaplen 0 writes: payload pattern and ICRC
    assert [g for _, g in got] == want
    assert rep["packets"] == len(want) and rep["padded"] == sum(len(f) > 128 for f in want)
    assert rep["zero_padded"] == 0
    assert abs(rep["achieved_pps"] - 10000) / 10000 < 0.05
    rx_pps = (len(got) - 1) / (got[-1][0] - got[0][0])
    assert abs(rx_pps - 10000) / 10000 < 0.05
    # what arrived passes the validator: ICRC, lengths, PSNs, opcode sequences
    v = run([*WIRETRACE, "validate", str(tmp_path / "rx.pcap"), "--json"])
    doc = json.loads(v.stdout)
    assert v.returncode == 0 and doc["ok"] and doc["truncated"] == 0, v.stdout[-2000:]
    assert doc["checked"]["icrc"] == len(want) and doc["counts"]["icrc"] == 0


def test_udp_generated_capture_carries_whole_roce_parts(generated_capture):
    path, want = generated_capture
    port, got, t = udp_receiver()
    r = run([*WIRETRACE, "replay", str(path), "--udp", f"127.0.0.1:{port}", "--topspeed", "--json"])
    t.join()
    assert r.returncode == 0, r.stderr
    # each datagram is the UDP payload (BTH .. ICRC) of the whole frame, as scapy decodes it
    parts = [bytes(Ether(f)[UDP].payload) for f in want]
    assert [g for _, g in got] == parts
    for part, frame in zip(parts, want):
        assert BTH(part).icrc == BTH(bytes(Ether(frame)[UDP].payload)).icrc
    rep = json.loads(r.stdout)
    assert rep["packets"] == len(want) and rep["zero_padded"] == 0


def test_a_capture_cut_inside_a_record_is_one_warning_line(generated_capture, tmp_path):
    """A capture cut off inside its last record: the complete frames are sent and the cut is
    reported on one ``warning:`` line (no Python source location or code line)."""
    path, _ = generated_capture
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(path.read_bytes()[:5000])
    r = run([*WIRETRACE, "replay", str(cut), "--udp", "127.0.0.1:9", "--topspeed", "--json"])
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: {cut}: capture truncated: record of frame ")
    assert json.loads(r.stdout)["packets"] >= 1


def test_native_ib_frames_completed_with_icrc_and_vcrc(tmp_path):
    """Native InfiniBand (ERF): frames cut at 100 bytes come back equal to the whole frames, VCRC
    included; over UDP the BTH .. ICRC part of each."""
    from wiretrace.io.capture import iter_frames
    from wiretrace.replay import complete_frames

    doc = json.loads(PLAN.read_text())
    doc["transport"] = {"kind": "ib", "path_mtu": 4096}
    plan = tmp_path / "ib.json"
    plan.write_text(json.dumps(doc))
    window = busy_window(tmp_path, plan, 20_000)
    for snap in ("100", "0"):
        r = run([*WIRETRACE, "generate", "--plan", str(plan), "-o", str(tmp_path / f"s{snap}.erf"), "-q",
                 "--window", window, "--no-parquet", "--snaplen", snap])
        assert r.returncode == 0, r.stderr
    whole = [bytes(b.frame(i)) for b in iter_frames(tmp_path / "s0.erf") for i in range(len(b))]
    done = []
    for b in iter_frames(tmp_path / "s100.erf"):
        fill = complete_frames(b)
        assert fill.rebuilt[b.caplen < b.origlen].all()
        for i in range(len(b)):
            cl, ol = int(b.caplen[i]), int(b.origlen[i])
            done.append(bytes(b.frame(i)) + (fill.tail(i, cl, ol) if cl < ol else b""))
    assert len(whole) > 100 and any(len(f) > 4000 for f in whole)
    assert done == whole
    port, got, t = udp_receiver()
    r = run([*WIRETRACE, "replay", str(tmp_path / "s100.erf"), "--udp", f"127.0.0.1:{port}", "--topspeed"])
    t.join()
    assert r.returncode == 0, r.stderr
    # LRH 8 bytes (LNH 2: no GRH), the BTH from byte 8, ICRC then 2 bytes of VCRC at the end
    assert [g for _, g in got] == [f[8:-2] for f in whole]


def test_iface_recorded_timing_and_loop(netns_pair, capture, tmp_path):
    path, full = capture
    dump = Tcpdump(netns_pair["b"], netns_pair["ib"], tmp_path / "rx.pcap")
    r = replay_in(netns_pair["a"], str(path), "--iface", netns_pair["ia"], "--speed", "2", "--loop", "2", "--json", *RT)
    got = dump.stop()
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [g for _, g in got] == padded(full) * 2
    assert rep["loops"] == 2 and rep["packets"] == 600
    # recorded gap 100 µs at speed 2 -> 50 µs; each loop spans 299 gaps and the second starts as
    # the first ends (no loop delay, as tcpreplay without --loopdelay-ms)
    # (judged on the median gap seen by tcpdump, which a scheduling hiccup of the receiving side
    # on a busy host cannot move, unlike the span between first and last frame)
    import statistics

    arrivals = [t for t, _ in got]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert statistics.median(gaps) == pytest.approx(50e-6, rel=0.05)
    assert gaps[299] < 1e-3          # the second pass follows the first at once
    assert rep["timing_error_p99_ns"] is not None


def test_iface_tcpreplay_engine(netns_pair, capture, tmp_path):
    need("tcpreplay")
    path, full = capture
    dump = Tcpdump(netns_pair["b"], netns_pair["ib"], tmp_path / "rx.pcap")
    r = replay_in(netns_pair["a"], str(path), "--iface", netns_pair["ia"], "--engine", "tcpreplay",
                  "--pps", "20000", "--json")
    got = dump.stop()
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["engine"] == "tcpreplay" and rep["packets"] == 300
    assert [g for _, g in got] == padded(full)


def test_real_vectors_on_veth(netns_pair, tmp_path):
    src = REAL / "scapy_roce_test_vectors.pcap"
    with open(src, "rb") as f:
        want = [bytes(b) for _, b in dpkt.pcap.Reader(f)]
    dump = Tcpdump(netns_pair["b"], netns_pair["ib"], tmp_path / "rx.pcap")
    r = replay_in(netns_pair["a"], str(src), "--iface", netns_pair["ia"], "--topspeed")
    got = dump.stop()
    assert r.returncode == 0, r.stderr
    assert [g for _, g in got] == want
    assert "sent 2 packets, 152 bytes" in r.stdout
    # no schedule to keep: no timing error to report
    assert "timing error   n/a (--topspeed sends without a schedule)" in r.stdout.splitlines()


def test_errors_are_one_line_exit_2(netns_pair, capture, tmp_path):
    path, _ = capture
    ns, dev = netns_pair["a"], netns_pair["ia"]
    r = replay_in(ns, str(path), "--iface", "nosuch0")
    assert r.returncode == 2 and r.stderr.strip() == "error: --iface nosuch0: no such network interface (see `ip link`)"
    assert run(["ip", "netns", "exec", ns, "ip", "link", "set", dev, "down"]).returncode == 0
    r = replay_in(ns, str(path), "--iface", dev)
    assert r.returncode == 2 and r.stderr.strip() == f"error: --iface {dev}: interface is down (ip link set {dev} up)"
    assert run(["ip", "netns", "exec", ns, "ip", "link", "set", dev, "up"]).returncode == 0
    # MTU too small for the largest frame
    assert run(["ip", "netns", "exec", ns, "ip", "link", "set", dev, "mtu", "1000"]).returncode == 0
    r = replay_in(ns, str(path), "--iface", dev)
    assert r.returncode == 2 and "MTU 1000" in r.stderr and "ip link set" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    if shutil.which("tcpreplay") or IN_CI:      # tcpreplay would skip the frames and exit 0
        r = replay_in(ns, str(path), "--iface", dev, "--engine", "tcpreplay")
        assert r.returncode == 2 and "MTU 1000" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # native InfiniBand link type cannot go on an Ethernet interface
    ib = tmp_path / "ib.pcap"
    with open(ib, "wb") as f:
        w = dpkt.pcap.Writer(f, linktype=247)
        w.writepkt(bytes.fromhex("f0020003001a0001") + bytes(44), ts=1.0)
    r = replay_in(ns, str(ib), "--iface", dev)
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: capture link type 247 (InfiniBand) cannot be sent on {dev} (Ethernet)")
    # native InfiniBand in ERF: named by its ERF record type and the ERF link type
    erf = tmp_path / "ib.erf"
    doc = json.loads(PLAN.read_text())
    doc["transport"] = {"kind": "ib", "path_mtu": 4096}
    (tmp_path / "ib.json").write_text(json.dumps(doc))
    window = busy_window(tmp_path, tmp_path / "ib.json", 2_000)
    r = run([*WIRETRACE, "generate", "--plan", str(tmp_path / "ib.json"), "-o", str(erf), "-q", "--no-parquet",
             "--window", window])
    assert r.returncode == 0, r.stderr
    r = replay_in(ns, str(erf), "--iface", dev)
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: ERF records of type 21 (InfiniBand; pcap link type 197) cannot be sent "
                               f"on {dev} (Ethernet)")
    # not a capture
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    r = replay_in(ns, str(bad), "--iface", dev)
    assert r.returncode == 2 and "not a capture" in r.stderr


def replay_unprivileged(src: Path, *args: str) -> subprocess.CompletedProcess:
    """``wiretrace replay`` of a copy of ``src`` (readable by all) as user nobody, with no
    capabilities (setpriv)."""
    need_root()
    need("setpriv")
    public = Path(tempfile.mkdtemp(prefix="wiretrace-perm-"))
    try:
        os.chmod(public, 0o755)
        path = public / "roce.pcap"
        shutil.copy(src, path)
        os.chmod(path, 0o644)
        return run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                    "--bounding-set=-all", *WIRETRACE, "replay", str(path), *args],
                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    finally:
        shutil.rmtree(public)


def test_permission_error_without_cap_net_raw(capture):
    src, _ = capture
    r = replay_unprivileged(src, "--iface", "lo")
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: replay --iface needs a raw socket: run as root or grant CAP_NET_RAW "
                                "(setcap cap_net_raw+ep on the Python interpreter)")


SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)   # Linux socket(7)


def test_rt_priority_needs_privilege(capture):
    src, _ = capture
    r = replay_unprivileged(src, "--udp", "127.0.0.1:9", *RT)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --rt-priority needs root or CAP_SYS_NICE (SCHED_FIFO)"
    r = run([*WIRETRACE, "replay", str(src), "--udp", "127.0.0.1:9", "--rt-priority", "100"])
    assert r.returncode == 2 and r.stderr.strip() == "error: --rt-priority 100: expected 1..99"


def udp_receiver(family=socket.AF_INET, host="127.0.0.1"):
    """A UDP socket collecting (kernel receive time in s, datagram) in a thread."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.bind((host, 0))
    got = []

    def loop():
        sock.settimeout(2.0)
        try:
            while True:
                data, anc, _, _ = sock.recvmsg(65535, 256)
                sec, nsec = next(struct.unpack("qq", d[:16]) for lvl, typ, d in anc if typ == SO_TIMESTAMPNS)
                got.append((sec + nsec * 1e-9, data))
        except socket.timeout:
            pass
        finally:
            sock.close()

    t = threading.Thread(target=loop)
    t.start()
    return sock.getsockname()[1], got, t


def test_udp_sends_bth_onward_with_timing(capture):
    path, full = capture
    port, got, t = udp_receiver()
    r = run([*WIRETRACE, "replay", str(path), "--udp", f"127.0.0.1:{port}", "--pps", "5000", "--json", *RT])
    t.join()
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    # expected: the UDP payload of each frame as scapy decodes it (BTH .. ICRC), zero-padded where
    # the capture cut the frame
    want = []
    for i, raw in enumerate(padded(full)):
        udp = Ether(full[i])[UDP]
        start = len(raw) - len(bytes(udp)) + 8
        want.append(raw[start:start + udp.len - 8])
    assert [g for _, g in got] == want
    assert rep["packets"] == 300 and rep["bytes"] == sum(map(len, want))
    assert abs(rep["achieved_pps"] - 5000) / 5000 < 0.05
    rx_pps = (len(got) - 1) / (got[-1][0] - got[0][0])
    assert abs(rx_pps - 5000) / 5000 < 0.05


def test_udp_real_vectors_ipv6_target():
    port, got, t = udp_receiver(socket.AF_INET6, "::1")
    r = run([*WIRETRACE, "replay", str(REAL / "scapy_roce_test_vectors.pcap"), "--udp", f"[::1]:{port}"])
    t.join()
    assert r.returncode == 0, r.stderr
    # frame 1: UC SEND ONLY, BTH(12) + 18 B payload + 2 pad + ICRC 78 f3 53 f3 = 36 B (UDP length 44)
    # frame 2: CNP, BTH(12) + 16 zero bytes + ICRC 82 fd 00 2a
    assert [len(g) for _, g in got] == [36, 32]
    assert got[0][1].endswith(bytes.fromhex("78f353f3"))
    assert got[1][1][0] == 0x81 and got[1][1].endswith(bytes.fromhex("82fd002a"))


def test_option_errors(capture):
    path, _ = capture
    for args, msg in (([], "replay needs exactly one target"),
                      (["--udp", "localhost"], "expected HOST:PORT"),
                      (["--udp", "127.0.0.1:70000"], "port 70000 is not in 1..65535"),
                      (["--udp", "127.0.0.1:9", "--pps", "10", "--topspeed"], "choose one of --pps, --mbps and --topspeed"),
                      (["--udp", "127.0.0.1:9", "--loop", "0"], "--loop 0: must be at least 1"),
                      (["--udp", "127.0.0.1:9", "--speed", "0"], "--speed 0: expected a positive finite number"),
                      (["--udp", "127.0.0.1:9", "--speed", "nan"], "--speed nan: expected a positive finite number"),
                      (["--udp", "127.0.0.1:9", "--pps", "inf"], "--pps inf: expected a positive finite number"),
                      (["--udp", "127.0.0.1:9", "--mbps", "-5"], "--mbps -5: expected a positive finite number"),
                      (["--udp", "127.0.0.1:9", "--engine", "tcpreplay"], "sends on interfaces only")):
        r = run([*WIRETRACE, "replay", str(path), *args])
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1
