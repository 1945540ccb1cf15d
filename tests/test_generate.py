"""The main job end to end: `wiretrace generate` on the demo plan, as a user runs it.

Checks the capture with tshark (an independent dissector), the Parquet tables against each other
and against the published ring all-reduce volume 2(n-1)*S (Patarasuk & Yuan 2009; nccl-tests
doc/PERFORMANCE.md bus bandwidth), determinism, and every error path of the command.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conftest import SAMPLES, require_tool, run_cli

PSN_MOD = 1 << 24


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", out / "iter.pcap", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return out


def tables(out: Path):
    d = out / "iter.parquet"
    return (pq.read_table(d / "collectives.parquet"), pq.read_table(d / "messages.parquet"),
            pq.read_table(d / "packets.parquet"))


def test_outputs_exist_with_declared_columns(demo: Path):
    from wiretrace import tables as T

    assert (demo / "iter.pcap").stat().st_size > 24
    for name, t in zip(T.TABLES, tables(demo)):
        assert t.column_names == T.column_names(name)
        assert t.num_rows > 0
    # pcap global header: nanosecond magic, Ethernet link type, snaplen 128
    head = (demo / "iter.pcap").read_bytes()[:24]
    assert head[:4] == bytes.fromhex("4d3cb2a1")
    assert int.from_bytes(head[16:20], "little") == 128
    assert int.from_bytes(head[20:24], "little") == 1


def test_tshark_decodes_every_frame_as_rocev2(demo: Path):
    tshark = require_tool("tshark")
    _, _, pk = tables(demo)
    out = subprocess.run([tshark, "-r", demo / "iter.pcap", "-T", "fields", "-E", "separator=,",
                          "-e", "udp.dstport", "-e", "infiniband.bth.opcode", "-e", "infiniband.bth.destqp",
                          "-e", "infiniband.bth.psn", "-e", "frame.len"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == pk.num_rows
    rows = [line.split(",") for line in out]
    assert all(r[0] == "4791" for r in rows)
    opcode = np.array([int(r[1], 0) for r in rows])
    destqp = np.array([int(r[2], 0) for r in rows])
    psn = np.array([int(r[3], 0) for r in rows])
    flen = np.array([int(r[4]) for r in rows])
    assert np.array_equal(opcode, pk.column("opcode").to_numpy())
    assert np.array_equal(destqp, pk.column("dest_qp").to_numpy())
    assert np.array_equal(psn, pk.column("psn").to_numpy())
    assert np.array_equal(flen, pk.column("frame_len").to_numpy())
    expert = subprocess.run([tshark, "-r", demo / "iter.pcap", "-q", "-z", "expert,error"],
                            capture_output=True, text=True, check=True).stdout
    assert "Malformed" not in expert and "Error" not in expert.replace("Errors (0)", "")


def test_payload_bytes_are_conserved(demo: Path):
    _, msg, pk = tables(demo)
    net = msg.filter(pc.equal(msg.column("link"), "network"))
    data_ops = pk.filter(pc.not_equal(pk.column("opcode"), 0x11))  # everything but ACKs
    assert pc.sum(data_ops.column("payload_len")).as_py() == pc.sum(net.column("wire_bytes")).as_py()


def test_ring_all_reduce_moves_2_n_minus_1_S(demo: Path):
    coll, msg, _ = tables(demo)
    ar = coll.filter(pc.and_(pc.equal(coll.column("op"), "all_reduce"), pc.equal(coll.column("algorithm"), "ring")))
    assert ar.num_rows > 0
    data = msg.filter(pc.equal(msg.column("kind"), "data"))
    op_ids = data.column("op_id").to_numpy()
    sent = np.bincount(op_ids, weights=data.column("bytes").to_numpy(), minlength=coll.num_rows)
    for row in ar.select(["op_id", "group_size", "bytes_global"]).to_pylist():
        n, S = row["group_size"], row["bytes_global"]
        assert sent[row["op_id"]] == 2 * (n - 1) * S


def test_dp_all_reduce_is_the_only_network_traffic_of_tp4_dp2(demo: Path):
    coll, msg, _ = tables(demo)
    net = msg.filter(pc.equal(msg.column("link"), "network"))
    ops = set(net.column("op_id").to_numpy().tolist())
    par = coll.column("parallelism").to_pylist()
    assert ops and {par[o] for o in ops} == {"dp"}
    tp_ops = {i for i, p in enumerate(par) if p == "tp"}
    tp_msgs = msg.filter(pc.is_in(msg.column("op_id"), value_set=__import__("pyarrow").array(sorted(tp_ops))))
    assert set(tp_msgs.column("link").to_pylist()) == {"nvlink"}


def test_psn_contiguous_and_opcode_sequences(demo: Path):
    _, msg, pk = tables(demo)
    d = pk.to_pydict()
    opcode = np.array(d["opcode"])
    data = opcode != 0x11
    qp = np.array(d["dest_qp"])[data]
    psn = np.array(d["psn"])[data]
    src = np.array(d["src_nic"])[data]
    mid = np.array(d["msg_id"])[data]
    ops = opcode[data]
    plen = np.array(d["payload_len"])[data]
    # per (sender NIC, QP), in capture order: PSN increments by one modulo 2^24
    key = src.astype(np.int64) * (1 << 24) + qp
    order = np.lexsort((np.arange(len(key)), key))
    k, p = key[order], psn[order]
    same = k[1:] == k[:-1]
    assert np.all((p[1:][same] - p[:-1][same]) % PSN_MOD == 1)
    # per message: FIRST MIDDLE* LAST(_WITH_IMM) or ONLY; FIRST/MIDDLE carry exactly the MTU
    FIRST, MIDDLE, LAST, LAST_IMM, ONLY, ONLY_IMM = 0x06, 0x07, 0x08, 0x09, 0x0A, 0x0B
    order = np.lexsort((psn, mid))
    wire = dict(zip(msg.column("msg_id").to_pylist(), msg.column("wire_bytes").to_pylist()))
    bounds = np.flatnonzero(np.diff(mid[order])) + 1
    for seq in np.split(order, bounds):
        o = ops[seq].tolist()
        if len(o) == 1:
            assert o[0] in (ONLY, ONLY_IMM)
        else:
            assert o[0] == FIRST and o[-1] in (LAST, LAST_IMM) and all(x == MIDDLE for x in o[1:-1])
            assert all(plen[seq][:-1] == 4096)
        assert plen[seq].sum() == wire[int(mid[seq[0]])]


def test_same_plan_same_bytes(tmp_path: Path, demo: Path):
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "iter.pcap", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert filecmp.cmp(tmp_path / "iter.pcap", demo / "iter.pcap", shallow=False)
    for name in ("collectives", "messages", "packets"):
        a = (tmp_path / "iter.parquet" / f"{name}.parquet").read_bytes()
        b = (demo / "iter.parquet" / f"{name}.parquet").read_bytes()
        assert a == b, name


def test_summary_names_the_outputs(tmp_path: Path):
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "x.pcap",
                   "--parallelism", "dp", "--ranks", "0,4")
    assert proc.returncode == 0, proc.stderr
    for word in ("collectives", "messages", "packets", "network bytes", "iteration", str(tmp_path / "x.pcap")):
        assert word in proc.stdout


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


def write_plan(tmp_path: Path, mutate, base: Path = SAMPLES / "gpt2-small-2x4.json") -> Path:
    d = json.loads(base.read_text())
    mutate(d)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: d["cluster"].update(nodes=0), "$.cluster.nodes"),
    (lambda d: d["transport"].update(path_mtu=9000), "$.transport.path_mtu"),
    (lambda d: d["parallelism"].update(dp=4), "tp*cp*dp*pp = 4*1*4*1 = 16 but nodes*gpus_per_node = 2*4 = 8"),
    (lambda d: d["parallelism"].update(tp=8, dp=1) or d["cluster"].update(gpus_per_node=8, nodes=1)
     or d["model"].update(num_attention_heads=12), None),
    (lambda d: d["model"].update(preset="gpt5"), "unknown preset 'gpt5'"),
    (lambda d: d["training"].update(global_batch_size=10), "global_batch_size = 10 is not divisible by micro_batch_size*dp = 4*2 = 8"),
    (lambda d: d["model"].update(num_hidden_layers=13) or d["parallelism"].update(pp=2, dp=1), "num_hidden_layers = 13 is not divisible by pp"),
])
def test_bad_plans_exit_2_with_one_line_and_no_files(tmp_path: Path, mutate, fragment):
    plan = write_plan(tmp_path, mutate)
    before = _files(tmp_path)
    proc = run_cli("generate", "--plan", plan, "-o", tmp_path / "out.pcap")
    if fragment is None:   # tp 8 with 12 heads: heads not divisible by tp
        fragment = "num_attention_heads = 12 is not divisible by tp = 8"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert fragment in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert _files(tmp_path) == before


def test_existing_output_needs_force(tmp_path: Path):
    target = tmp_path / "iter.pcap"
    target.write_bytes(b"keep me")
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", target, "--quiet")
    assert proc.returncode == 2 and "--force" in proc.stderr
    assert target.read_bytes() == b"keep me"
    assert _files(tmp_path) == {"iter.pcap"}
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", target, "--quiet", "--force")
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes()[:4] == bytes.fromhex("4d3cb2a1")


@pytest.mark.parametrize("where", ["-o", "--parquet", "rotation"])
def test_a_named_pipe_or_device_is_never_replaced(tmp_path: Path, where):
    """Outputs are written under a temporary name and renamed: a named pipe (or /dev/null) as
    an output would be replaced by a regular file, so it is refused, with --force too, and left
    as it was."""
    import stat

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    base = ["generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "--window", "5.4ms:5.402ms", "-q", "--force"]
    if where == "-o":
        args = [*base, "-o", fifo, "--no-parquet"]
    elif where == "--parquet":
        args = [*base, "-o", tmp_path / "x.pcap", "--parquet", fifo]
    else:
        os.rename(fifo, tmp_path / "x.pcap1")
        fifo = tmp_path / "x.pcap1"
        args = [*base, "-o", tmp_path / "x.pcap", "--no-parquet", "--max-file-size", "168"]
    for run in (args, [a for a in args if a != "--force"]):          # with --force and without
        proc = run_cli(*run)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"error: {fifo} is a named pipe, not a regular file; wiretrace writes its outputs as files (written "
            f"whole, then renamed into place), and does not replace a named pipe"]
        assert stat.S_ISFIFO(fifo.stat().st_mode)
        assert sorted(p.name for p in tmp_path.iterdir()) == [fifo.name]


@pytest.mark.parametrize("case", ["split", "parquet", "dir_as_capture"])
def test_force_never_deletes_files_wiretrace_did_not_write(tmp_path: Path, case):
    """--force replaces wiretrace's own outputs only: a --split directory or a tables directory
    holding other files, or a directory where the capture file goes, is refused (exit 2, one
    line) and left as it was; a directory holding only wiretrace's files is replaced."""
    plan = SAMPLES / "gpt2-small-2x4.json"
    base = ["generate", "--plan", plan, "--window", "5ms:6ms", "-q", "--force"]
    if case == "split":
        target = tmp_path / "d"
        args = base + ["-o", target, "--split", "nic", "--no-parquet"]
    elif case == "parquet":
        target = tmp_path / "tables"
        args = base + ["-o", tmp_path / "x.pcap", "--parquet", target]
    else:
        target = tmp_path / "cap.pcap"
        args = base + ["-o", target, "--no-parquet"]
    if case != "dir_as_capture":
        run_cli(*args, check=True)                        # a directory of wiretrace's own files
        mine = sorted(p.name for p in target.iterdir())
        assert mine and run_cli(*args).returncode == 0    # ... is replaced
        assert sorted(p.name for p in target.iterdir()) == mine
    (target / "sub").mkdir(parents=True, exist_ok=True)
    (target / "sub" / "notes.txt").write_text("precious")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert ("is a directory" if case == "dir_as_capture" else "does not write") in proc.stderr
    assert (target / "sub" / "notes.txt").read_text() == "precious"
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("case", ["capture_named_file", "rotation_dir", "rotation_taken", "same_path",
                                  "tables_hold_capture", "file_for_dir", "dir_without_force"])
def test_outputs_that_are_not_wiretraces_are_refused_up_front(tmp_path: Path, case):
    """More ways an output could clobber what the user has: a file of theirs named like a
    capture in a --split directory, a directory at a rotation name, a rotation name taken
    (without --force: refused before anything is written), --parquet and -o on one path or
    nested, a file where a directory goes, an existing directory for the capture. Each is one
    line, exit 2, and the directory looks as before: no temporary files either."""
    plan = SAMPLES / "gpt2-small-2x4.json"
    base = ["generate", "--plan", plan, "--window", "5ms:6ms", "-q"]
    force = ["--force"]
    if case == "capture_named_file":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "switch-mirror.pcap").write_text("mine")
        args = ["-o", tmp_path / "d", "--split", "nic", "--no-parquet"] + force
    elif case == "rotation_dir":
        (tmp_path / "it.pcap1").mkdir()
        (tmp_path / "it.pcap1" / "thesis.tex").write_text("mine")
        args = ["-o", tmp_path / "it.pcap", "--snaplen", "0", "--max-file-size", "2MB", "--no-parquet"] + force
    elif case == "rotation_taken":
        (tmp_path / "it.pcap2").write_text("mine")
        args = ["-o", tmp_path / "it.pcap", "--snaplen", "0", "--max-file-size", "2MB", "--no-parquet"]
    elif case == "same_path":
        args = ["-o", tmp_path / "x.pcap", "--parquet", tmp_path / "x.pcap"]
    elif case == "tables_hold_capture":
        args = ["-o", tmp_path / "c" / "x.pcap", "--parquet", tmp_path / "c"]
    elif case == "file_for_dir":
        (tmp_path / "notes.txt").write_text("mine")
        args = ["-o", tmp_path / "x.pcap", "--parquet", tmp_path / "notes.txt"] + force
    else:
        (tmp_path / "out").mkdir()
        args = ["-o", tmp_path / "out"]
    before = {str(p.relative_to(tmp_path)): (p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")}
    proc = run_cli(*base, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    after = {str(p.relative_to(tmp_path)): (p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")}
    assert after == before
    if case == "dir_without_force":
        assert "is a directory" in proc.stderr


@pytest.mark.parametrize("transport,snaplen,noted", [({}, 40, "BTH"), ({}, 54, "RETH"), ({}, 70, None),
                                                     ({"ip_version": 6, "vlan": 7}, 70, "BTH"),
                                                     ({"ip_version": 6, "vlan": 7}, 81, "RETH"),
                                                     ({"ip_version": 6, "vlan": 7}, 94, None),
                                                     ({"kind": "ib", "grh": True}, 59, "BTH"),
                                                     ({"kind": "ib", "grh": True}, 61, "RETH"),
                                                     ({"kind": "ib", "grh": True}, 76, None)])
def test_a_snaplen_before_the_end_of_the_bth_is_noted(tmp_path: Path, transport, snaplen, noted):
    """A snap length that cuts frames inside their headers (before the BTH ends: 54 bytes for
    IPv4, 78 for IPv6 with a VLAN tag, 60 for native IB with a GRH; or before the RETH ends: 70,
    94 and 76) still writes the capture, with a note naming the bytes."""
    plan = write_plan(tmp_path, lambda d: d["transport"].update(transport))
    out_file = tmp_path / ("x.erf" if transport.get("kind") == "ib" else "x.pcap")
    proc = run_cli("generate", "--plan", plan, "-o", out_file, "--snaplen", snaplen,
                   "--window", "5ms:6ms", "--no-parquet")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert ("cuts every frame before the end of its BTH" in out) == (noted == "BTH")
    assert ("cuts the RETH" in out) == (noted == "RETH")


@pytest.mark.parametrize("args", [["--ranks", "0-99"], ["--max-packets", "1000"]])
def test_a_refused_run_leaves_no_directory_it_made(tmp_path: Path, args):
    """Output directories are made for the outputs; a run refused after that removes them."""
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "a" / "b" / "x.pcap",
                   *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _files(tmp_path) == set() and not (tmp_path / "a").exists()


def test_a_step_size_that_would_fill_the_memory_is_refused_before_lowering(tmp_path: Path):
    """llama3-8b-4x8 with 4 KiB NCCL steps: one tensor-parallel communicator's calls would lower
    to about 10^9 messages, its data-parallel network calls to about 10^8 (hundreds of GB); refused
    at once, in one line, naming the setting and the memory (--ranks keeps whole calls, so it
    does not make them smaller)."""
    plan = write_plan(tmp_path, lambda d: d.setdefault("collectives", {}).update(step_bytes="4KiB"),
                      SAMPLES / "llama3-8b-4x8.json")
    for extra, what in (([], "the NVLink calls of communicator "), (["--ranks", "0"], "the NVLink calls of "),
                        (["--parallelism", "dp"], "the network calls")):
        proc = run_cli("generate", "--plan", plan, "-o", tmp_path / "x.pcap", *extra)
        assert proc.returncode == 2
        assert proc.stderr.startswith(f"error: {what}") and " would lower to about " in proc.stderr
        assert "collectives.step_bytes 4,096 B, about " in proc.stderr and "this machine has available" in proc.stderr
        assert len(proc.stderr.splitlines()) == 1
        assert not (tmp_path / "x.pcap").exists() and not (tmp_path / "x.parquet").exists()


def test_max_packets_refuses_with_estimate_and_leaves_nothing(tmp_path: Path):
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "iter.pcap",
                   "--max-packets", "1000")
    assert proc.returncode == 2
    assert "would write about" in proc.stderr and "--ranks" in proc.stderr and "--window" in proc.stderr
    assert _files(tmp_path) == set()


@pytest.mark.parametrize("args,fragment", [
    (["--ranks", "3-1"], "--ranks"),
    (["--parallelism", "xp"], "unknown xp"),
    (["--window", "5:1"], "--window"),
    (["--snaplen", "4294967296"], "'--snaplen': 4294967296 is not in the range 0<=x<=262144"),
    (["--plan", "/nonexistent/plan.json"], "cannot read plan"),
])
def test_bad_options_exit_2(tmp_path: Path, args, fragment):
    base = ["generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "i.pcap"]
    if args[0] == "--plan":
        base = ["generate", "-o", tmp_path / "i.pcap"]
    proc = run_cli(*base, *args)
    assert proc.returncode == 2 and fragment in proc.stderr
    assert _files(tmp_path) == set()


def test_window_keeps_only_packets_inside(tmp_path: Path, demo: Path):
    _, _, pk = tables(demo)
    ts = pk.column("ts_ns").to_numpy()
    lo, hi = int(np.percentile(ts, 25)), int(np.percentile(ts, 50))
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "w.pcap",
                   "--window", f"{lo}:{hi}", "--quiet")
    assert proc.returncode == 0, proc.stderr
    w = pq.read_table(tmp_path / "w.parquet" / "packets.parquet")
    inside = pk.filter(pc.and_(pc.greater_equal(pk.column("ts_ns"), lo), pc.less(pk.column("ts_ns"), hi)))
    # the window holds exactly the whole iteration's frames of that time (same PSNs, QPs, times)
    assert w.equals(inside)
    # the tables keep what overlaps the window
    m = pq.read_table(tmp_path / "w.parquet" / "messages.parquet")
    st, en = m.column("t_start_ns").to_numpy(), m.column("t_end_ns").to_numpy()
    assert ((st < hi) & (en > lo)).all() and m.num_rows > 0
    c = pq.read_table(tmp_path / "w.parquet" / "collectives.parquet")
    assert set(c.column("op_id").to_pylist()) == set(m.column("op_id").to_pylist())
    # the printed payload is what the window's frames carry
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "w2.pcap",
                   "--window", f"{lo}:{hi}", "--no-parquet")
    payload = pc.sum(inside.column("payload_len")).as_py()
    assert f"{payload / 1e6:,.2f} MB payload" in proc.stdout


def test_window_summary_counts_the_same_collectives_with_or_without_parquet(tmp_path: Path):
    """The summary's collectives line is the window's calls (those written to collectives.parquet),
    also when no tables are written."""
    base = ["generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "--window", "5ms:6ms"]
    with_tables = run_cli(*base, "-o", tmp_path / "a.pcap")
    without = run_cli(*base, "-o", tmp_path / "b.pcap", "--no-parquet")
    assert with_tables.returncode == 0 and without.returncode == 0, with_tables.stderr + without.stderr
    c = pq.read_table(tmp_path / "a.parquet" / "collectives.parquet")
    assert c.num_rows == 32
    for proc in (with_tables, without):
        lines = proc.stdout.splitlines()
        assert "collectives    32" in lines
        assert "messages       1,936 (208 network, 1,728 NVLink)" in lines
        assert "packets        11,632" in lines


@pytest.fixture(scope="module")
def whole_frames(demo: Path, tmp_path_factory) -> Path:
    """A small whole-frame capture: the first ~1,500 network packets of the demo iteration."""
    _, _, pk = tables(demo)
    ts = np.sort(pk.column("ts_ns").to_numpy())
    out = tmp_path_factory.mktemp("whole") / "w.pcap"
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", out, "--snaplen", "0",
                   "--window", f"0:{int(ts[1500])}", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return out


def test_whole_frames_icrc_equals_scapy(whole_frames: Path):
    """scapy.contrib.roce recomputes each frame's ICRC from its own layers (an independent oracle)."""
    import dpkt
    from scapy.contrib.roce import BTH
    from scapy.layers.l2 import Ether

    with open(whole_frames, "rb") as f:
        frames = [buf for _, buf in dpkt.pcap.Reader(f)]
    assert len(frames) >= 1000
    kinds = set()
    for buf in frames:
        p = Ether(buf)
        kinds.add(p[BTH].opcode)
        assert p[BTH].icrc is not None
        wire = buf[-4:]
        p[BTH].icrc = None
        assert bytes(p)[-4:] == wire
    assert {0x06, 0x07, 0x0A, 0x11} <= kinds      # WRITE FIRST, MIDDLE, ONLY (credit), ACK


def test_whole_frames_decode_without_any_malformed_frame(whole_frames: Path):
    tshark = require_tool("tshark")
    out = subprocess.run([tshark, "-r", whole_frames], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) >= 1000
    assert not [line for line in lines if "Malformed" in line or "RRoCE" not in line]


def test_max_file_size_rotates_like_tcpdump_and_leaves_no_temporary_file(tmp_path: Path, demo: Path):
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "r.pcap",
                   "--max-file-size", "10MB", "--no-parquet")
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["r.pcap", "r.pcap1", "r.pcap2", "r.pcap3"]
    sizes = [(tmp_path / n).stat().st_size for n in names]
    assert max(sizes) <= 10_000_000
    # the rotated files hold exactly the demo's frames: same record bytes, each file with its header
    whole = (demo / "iter.pcap").read_bytes()
    parts = [(tmp_path / n).read_bytes() for n in names]
    assert all(p[:24] == whole[:24] for p in parts)
    assert b"".join(p[24:] for p in parts) == whole[24:]
    assert "(+3 rotated files)" in proc.stdout


@pytest.mark.parametrize("transport,suffix", [
    ({"verb": "read", "path_mtu": 1024}, ".pcap"),
    ({"verb": "send_imm"}, ".pcap"),
    ({"ip_version": 6, "vlan": 7, "pcp": 3}, ".pcapng"),
    ({"ack": {"every_packets": 7}, "initial_psn": "random"}, ".pcap"),
    ({"ecn_marking": {"fraction": 0.05}}, ".pcap"),
    ({"kind": "ib", "grh": True}, ".erf"),
])
def test_every_transport_variant_validates_clean(tmp_path: Path, transport, suffix):
    """Whatever the verb, link layer or ACK policy, the generated capture passes every check of
    `wiretrace validate` (PSN order per QP, opcode sequences, RETH lengths, ACK/MSN, ICRC/VCRC)."""
    plan = write_plan(tmp_path, lambda d: d["transport"].update(transport))
    out = tmp_path / f"v{suffix}"
    proc = run_cli("generate", "--plan", plan, "-o", out, "--parallelism", "dp", "--ranks", "0,1",
                   "--window", "0:6ms", "--snaplen", "0", "--quiet", "--no-parquet")
    assert proc.returncode == 0, proc.stderr
    v = run_cli("validate", out, "--json")
    report = json.loads(v.stdout)
    assert v.returncode == 0, {k: n for k, n in report["counts"].items() if n}
    assert report["roce_frames"] > 1000


def test_readme_display_filters_match_frames_of_the_demo(demo: Path):
    """Every Wireshark display filter the README's table shows selects frames of the demo."""
    import re

    from conftest import ROOT

    tshark = require_tool("tshark")
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("Display filters that work"):readme.index("By default only the first")]
    filters = re.findall(r"^\| `([^`]+)` \|", table, re.M)
    assert len(filters) >= 6
    for f in filters:
        out = subprocess.run([tshark, "-r", demo / "iter.pcap", "-Y", f, "-T", "fields", "-e", "frame.number"],
                             capture_output=True, text=True)
        assert out.returncode == 0, (f, out.stderr)
        assert len(out.stdout.split()) > 0, f"README filter {f!r} matches nothing"


def test_parquet_directory_holds_the_plan(demo: Path):
    doc = json.loads((demo / "iter.parquet" / "plan.json").read_text())
    assert doc == json.loads((SAMPLES / "gpt2-small-2x4.json").read_text())


@pytest.mark.parametrize("args,fragment", [
    (["--ranks", "9"], "--ranks: rank 9 is outside the plan's 8 GPUs (0-7)"),
    (["-o", "/proc/wiretrace-test/x.pcap"], "cannot write /proc/wiretrace-test/x.pcap"),
])
def test_out_of_range_ranks_and_unwritable_outputs(tmp_path: Path, args, fragment):
    base = ["generate", "--plan", SAMPLES / "gpt2-small-2x4.json"]
    if args[0] != "-o":
        base += ["-o", tmp_path / "x.pcap"]
    proc = run_cli(*base, *args)
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert _files(tmp_path) == set()


def test_max_file_size_takes_plain_bytes(tmp_path: Path):
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "r.pcap",
                   "--max-file-size", "20000000", "--no-parquet", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.pcap", "r.pcap1"]


@pytest.mark.parametrize("args,line", [
    (["--max-file-size", "100"],
     "error: --max-file-size 100: expected at least 168 bytes for this pcap capture, its file header "
     "(24 bytes) plus one record of the largest frame (16 + 128 bytes at --snaplen 128)"),
    (["--max-file-size", "4KB", "--snaplen", "0"],
     "error: --max-file-size 4,000: expected at least 4,214 bytes for this pcap capture, its file header "
     "(24 bytes) plus one record of the largest frame (16 + 4,174 bytes)"),
    (["--max-file-size", "900", "--format", "pcapng"],
     "error: --max-file-size 900: expected at least 983 bytes for this pcapng capture, its file header "
     "(820 bytes) plus one record of the largest frame (35 + 128 bytes at --snaplen 128)"),
])
def test_max_file_size_below_one_record_is_refused(tmp_path: Path, args, line):
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "r.pcap", *args)
    assert proc.returncode == 2
    assert proc.stderr == line + "\n" and proc.stdout == ""
    assert _files(tmp_path) == set()


def test_max_file_size_at_the_minimum_keeps_every_file_within_it(tmp_path: Path, demo: Path):
    """At exactly the minimum every file holds at least one frame and none is larger."""
    from wiretrace import plan as plan_mod
    from wiretrace.pipeline import largest_frame

    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "r.pcap",
                   "--max-file-size", "168", "--window", "5.3ms:5.4ms", "--no-parquet", "--quiet")
    assert proc.returncode == 0, proc.stderr
    sizes = sorted(p.stat().st_size for p in tmp_path.iterdir())
    assert len(sizes) == 2088
    assert sizes[0] > 24 and sizes[-1] == 168
    # the largest frame the minimum is computed from bounds every frame of the whole iteration
    _, _, pk = tables(demo)
    plan = plan_mod.load(SAMPLES / "gpt2-small-2x4.json")
    assert largest_frame(plan) == 4174 >= pc.max(pk.column("frame_len")).as_py() == 4170


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGTERM", "SIGTERM"), ("SIGINT",)])
def test_signals_leave_nothing_behind(tmp_path: Path, signals):
    """A killed run (SIGTERM, as from a batch scheduler; twice, as `timeout` sends it to the
    process and its group; Ctrl-C) removes its temporary outputs, says so in one line after
    doing it, and exits 128 + the signal. (The run writes 2.3 GB in several seconds; whole frames
    would be 65 GB, which a disk with less free space refuses before writing.)"""
    import signal
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "wiretrace.cli", "generate", "--plan",
                             SAMPLES / "llama3-8b-4x8.json", "-o", tmp_path / "big.pcap",
                             "--parallelism", "dp"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.stat().st_size > 10_000_000 for p in tmp_path.rglob("*") if p.is_file()):
        time.sleep(0.1)
    for name in signals:
        proc.send_signal(getattr(signal, name))
        time.sleep(0.002)
    _, err = proc.communicate(timeout=60)
    sig = getattr(signal, signals[0])
    assert proc.returncode == 128 + sig
    what = "interrupted" if signals[0] == "SIGINT" else "terminated by signal 15"
    assert err.splitlines() == [f"wiretrace: {what}; temporary outputs removed"], err
    assert _files(tmp_path) == set()


def test_ipv6_vlan_packets_do_not_depend_on_chunk_size(tmp_path: Path):
    """The sample plan over IPv6 with a VLAN tag: an ACK that answers a data packet placed in an
    earlier expansion step starts no earlier, in picoseconds, than one placed in the same step
    (it once started up to 1 ns earlier there, shifting the frames behind it by 1 ns, so the
    capture changed with the chunk size)."""
    from wiretrace import plan as P, topology
    from wiretrace.transport import packetize

    plan_path = write_plan(tmp_path, lambda d: d["transport"].update(ip_version=6, vlan=3))
    run_cli("generate", "--plan", plan_path, "-o", tmp_path / "x.pcapng", "-q", check=True)
    m = pq.read_table(tmp_path / "x.parquet" / "messages.parquet").to_pydict()
    m = {k: np.asarray(v, dtype=object if isinstance(v[0], str) else None) for k, v in m.items()}
    plan = P.load(plan_path)
    topo = topology.build(plan)
    runs = []
    for size in (1 << 20, 1 << 16, 5000):
        chunks = list(packetize(m, topo, plan, chunk_packets=size))
        runs.append({k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]})
    assert len(runs[0]["ts_ns"]) == 254_672
    for other in runs[1:]:
        for k in runs[0]:
            np.testing.assert_array_equal(other[k], runs[0][k], err_msg=k)
    want = pq.read_table(tmp_path / "x.parquet" / "packets.parquet").column("ts_ns").to_numpy()
    np.testing.assert_array_equal(runs[0]["ts_ns"], want)


def test_force_replaces_the_whole_rotated_set(tmp_path: Path):
    """A second run with --force and fewer rotated files leaves only its own files; a file that
    does not continue the numbering is not touched."""
    base = ["generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "r.pcap", "--snaplen", "0",
            "--window", "5ms:6ms", "--no-parquet", "-q"]
    run_cli(*base, "--max-file-size", "2MB", check=True)
    assert len(list(tmp_path.iterdir())) == 24
    (tmp_path / "r.pcap99").write_bytes(b"keep")
    run_cli(*base, "--max-file-size", "20MB", "--force", check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.pcap", "r.pcap1", "r.pcap2", "r.pcap99"]
    run_cli(*base, "--force", check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.pcap", "r.pcap99"]


def test_a_signal_after_the_outputs_are_in_place_keeps_them_and_says_so(tmp_path: Path):
    """SIGTERM that lands after the outputs were renamed into place: they are complete, they stay,
    the message says so, and the status still reports the signal (128 + 15)."""
    import sys

    script = (
        "import os, signal, sys, time\n"
        "import wiretrace.pipeline as p\n"
        "from wiretrace.cli import main\n"
        "real = p.run_generate\n"
        "def killed_after(*a, **k):\n"
        "    s = real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(1)\n"
        "    return s\n"
        "p.run_generate = killed_after\n"
        "sys.argv = ['wiretrace'] + sys.argv[1:]\n"
        "main()\n")
    out = tmp_path / "k.pcap"
    proc = subprocess.run([sys.executable, "-c", script, "generate", "--plan", str(SAMPLES / "gpt2-small-2x4.json"),
                           "-o", str(out), "--window", "5ms:6ms", "-q"], capture_output=True, text=True)
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.splitlines() == [
        "wiretrace: terminated by signal 15 after its outputs were written; they are complete and kept"]
    assert out.stat().st_size > 24 and (tmp_path / "k.parquet" / "packets.parquet").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_capture_larger_than_the_free_space_is_refused_before_writing(tmp_path: Path, monkeypatch):
    """The capture's estimated size is checked against the free space of its directory first:
    one error naming both and the ways out, nothing written."""
    import shutil
    from collections import namedtuple

    from wiretrace import pipeline
    from wiretrace import plan as plan_mod
    from wiretrace.errors import WiretraceError

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 ** 9, 10 ** 9 - 5_000_000, 5_000_000))
    plan = plan_mod.load(SAMPLES / "gpt2-small-2x4.json")
    with pytest.raises(WiretraceError) as e:
        pipeline.run_generate(plan, tmp_path / "big.pcap", snaplen=0)
    msg = str(e.value)
    # 254,672 packets of at most 4,096 + 100 bytes plus a 16-byte record header each
    assert msg.startswith(f"this run would write about {pipeline.human_bytes(254_672 * (4096 + 100 + 16))} "
                          f"of capture (254,672 packets) but {tmp_path} has 5.00 MB free"), msg
    assert "--snaplen" in msg
    assert list(tmp_path.iterdir()) == []
    s = pipeline.run_generate(plan, tmp_path / "small.pcap", snaplen=64, parquet_dir=None, write_parquet=False,
                              selection=pipeline.Selection(window=pipeline.parse_window("5ms:6ms")))
    assert s.packets == 11_632


def test_a_window_without_packets_names_the_traffic_span(tmp_path: Path):
    proc = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "w.pcap",
                   "--window", "1s:2s", "--no-parquet")
    assert proc.returncode == 0, proc.stderr
    full = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "all.pcap", check=True)
    pk = pq.read_table(tmp_path / "all.parquet" / "packets.parquet")
    note = [line for line in proc.stderr.splitlines() if line.startswith("note: --window")]
    assert len(note) == 1 and note[0].startswith("note: --window 1,000,000,000:2,000,000,000 ns holds no packet; "
                                                 "this run's network traffic spans ")
    first, last = (int(x.replace(",", "")) for x in note[0].split("spans ")[1].removesuffix(" ns").split(" to "))
    m = pq.read_table(tmp_path / "all.parquet" / "messages.parquet").to_pydict()
    net = [i for i, link in enumerate(m["link"]) if link == "network"]
    ts = pk.column("ts_ns").to_numpy()
    assert first == min(m["t_start_ns"][i] for i in net) == ts.min()
    assert last == max(max(m["t_end_ns"][i] for i in net), ts.max()) and full.returncode == 0


def test_ecn_marks_and_cnps_are_counted_in_the_summary(tmp_path: Path):
    plan = write_plan(tmp_path, lambda d: d["transport"].update(ecn_marking={"fraction": 0.05}))
    proc = run_cli("generate", "--plan", plan, "-o", tmp_path / "e.pcap", check=True)
    pk = pq.read_table(tmp_path / "e.parquet" / "packets.parquet")
    op = pk.column("opcode").to_numpy()
    ecn = pk.column("ecn").to_numpy()
    ce, cnps = int(((ecn == 3) & (op != 0x81)).sum()), int((op == 0x81).sum())
    assert ce > 1000 and cnps > 1000
    assert f"ecn            {ce:,} data packets marked CE, {cnps:,} CNPs" in proc.stdout.splitlines()
    plain = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "p.pcap", check=True)
    assert "ecn " not in plain.stdout


def test_the_capture_streams_to_standard_output(tmp_path: Path):
    """-o - writes the same bytes as a file would, on standard output; the summary goes to
    standard error; no tables unless --parquet; splitting and rotation are refused; a reader that
    stops early ends the run with one line and status 141 (128 + SIGPIPE)."""
    import signal
    import sys

    plan = SAMPLES / "gpt2-small-2x4.json"
    cmd = [sys.executable, "-m", "wiretrace.cli", "generate", "--plan", str(plan), "--window", "5.4ms:5.5ms"]
    run_cli("generate", "--plan", plan, "--window", "5.4ms:5.5ms", "-o", tmp_path / "f.pcap", "--no-parquet",
            check=True)
    with open(tmp_path / "s.pcap", "wb") as out:
        proc = subprocess.run([*cmd, "-o", "-"], stdout=out, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "s.pcap").read_bytes() == (tmp_path / "f.pcap").read_bytes()
    assert "capture        standard output" in proc.stderr.splitlines()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.pcap", "s.pcap"]      # no tables, no "-"
    r = subprocess.run([*cmd, "-o", "-", "--split", "nic"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: --split: standard output (-o -) is one stream")
    p = subprocess.Popen([*cmd, "-o", "-", "--window", "5ms:9ms", "-q"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert len(p.stdout.read(100)) == 100
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 128 + signal.SIGPIPE
    assert err.splitlines() == ["wiretrace: standard output was closed by its reader; the capture it "
                                "received is incomplete"]


def test_a_capture_is_not_written_to_a_terminal(tmp_path: Path):
    import pty
    import sys

    master, slave = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "wiretrace.cli", "generate", "--plan",
                            str(SAMPLES / "gpt2-small-2x4.json"), "-o", "-"], stdout=slave,
                           stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 2 and r.stderr.startswith("error: -o -: standard output is a terminal")


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path):
    """Writes that fail for lack of room (here a 256 KiB file size limit, RLIMIT_FSIZE, which
    fails them with EFBIG as a full disk does with ENOSPC): one line, exit 2, nothing left
    behind; a capture streamed to standard output says the capture it received is incomplete."""
    import resource
    import signal
    import sys

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # a failed write, not a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    cmd = [sys.executable, "-m", "wiretrace.cli", "generate", "--plan", str(SAMPLES / "gpt2-small-2x4.json"), "-q"]
    out_dir = tmp_path / "out"
    proc = subprocess.run([*cmd, "-o", str(out_dir / "x.pcap")], capture_output=True, text=True, timeout=300,
                          preexec_fn=small_files)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: cannot write {out_dir}/")
    assert proc.stderr.endswith(": File too large; outputs not written\n") and len(proc.stderr.splitlines()) == 1
    assert not out_dir.exists()
    with open(tmp_path / "s.pcap", "wb") as out:
        proc = subprocess.run([*cmd, "-o", "-"], stdout=out, stderr=subprocess.PIPE, text=True, timeout=300,
                              preexec_fn=small_files)
    assert proc.returncode == 2
    assert proc.stderr == ("error: cannot write standard output: File too large; the capture it received "
                           "is incomplete\n")
