"""The ``wiretrace`` command: thin wiring of the stages (click).

Each subcommand parses its options, calls stage functions, reports progress on stderr and writes
files atomically (temporary file + rename). Every :class:`~wiretrace.errors.WiretraceError` becomes
one line ``error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

from . import __version__
from .errors import WiretraceError


def fail(message: str) -> None:
    """Print one error line and exit with status 2."""
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def handle_errors(fn):
    """Decorator: turn WiretraceError (and unreadable files) into one line and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except WiretraceError as e:
            fail(str(e))
        except FileNotFoundError as e:
            fail(f"{e.filename}: no such file")
        except IsADirectoryError as e:
            fail(f"{e.filename}: is a directory")
        except PermissionError as e:
            fail(f"{e.filename}: permission denied")

    return wrapper


def check_output_free(path: Path, force: bool) -> None:
    """Raise WiretraceError when ``path`` exists and ``--force`` was not given."""
    if path.exists() and not force:
        raise WiretraceError(f"{path} exists; pass --force to overwrite it")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="wiretrace")
def main() -> None:
    """What one iteration of distributed LLM training puts on the wire.

    wiretrace computes the collective schedule of a training plan (or reads a measured one),
    lowers it through NCCL-style collective algorithms to point-to-point RDMA messages, and
    renders those as RoCEv2 / InfiniBand packets in pcap, pcapng or ERF captures plus Parquet
    tables. Start with `wiretrace generate --plan plan.json -o iter.pcap`.
    """


# ---------------------------------------------------------------------------------------------
# generate / schedule (pipeline)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# explain (workload)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# validate (transport)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# summarize / plot / replay (analysis)
# ---------------------------------------------------------------------------------------------


if __name__ == "__main__":  # pragma: no cover
    main()
