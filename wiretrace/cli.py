"""The ``wiretrace`` command: thin wiring of the stages (click).

Each subcommand parses its options, calls stage functions, reports progress on stderr and writes
files atomically (temporary file + rename). Every :class:`~wiretrace.errors.WiretraceError`, and
every usage error click finds (a bad or missing option), becomes one line ``error: ...`` on stderr
and exit status 2.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
import warnings
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
        except OSError as e:
            # a full disk or quota while writing (the outputs were staged and are removed)
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
                raise
            if e.filename == "standard output":
                fail(f"cannot write standard output: {os.strerror(e.errno)}; the capture it received is "
                     "incomplete")
            where = f" {e.filename}" if e.filename else ""
            fail(f"cannot write{where}: {os.strerror(e.errno)}; outputs not written")

    return wrapper


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A Python warning (a capture cut off inside its last record, ...) as one ``warning:`` line
    on stderr, without the source location and code line Python adds."""
    click.echo(f"warning: {message}", err=True)


def usage_error_line(e: click.ClickException) -> str:
    """A click error (bad option value, missing option, unknown command ...) as the one line
    ``error: ...`` that every wiretrace error is: click's own message, which names the option
    and what it expected, without the usage block and the ``--help`` hint."""
    text = " ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
    if text[:2].istitle():              # "Invalid value ..." -> "invalid value ...", not "IP ..."
        text = text[0].lower() + text[1:]
    return f"error: {text}"


class WiretraceGroup(click.Group):
    """The ``wiretrace`` group: click's usage errors become one line on stderr, exit status 2.

    click prints a usage error as three lines (usage, a ``--help`` hint, the error); wiretrace
    runs click with ``standalone_mode=False`` and prints the error itself. Everything else stays
    as click does it in standalone mode: ``--help`` and ``--version`` exit 0, bare ``wiretrace``
    prints the help (exit 2). SIGTERM and Ctrl-C unwind through the cleanup and then print one
    line ``wiretrace: terminated by signal 15; temporary outputs removed`` (``interrupted`` for
    Ctrl-C), exit 128 + signal (143, 130).
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Run the command line; see the class docstring for how errors are reported."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        warnings.showwarning = _warning_line
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:   # bare `wiretrace`: the help
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:          # UsageError, BadParameter, FileError ...
            click.echo(usage_error_line(e), err=True)
            sys.exit(2)
        except Terminated as e:                   # cleanup has run on the way out
            what = "interrupted" if e.signum == signal.SIGINT else f"terminated by signal {e.signum}"
            pipeline = sys.modules.get(f"{__package__}.pipeline")
            if pipeline is not None and pipeline.COMMITTED:
                click.echo(f"wiretrace: {what} after its outputs were written; they are complete and kept",
                           err=True)
            else:
                click.echo(f"wiretrace: {what}; temporary outputs removed", err=True)
            sys.exit(e.code)
        except (click.exceptions.Abort, KeyboardInterrupt, EOFError):
            _ignore_signals()
            click.echo("wiretrace: interrupted; temporary outputs removed", err=True)
            sys.exit(128 + signal.SIGINT)
        # the work is done: a signal from here on must not turn a finished run into a killed one
        _ignore_signals()
        sys.exit(rv if isinstance(rv, int) else 0)


def check_output_free(path: Path, force: bool) -> None:
    """Raise WiretraceError when ``path`` exists and ``--force`` was not given, or is a device,
    named pipe or socket (never replaced)."""
    from .pipeline import refuse_special

    refuse_special(path)
    if path.exists() and not force:
        raise WiretraceError(f"{path} exists; pass --force to overwrite it")


@click.group(cls=WiretraceGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="wiretrace")
def main() -> None:
    """What one iteration of distributed LLM training puts on the wire.

    wiretrace computes the collective schedule of a training plan (or reads a measured one),
    lowers it through NCCL-style collective algorithms to point-to-point RDMA messages, and
    renders those as RoCEv2 / InfiniBand packets in pcap, pcapng or ERF captures plus Parquet
    tables. Start with `wiretrace generate --plan plan.json -o iter.pcap`.
    """
    # SIGTERM (kill, a batch scheduler's time limit) and Ctrl-C unwind, so that temporary
    # outputs are removed and nothing partial is left behind; the exit status is 128 + signal.
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)


class Terminated(SystemExit):
    """Raised by the SIGTERM/SIGINT handler; its ``code`` is 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def _ignore_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _terminate(signum, frame):
    """Unwind (temporary outputs are removed on the way) and exit 128 + signal, as a shell
    reports a process killed by that signal. Further SIGTERM/SIGINT are ignored from here on:
    ``timeout`` and process-group kills deliver the signal twice, and a second unwinding would
    cut the cleanup of the first short."""
    _ignore_signals()
    raise Terminated(signum)


# ---------------------------------------------------------------------------------------------
# generate / schedule (pipeline)
# ---------------------------------------------------------------------------------------------


class _Progress:
    """A rich progress bar on stderr (a terminal) that appears only once a run has taken more than
    a second."""

    def __init__(self, quiet: bool):
        import time

        # a bar only on a terminal: redirected stderr (logs, CI) gets no control characters
        self.quiet = quiet or not sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.bar = None
        self.tasks: dict[str, int] = {}

    def __call__(self, stage: str, done: int, total: int | None = None) -> None:
        import time

        if self.quiet:
            return
        if self.bar is None:
            if time.monotonic() - self.t0 < 1.0:
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _fmt_bytes(n: float) -> str:
    from .pipeline import human_bytes

    return human_bytes(n)


@main.command()
@click.option("--plan", "plan_path", required=True, type=click.Path(path_type=Path),
              help="Plan JSON (schemas/plan.schema.json). With --schedule only its cluster, "
                   "collectives and transport sections are used.")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Capture to write (a directory with --split nic); its suffix chooses the format "
                   "(.pcap, .pcapng, .erf). Missing parent directories are created. '-' streams the "
                   "capture to standard output (pcap unless --format; tables only with --parquet; "
                   "the summary goes to standard error), e.g. -o - | tshark -r - or wireshark -k -i -.")
@click.option("--schedule", "schedule_path", type=click.Path(path_type=Path),
              help="Use a measured schedule instead of the plan's workload: a directory or "
                   "collectives.parquet from `wiretrace schedule`, or an NCCL log / profiler trace / "
                   "Chakra trace / nccl-tests output.")
@click.option("--parquet", "parquet_dir", type=click.Path(path_type=Path),
              help="Directory for collectives/messages/packets.parquet [default: <output stem>.parquet "
                   "beside the capture].")
@click.option("--no-parquet", is_flag=True, help="Write only the capture.")
@click.option("--format", "fmt", type=click.Choice(["pcap", "pcapng", "erf"], case_sensitive=False),
              help="Capture format, any case [default: from the suffix of -o, else pcap]. Native "
                   "InfiniBand (transport kind ib) goes into ERF type 21 records, in an .erf file or "
                   "inside pcap/pcapng (link type 197), as ibdump writes IB ports.")
@click.option("--snaplen", type=click.IntRange(min=0, max=262144), default=128, show_default=True,
              help="Bytes kept of each frame, up to 262144 (the largest Wireshark and tcpdump accept); 0 "
                   "keeps whole frames (deterministic payload bytes). The original frame length is always "
                   "recorded. At 128 every header is kept and no payload: Wireshark then shows "
                   "'Invalid Packet Length from LRH! [Malformed Packet]' in the Info column, as for any "
                   "capture cut short (an Info text, not an error).")
@click.option("--split", type=click.Choice(["nic"]),
              help="nic: -o is a directory that receives one capture per sending NIC, named after "
                   "it (node0-mlx5_1.pcap; with rotation node0-mlx5_1.pcap1, ...).")
@click.option("--max-file-size", type=str, metavar="SIZE",
              help="Rotate the capture before a file would pass this size, like tcpdump -C: out.pcap, "
                   "out.pcap1, out.pcap2, ... Bytes, or KB/MB/GB (powers of 1000: 100MB = 100,000,000) "
                   "or KiB/MiB/GiB (powers of 1024). At least the file header plus one record of the "
                   "largest frame (pcap at the default snap length: 24 + 16 + 128 = 168 bytes); a "
                   "smaller size is refused.")
@click.option("--max-packets", type=click.IntRange(min=1), default=50_000_000, show_default=True,
              help="Refuse runs whose estimated packet count is larger (narrow the scope instead).")
@click.option("--ranks", help="Keep traffic sent or received by these global ranks, e.g. 0-7,16.")
@click.option("--parallelism", help="Keep these parallelisms only, e.g. dp,pp (dp tp sp pp cp ep other).")
@click.option("--window", help="Keep packets with START <= ts < END, ns from iteration start "
              "(units allowed: 0:5ms).")
@click.option("--force", is_flag=True, help="Overwrite existing outputs.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
@handle_errors
def generate(plan_path, output, schedule_path, parquet_dir, no_parquet, fmt, snaplen, split,
             max_file_size, max_packets, ranks, parallelism, window, force, quiet):
    """Generate the packets of one training iteration: plan -> capture + Parquet tables.

    \b
    Example:
      wiretrace generate --plan samples/plans/gpt2-small-2x4.json -o out/iter.pcap
    Open out/iter.pcap in Wireshark; RoCEv2 decodes on UDP port 4791. Filters such as
    infiniband.bth.opcode == 9 (the last packet of each data message), infiniband.bth.destqp,
    infiniband.reth.dmalen.

    Timestamps are the time since the iteration start, counted from 1970-01-01 00:00:00 UTC
    (Wireshark shows 1970-01-01 00:00:00.005374664 for 5.374664 ms). NIC k of node n has MAC
    02:00:00:NH:NL:kk, IPv4 10.<rail>.0.0 + n + 1, IPv6 fd00::<rail>:0:<n+1>, LID
    n * nics_per_node + k + 1. What goes on the wire (verb, ACK policy, path MTU, IPv4/IPv6,
    VLAN and PCP, DSCP and ECN, ECN marking, native IB) is set in the plan's transport section
    (README "The plan", schemas/plan.schema.json); the options here choose what is written.
    """
    from . import pipeline
    from .plan import load, parse_size

    plan = load(plan_path, require_model=schedule_path is None)
    sel = pipeline.Selection(ranks=pipeline.parse_ranks(ranks),
                             parallelism=pipeline.parse_parallelism(parallelism),
                             window=pipeline.parse_window(window))
    mfs = parse_size(max_file_size, "--max-file-size") if max_file_size else None
    if schedule_path is not None and not Path(schedule_path).exists():
        raise WiretraceError(f"--schedule: {schedule_path}: no such file or directory")
    to_stdout = str(output) == "-"
    if to_stdout and sys.stdout.isatty():
        raise WiretraceError("-o -: standard output is a terminal; pipe the capture into a program "
                             "(| tshark -r -) or redirect it to a file")
    if to_stdout and parquet_dir is None:
        no_parquet = True
    if parquet_dir is not None and str(parquet_dir) == "-":
        raise WiretraceError("--parquet -: the tables are files in a directory; only the capture (-o -) "
                             "streams to standard output")
    if parquet_dir is not None and no_parquet:
        raise WiretraceError("--parquet and --no-parquet: give one or the other")
    bar = _Progress(quiet)
    try:
        s = pipeline.run_generate(plan, output, parquet_dir=parquet_dir, write_parquet=not no_parquet,
                                  schedule=schedule_path, snaplen=snaplen, fmt=fmt, split=split,
                                  max_file_size=mfs, max_packets=max_packets, selection=sel,
                                  force=force, progress=bar)
    except BrokenPipeError:
        if not to_stdout:
            raise
        # the reader went away (| tshark -c 10): say so once, no traceback, 128 + SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        bar.close()
        click.echo("wiretrace: standard output was closed by its reader; the capture it received is "
                   "incomplete", err=True)
        sys.exit(128 + signal.SIGPIPE)
    finally:
        bar.close()
    for note in s.notes:
        click.echo(f"note: {note}", err=True)
    if quiet:
        return
    echo = functools.partial(click.echo, err=to_stdout)     # the capture owns standard output
    echo(f"plan           {plan.name}")
    echo(f"collectives    {s.collectives:,}")
    echo(f"messages       {s.messages:,} ({s.network_messages:,} network, {s.nvlink_messages:,} NVLink)")
    echo(f"packets        {s.packets:,}")
    if s.ce_marked >= 0:
        echo(f"ecn            {s.ce_marked:,} data packets marked CE, {s.cnps:,} CNPs")
    echo(f"network bytes  {_fmt_bytes(s.network_bytes)} payload, {_fmt_bytes(s.wire_bytes)} in frames")
    if s.iteration_ns:
        echo(f"iteration      {s.iteration_ns / 1e6:,.3f} ms estimated (compute + exposed communication)")
    if s.messages:
        echo(f"last message   {s.last_message_ns / 1e6:,.3f} ms after iteration start (timed with NCCL step "
             f"dependencies and link sharing" + ("; the estimate above is analytical)" if s.iteration_ns else ")"))
    else:
        echo("last message   none: nothing was selected (check --ranks, --parallelism, --window)")
    captures = s.outputs[:-1] if not no_parquet else s.outputs
    shown = "standard output" if to_stdout else captures[0]
    echo(f"capture        {shown}" + (f" (+{len(captures) - 1} rotated files)" if len(captures) > 1 else ""))
    if not no_parquet:
        echo(f"parquet        {s.outputs[-1]}")


def _print_busbw_check(rows: list[dict]) -> None:
    """nccl-tests rows: the reported busbw against S/time x the factor of wiretrace's lowering."""
    from .pipeline import lowered_bus_factor

    rows = [r for r in rows if r.get("n", -1) and r.get("n", -1) > 0 and r.get("time_us")]
    if not rows:
        return
    click.echo("busbw check (predicted = size / time x bytes the busiest rank sends in wiretrace's "
               "lowering / size):")
    click.echo(f"  {'op':<15}{'ranks':>6}{'size (B)':>14}{'time (us)':>11}{'busbw':>9}{'factor':>9}"
               f"{'predicted':>11}{'diff':>8}")
    factors: dict = {}
    for r in rows:
        key = (r["op"], r["n"], r["size"])
        if key not in factors:
            factors[key] = lowered_bus_factor(r["op"], r["n"], r["size"])
        f = factors[key]
        pred = r["size"] / (r["time_us"] * 1e3) * f
        click.echo(f"  {r['op']:<15}{r['n']:>6}{r['size']:>14,}{r['time_us']:>11.1f}{r['busbw']:>9.2f}"
                   f"{f:>9.4f}{pred:>11.2f}{r['busbw'] - pred:>+8.2f}")


@main.command()
@click.option("--plan", "plan_path", type=click.Path(path_type=Path),
              help="Plan JSON: compute the analytical schedule of one iteration.")
@click.option("--from", "from_paths", multiple=True, type=click.Path(path_type=Path),
              help="Measured schedule file(s): NCCL debug log, PyTorch profiler trace, Chakra trace "
                   "or nccl-tests output (repeat --from, or list several after it).")
@click.argument("more", nargs=-1, type=click.Path(path_type=Path))
@click.option("--format", "fmt", default="auto", show_default=True,
              type=click.Choice(["auto", "nccl-log", "kineto", "chakra", "nccl-tests"], case_sensitive=False),
              help="Format of the --from files.")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Directory to write collectives.parquet (and messages.parquet with --plan).")
@click.option("--messages/--no-messages", default=True, show_default=True,
              help="With --plan, also lower the schedule to messages.parquet.")
@click.option("--force", is_flag=True, help="Overwrite an existing output directory.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@handle_errors
def schedule(plan_path, from_paths, more, fmt, output, messages, force, quiet):
    """Write the collective schedule (no packets): from a plan, or read from measured files.

    \b
    Examples:
      wiretrace schedule --plan samples/plans/llama3-8b-4x8.json -o sched/
      wiretrace schedule --from rank0.log rank1.log -o sched/
    """
    from . import pipeline, topology
    from .io.parquet import TableWriter, write_table
    from .plan import load

    paths = list(from_paths) + list(more)
    if bool(plan_path) == bool(paths):
        raise WiretraceError("give either --plan PLAN or --from FILE [FILE ...]")
    staging = pipeline._Staging(force)
    try:
        tmp = staging.claim(Path(output), is_dir=True, owns=pipeline.table_file)
        if plan_path:
            plan = load(plan_path)
            from . import collectives as coll_stage
            from . import workload

            coll = workload.build_collectives(plan)
            topo = topology.build(plan)
            coll = coll_stage.resolve_algorithms(coll, topo, plan)
            write_table(tmp / "collectives.parquet", "collectives", coll)
            nmsg = 0
            if messages:
                with TableWriter(tmp / "messages.parquet", "messages") as w:
                    for m in pipeline.lower_and_time(coll, topo, plan, pipeline.Selection()):
                        w.write(m)
                        nmsg += len(m["msg_id"])
            staging.commit()
            if not quiet:
                ops = coll.group_by(["parallelism", "op"]).aggregate([("bytes_global", "sum"), ("op_id", "count")])
                click.echo(f"{coll.num_rows:,} collectives, {nmsg:,} messages")
                for row in sorted(ops.to_pylist(), key=lambda r: (r["parallelism"], r["op"])):
                    click.echo(f"  {row['parallelism']:<6} {row['op']:<15} {row['op_id_count']:>10,} calls "
                               f"{_fmt_bytes(row['bytes_global_sum']):>14}")
                click.echo(f"wrote {output}/collectives.parquet" + (" and messages.parquet" if messages else ""))
        else:
            from . import ingest

            got = ingest.read_schedule(paths, fmt=fmt)
            write_table(tmp / "collectives.parquet", "collectives", got.table)
            staging.commit()
            if not quiet:
                click.echo(ingest.format_report(got.report))
                _print_busbw_check(got.report.get("nccl_tests", []))
                click.echo(f"wrote {output}/collectives.parquet ({got.table.num_rows:,} collectives)")
    except BaseException:
        staging.abort()
        raise


# ---------------------------------------------------------------------------------------------
# explain (workload)
# ---------------------------------------------------------------------------------------------


@main.command()
@click.option("--plan", "plan_path", required=True, type=click.Path(path_type=Path),
              help="Training plan (JSON).")
@click.option("--corpus", type=click.Path(path_type=Path),
              help="Text file to tokenize (a BPE is trained on it at the model's vocabulary size).")
@click.option("--tokenizer", type=click.Path(path_type=Path),
              help="A Hugging Face tokenizer.json to use instead of training one.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def explain(plan_path, corpus, tokenizer, as_json):
    """The life of a token for this plan, from words to bits on the wire.

    Six sections with the plan's numbers: text -> tokens (with --corpus), tokens -> vectors, one
    transformer block (every tensor's shape and bytes), what each parallelism exchanges, what the
    collective algorithms put on NVLink and on the network, and the iteration-time estimate.
    """
    import json

    from . import plan as plan_mod
    from .explain import explain as build_report, render

    report = build_report(plan_mod.load(plan_path), corpus=corpus, tokenizer=tokenizer)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render(report)


# ---------------------------------------------------------------------------------------------
# validate (transport)
# ---------------------------------------------------------------------------------------------


@main.command()
@click.argument("capture", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (stable keys).")
@click.option("--max-violations", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Violations kept with their messages (all are counted).")
@click.option("--show", type=click.IntRange(min=0), default=50, show_default=True,
              help="Violations listed in the text report.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@handle_errors
def validate(capture, as_json, max_violations, show, quiet):
    """Check a RoCEv2 / InfiniBand capture (pcap, pcapng, ERF; ours or any other); CAPTURE '-'
    reads standard input (tcpdump -w - | wiretrace validate -), a directory (generate --split
    nic or --max-file-size) has each of its captures checked on its own, in rotation order (a
    loss at a rotation boundary is not seen; exit status 2 when one cannot be read, the others
    are still reported).

    RoCEv2 is UDP to port 4791 over Ethernet (802.1Q and QinQ tags too), Linux cooked (SLL,
    SLL2) or raw IPv4/IPv6 link types; native InfiniBand is link type 197 (ERF type 21, as
    ibdump writes) or 247. Other frames are counted and skipped.

    Per frame: IPv4 header checksum, ICRC (and VCRC for native IB), lengths and pad count. Per
    QP: PSN continuity (mod 2^24; READ requests consume one PSN per response), opcode sequences
    (FIRST, MIDDLE..., LAST or ONLY), RETH DMA length against the bytes that follow, ACK/MSN.
    Frames cut by the snap length are checked as far as their bytes go (a READ request cut
    before its DMA length leaves the next PSN of its QP unchecked).

    A capture in which nothing could be checked (no RoCE/IB frame, or every one cut by the snap
    length before its BTH or inside its link-layer header) is not clean: it gets a "nothing
    checked" violation.

    Exit status: 0 clean, 1 violations found (or nothing checked; a file whose last record is
    cut short is read up to it and reported as a "capture truncated" violation), 2 the file
    cannot be read. A closed output pipe (validate f | head) ends quietly with the same status.
    """
    import json

    from rich.console import Console

    from .transport.validate import captures_in, print_report, validate_capture

    is_dir = str(capture) != "-" and capture.is_dir()
    files = captures_in(capture) if is_dir else [capture]
    reports: list = []                      # a Report, or (path, error) for a file not read
    bar = _Progress(quiet)
    stdin_copy = None
    try:
        if str(capture) == "-":
            # a stream (tcpdump -w - | wiretrace validate -) is read whole into a temporary file,
            # since the reader moves through the capture by offsets
            import shutil
            import tempfile

            with tempfile.NamedTemporaryFile(prefix="wiretrace-stdin-", suffix=".cap", delete=False) as f:
                stdin_copy = Path(f.name)
                shutil.copyfileobj(sys.stdin.buffer, f, 1 << 20)
            files = [stdin_copy]
        for path in files:
            try:
                report = validate_capture(path, max_violations=max_violations, progress=bar)
            except WiretraceError as e:
                if is_dir:                  # the other captures of the directory still count
                    reports.append((path, str(e)))
                    continue
                if stdin_copy is None:
                    raise
                raise type(e)(str(e).replace(str(stdin_copy), "standard input")) from None
            if stdin_copy is not None:
                report.path = "standard input"
            reports.append(report)
    finally:
        bar.close()
        if stdin_copy is not None:
            stdin_copy.unlink(missing_ok=True)
    unread = [r for r in reports if isinstance(r, tuple)]
    checked = [r for r in reports if not isinstance(r, tuple)]
    status = 2 if unread else (0 if all(r.ok for r in checked) else 1)

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:          # rich would exit with status 1
            raise BrokenPipeError

    try:
        if as_json and not is_dir:
            click.echo(json.dumps(checked[0].as_dict(), indent=2))
        elif as_json:
            click.echo(json.dumps({"directory": str(capture), "ok": status == 0, "captures": [
                {"file": str(r[0]), "ok": False, "error": r[1]} if isinstance(r, tuple) else r.as_dict()
                for r in reports]}, indent=2))
        else:
            console = PipeConsole()
            for r in reports:
                if isinstance(r, tuple):
                    console.print(f"{r[0]}: not read: {r[1]}", soft_wrap=True, markup=False, highlight=False)
                else:
                    print_report(r, show=show, console=console)
            if is_dir:
                bad = [Path(r.path).name for r in checked if not r.ok]
                n = len(reports)
                line = f"{capture}: {n} capture{'s' if n != 1 else ''}, {n - len(bad) - len(unread)} clean"
                if bad:
                    line += f", {len(bad)} not ({', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''})"
                if unread:
                    line += f", {len(unread)} not read ({', '.join(Path(p).name for p, _ in unread[:5])})"
                console.print(line, soft_wrap=True, markup=False, highlight=False)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (| head): no traceback, and no second error when Python flushes
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(status)



# ---------------------------------------------------------------------------------------------
# summarize / plot / replay (analysis)
# ---------------------------------------------------------------------------------------------


def _analysis_options(fn):
    """Options shared by summarize and plot."""
    fn = click.option("--timescales", default="1us,10us,100us,1ms,10ms", show_default=True,
                      help="Burstiness window widths, comma-separated durations.")(fn)
    fn = click.option("--idle-gap", default="1us", show_default=True,
                      help="Idle time that ends a burst (on/off periods).")(fn)
    fn = click.option("--line-rate", help="Line rate for utilization, e.g. 400Gbps [default: the plan's nic_rate].")(fn)
    fn = click.option("--plan", "plan_path", type=click.Path(path_type=Path, dir_okay=False),
                      help="Plan the input was generated from: names NICs by address, maps them to "
                           "nodes, gives the line rate.")(fn)
    return fn


def _plan_beside(input_path: Path, plan_path):
    """``--plan`` as given; else, for a capture ``X.pcap`` that ``generate`` wrote, the
    ``X.parquet/plan.json`` beside it (said on stderr)."""
    if plan_path is not None or Path(input_path).is_dir():
        return plan_path
    p = Path(input_path)
    beside = p.with_name(p.stem + ".parquet") / "plan.json"
    if beside.is_file():
        click.echo(f"note: using the plan {beside} (give --plan to choose another)", err=True)
        return beside
    return None


def _analysis_kwargs(plan_path, line_rate, idle_gap, timescales) -> dict:
    from .analysis.burstiness import parse_timescales
    from .plan import load, parse_duration_ns, parse_rate

    return {
        "timescales_ns": parse_timescales(timescales, "--timescales"),
        "idle_gap_ns": parse_duration_ns(idle_gap, "--idle-gap"),
        "line_rate_bps": parse_rate(line_rate, "--line-rate") if line_rate else None,
        "plan": load(plan_path, require_model=False) if plan_path else None,
    }


def _warn_cut_off(path, info: dict) -> None:
    """One warning line on stderr when the capture ends inside a record."""
    n = info.get("cut_off_after_frames")
    if n is not None:
        click.echo(f"warning: {path} is cut off after {n:,} frame{'s' if n != 1 else ''}; "
                   "summarized what was complete", err=True)


@main.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (stable keys).")
@click.option("--by", type=click.Choice(["nic", "node", "parallelism", "phase"]), default="nic",
              show_default=True, help="Break traffic down by NIC, node, parallelism or phase "
                                      "(parallelism and phase need a Parquet directory).")
@click.option("--flows", "top_flows", type=int, default=20, show_default=True,
              help="Flows listed in the text output (JSON lists all).")
@_analysis_options
@handle_errors
def summarize(input_path, as_json, by, top_flows, plan_path, line_rate, idle_gap, timescales):
    """Summarize a capture (pcap, pcapng, ERF) or a wiretrace Parquet directory.

    Flows (IP pair, UDP source port, DestQP), message and flow sizes, burstiness per NIC and
    direction (peak-to-mean, CoV, index of dispersion at 1 us..10 ms; on/off periods), link
    utilization, node x node matrix, opcode mix, ACK/CNP counts and ECN marks. Memory stays
    bounded whatever the capture size.

    \b
    Examples:
      wiretrace summarize out/iter.pcap --plan samples/plans/gpt2-small-2x4.json
      wiretrace summarize out/iter.parquet --by phase --line-rate 400Gbps
      wiretrace summarize capture.pcapng --json > summary.json
    """
    from .analysis import summarize as run
    from .analysis.report import print_text, to_json

    if top_flows < 0:
        raise WiretraceError(f"--flows {top_flows}: expected 0 or more flows to list")
    plan_path = _plan_beside(input_path, plan_path)
    doc = run(input_path, by=by, **_analysis_kwargs(plan_path, line_rate, idle_gap, timescales))
    _warn_cut_off(input_path, doc["input"])
    if as_json:
        click.echo(to_json(doc))
    else:
        print_text(doc, top_flows=top_flows)


@main.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Directory for the figures (PNG and SVG of each).")
@click.option("--html", "html_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Also write one self-contained HTML page with the figures and summary tables.")
@click.option("--force", is_flag=True, help="Overwrite existing figures / page.")
@_analysis_options
@handle_errors
def plot(input_path, out_dir, html_path, force, plan_path, line_rate, idle_gap, timescales):
    """Draw figures of a capture or a wiretrace Parquet directory.

    Throughput per NIC over time (phases shaded when known), node x node traffic matrix,
    flow- and message-size CDFs and a burst raster, as PNG and SVG in DIR.

    \b
    Example:
      wiretrace plot out/iter.parquet --plan samples/plans/gpt2-small-2x4.json -o out/figs --html out/report.html
    """
    from .analysis import analyze
    from .analysis.figures import write_all
    from .analysis.report import html_page

    kwargs = _analysis_kwargs(_plan_beside(input_path, plan_path), line_rate, idle_gap, timescales)
    if out_dir.exists() and not out_dir.is_dir():
        raise WiretraceError(f"-o {out_dir}: is a file; expected a directory for the figures")
    if html_path is not None:
        check_output_free(html_path, force)
        parent = html_path.resolve().parent
        if not parent.is_dir() and parent != out_dir.resolve():     # -o DIR is created below
            raise WiretraceError(f"--html {html_path}: directory {parent} does not exist")
    s, inp = analyze(input_path, **kwargs)
    _warn_cut_off(input_path, inp.info)
    figs = write_all(s, out_dir, phase_spans=inp.phase_spans() if inp.phase_spans else None, force=force)
    for _, png, svg in figs:
        click.echo(f"wrote {png} and {svg.name}")
    if html_path is not None:
        doc = {"input": {"path": str(input_path), "kind": inp.kind, **inp.info}, **s.result()}
        tmp = html_path.with_name(f".{html_path.name}.tmp")
        tmp.write_text(html_page(doc, [(cap, png) for cap, png, _ in figs]), encoding="utf-8")
        os.replace(tmp, html_path)
        click.echo(f"wrote {html_path}")


@main.command()
@click.argument("capture", type=click.Path(path_type=Path))
@click.option("--iface", help="Send the frames on this Linux interface (AF_PACKET raw socket; root or CAP_NET_RAW).")
@click.option("--udp", metavar="HOST:PORT", help="Send each frame's RoCE part (BTH through ICRC) as a UDP datagram.")
@click.option("--speed", type=float, default=1.0, show_default=True, help="Multiplier of the recorded timing.")
@click.option("--pps", type=float, help="Frames per second instead of the recorded timing.")
@click.option("--mbps", type=float, help="Megabits per second (10^6 bit/s) instead of the recorded timing.")
@click.option("--topspeed", is_flag=True, help="Send as fast as possible.")
@click.option("--loop", type=int, default=1, show_default=True, help="Passes over the capture.")
@click.option("--engine", type=click.Choice(["native", "tcpreplay"]), default="native", show_default=True,
              help="tcpreplay: hand an interface replay to tcpreplay.")
@click.option("--rt-priority", type=int, help="Run the sender under SCHED_FIFO at this priority (1-99; "
                                             "root or CAP_SYS_NICE) for precise timing on a busy host.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def replay(capture, iface, udp, speed, pps, mbps, topspeed, loop, engine, rt_priority, as_json):
    """Replay CAPTURE on an interface (--iface) or to a UDP socket (--udp), keeping its timing.

    Truncated RoCE/IB frames are completed to their original length with wiretrace's payload
    pattern and a recomputed ICRC (as `generate --snaplen 0` writes them). Reports packets, bytes,
    the achieved rate and the timing error.

    \b
    Examples:
      wiretrace replay out/iter.pcap --iface veth0 --pps 10000
      wiretrace replay out/iter.pcap --iface eth1 --speed 0.5 --loop 3
      wiretrace replay out/iter.pcap --udp 127.0.0.1:4791 --topspeed
    """
    import json

    from .analysis.report import fmt_ns, fmt_rate
    from .replay import replay as run

    rep = run(capture, iface=iface, udp=udp, speed=speed, pps=pps, mbps=mbps, topspeed=topspeed,
              loop=loop, engine=engine, rt_priority=rt_priority)
    if as_json:
        click.echo(json.dumps(rep.as_dict(), indent=2))
        return
    pps_txt = f"{rep.achieved_pps:,.0f} pps" if rep.achieved_pps else "-"
    click.echo(f"sent {rep.packets:,} packets, {rep.bytes:,} bytes to {rep.target} in {fmt_ns(rep.duration_ns)} "
               f"({rep.loops} loop{'s' if rep.loops != 1 else ''}, {rep.engine})")
    click.echo(f"achieved       {pps_txt}, {fmt_rate(rep.achieved_bps)}")
    if rep.timing_error_mean_ns is not None:
        click.echo(f"timing error   mean {fmt_ns(rep.timing_error_mean_ns)}, p99 {fmt_ns(rep.timing_error_p99_ns)}, "
                   f"max {fmt_ns(rep.timing_error_max_ns)}")
    elif topspeed:
        click.echo("timing error   n/a (--topspeed sends without a schedule)")
    if rep.padded:
        click.echo(f"completed      {rep.padded:,} truncated frames to their original length (payload "
                   f"pattern, ICRC recomputed)")
    if rep.zero_padded:
        click.echo(f"zero-padded    {rep.zero_padded:,} truncated frames that are not RoCE or lack headers "
                   f"(their ICRC is wrong)")
    if rep.skipped:
        click.echo(f"skipped        {rep.skipped:,} frames without a BTH")


if __name__ == "__main__":  # pragma: no cover
    main()
