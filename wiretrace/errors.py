"""Errors that the command line turns into one line on stderr and exit status 2."""


class WiretraceError(Exception):
    """A problem with the user's input (plan, schedule, capture, option).

    The message is one line that names the field, file or line at fault and what was expected.
    The CLI prints it as ``error: <message>`` and exits with status 2.
    """


class PlanError(WiretraceError):
    """The plan file is invalid (schema) or inconsistent (numbers that disagree)."""


class InputFormatError(WiretraceError):
    """A file cannot be read as any of the formats wiretrace knows."""
