"""The command line as documentation: every command and option explains itself."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

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
