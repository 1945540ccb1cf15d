"""The command line as documentation: every command and option explains itself."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from conftest import SAMPLES, run_cli
from wiretrace.cli import main

COMMANDS = sorted(main.commands)


def test_the_documented_commands_exist():
    assert {"generate", "schedule", "explain", "validate", "summarize", "plot", "replay"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_and_option_has_help(name):
    cmd = main.commands[name]
    assert cmd.help and len(cmd.help.strip()) > 20, f"{name} has no help"
    for p in cmd.params:
        if isinstance(p, click.Option) and p.name not in ("help",):
            assert p.help, f"{name} {p.opts} has no help text"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_runs(name):
    r = CliRunner().invoke(main, [name, "--help"])
    assert r.exit_code == 0 and "Usage:" in r.output


def test_version_and_group_help():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for name in COMMANDS:
        assert name in r.output
    assert CliRunner().invoke(main, ["--version"]).output.startswith("wiretrace, version")


def test_usage_errors_exit_2():
    r = CliRunner().invoke(main, ["generate", "-o", "x.pcap"])
    assert r.exit_code == 2 and "--plan" in r.output


PLAN = str(SAMPLES / "gpt2-small-2x4.json")


@pytest.mark.parametrize("args,line", [
    (["generate", "--plan", PLAN, "-o", "{out}", "--format", "pcapx"],
     "error: invalid value for '--format': 'pcapx' is not one of 'pcap', 'pcapng', 'erf'."),
    (["generate", "--plan", PLAN, "-o", "{out}", "--split", "foo"],
     "error: invalid value for '--split': 'foo' is not 'nic'."),
    (["generate", "--plan", PLAN, "-o", "{out}", "--snaplen", "abc"],
     "error: invalid value for '--snaplen': 'abc' is not a valid integer range."),
    (["generate", "--plan", PLAN, "-o", "{out}", "--snaplen", "-1"],
     "error: invalid value for '--snaplen': -1 is not in the range 0<=x<=262144."),
    (["generate", "-o", "{out}"], "error: missing option '--plan'."),
    (["generate", "--plan", PLAN, "-o", "{out}", "--forse"],
     "error: no such option '--forse'. (Did you mean one of: '--force', '--format'?)"),
    (["schedule", "--from", PLAN, "-o", "{out}", "--format", "csv"],
     "error: invalid value for '--format': 'csv' is not one of 'auto', 'nccl-log', 'kineto', 'chakra', 'nccl-tests'."),
    (["explain"], "error: missing option '--plan'."),
    (["validate"], "error: missing argument 'CAPTURE'."),
    (["validate", "x.pcap", "--max-violations", "-2"],
     "error: invalid value for '--max-violations': -2 is not in the range x>=0."),
    (["summarize", "x.pcap", "--by", "rack"],
     "error: invalid value for '--by': 'rack' is not one of 'nic', 'node', 'parallelism', 'phase'."),
    (["plot", "x.pcap"], "error: missing option '-o' / '--output'."),
    (["replay", "x.pcap", "--speed", "fast"], "error: invalid value for '--speed': 'fast' is not a valid float."),
    (["frobnicate"], "error: no such command 'frobnicate'."),
    (["--bogus"], "error: no such option '--bogus'."),
])
def test_usage_errors_are_one_line_exit_2_and_write_nothing(tmp_path, args, line):
    args = [a.replace("{out}", str(tmp_path / "out.pcap")) for a in args]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2
    assert r.stderr == line + "\n"
    assert r.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_usage_error_of_the_installed_command_is_one_line(tmp_path):
    """The console script (a real process, real stderr) prints click's errors as one line too."""
    proc = run_cli("generate", "--plan", PLAN, "-o", tmp_path / "x.pcap", "--snaplen", "abc")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: invalid value for '--snaplen': 'abc' is not a valid integer range.\n"
    assert list(tmp_path.iterdir()) == []


def test_help_and_version_still_exit_0_and_bare_wiretrace_prints_help():
    r = CliRunner().invoke(main, ["generate", "--help"], prog_name="wiretrace")
    assert r.exit_code == 0 and r.stdout.startswith("Usage: wiretrace generate [OPTIONS]") and r.stderr == ""
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith("wiretrace, version")
    r = CliRunner().invoke(main, [], prog_name="wiretrace")
    assert r.exit_code == 2 and r.stderr.startswith("Usage: wiretrace [OPTIONS] COMMAND [ARGS]...")


@pytest.mark.parametrize("fmt,magic", [("PCAPNG", "0a0d0d0a"), ("Pcap", "4d3cb2a1")])
def test_format_is_case_insensitive(tmp_path, fmt, magic):
    out = tmp_path / "x.cap"
    r = CliRunner().invoke(main, ["generate", "--plan", PLAN, "-o", str(out), "--format", fmt,
                                  "--window", "0:1ms", "--no-parquet", "--quiet"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4].hex() == magic


def test_generate_help_states_outputs_and_units_and_they_hold(tmp_path):
    """What `generate --help` says about output names, units, directories and formats is what
    generate does."""
    text = " ".join(CliRunner().invoke(main, ["generate", "--help"]).stdout.split())
    for claim in ("a directory with --split nic", "Missing parent directories are created",
                  "named after it (node0-mlx5_1.pcap; with rotation node0-mlx5_1.pcap1, ...)",
                  "like tcpdump -C: out.pcap, out.pcap1, out.pcap2",
                  "KB/MB/GB (powers of 1000: 100MB = 100,000,000) or KiB/MiB/GiB (powers of 1024)",
                  "default: from the suffix of -o, else pcap", "ERF type 21 records"):
        assert claim in text, claim
    from wiretrace.plan import parse_size

    assert (parse_size("100MB"), parse_size("1KB"), parse_size("1KiB"), parse_size("2MiB")) == \
        (100_000_000, 1000, 1024, 2 * 1024 * 1024)
    out = tmp_path / "not" / "yet" / "nics"
    r = CliRunner().invoke(main, ["generate", "--plan", PLAN, "-o", str(out), "--split", "nic",
                                  "--max-file-size", "20KB", "--window", "5.3ms:5.4ms", "--no-parquet", "-q"])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in out.iterdir())
    assert names[:3] == ["node0-mlx5_0.pcap", "node0-mlx5_0.pcap1", "node0-mlx5_1.pcap"]
    assert {n.split(".")[0] for n in names} == {f"node{n}-mlx5_{k}" for n in range(2) for k in range(4)}
    assert max(p.stat().st_size for p in out.iterdir()) <= 20_000


def test_format_against_the_suffix_is_noted_and_the_validate_headline_is_one_line(tmp_path):
    """``--format pcap -o x.pcapng`` writes pcap (magic a1b23c4d, nanosecond) and says so in one
    note; validate's headline stays one line on a narrow terminal or a pipe (greppable)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "x.pcapng"
    p = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", out, "--format", "pcap",
                "--window", "5ms:6ms", "--no-parquet", "-q", check=True)
    assert p.stderr.strip().splitlines() == [
        "note: x.pcapng holds pcap records (--format), not what its .pcapng suffix suggests"]
    assert out.read_bytes()[:4] == bytes.fromhex("4d3cb2a1")
    p = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "y.pcapng",
                "--window", "5ms:6ms", "--no-parquet", "-q", check=True)
    assert p.stderr == ""
    p = run_cli("generate", "--plan", SAMPLES / "gpt2-small-2x4.json", "-o", tmp_path / "z.txt",
                "--window", "5ms:6ms", "--no-parquet", "-q", check=True)
    assert p.stderr.splitlines() == ["note: z.txt: no .pcap, .pcapng or .erf suffix; writing pcap (choose with --format)"]
    assert (tmp_path / "z.txt").read_bytes()[:4] == bytes.fromhex("4d3cb2a1")
    env = dict(os.environ, COLUMNS="60")
    v = subprocess.run([sys.executable, "-m", "wiretrace.cli", "validate", str(out)], capture_output=True,
                       text=True, env=env)
    assert v.returncode == 0
    head = v.stdout.splitlines()[0]
    assert head.startswith(f"{out} (pcap-ns): ") and head.endswith("QP streams: clean"), head
