"""How a `sweeper` command ends: its exit code, one per kind of outcome, so scripts can tell
a refused configuration from an unreachable database or a run that left items dead; and the
one line per problem or warning it prints on stderr, never a traceback. README.md
(Commands) lists the codes; keep the two in step."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    # `run --follow`: the run drained with dead items; `openapi --check`: the file is stale;
    # `drill`: a drill failed; `credentials rotate-key`: a row no key opens; `evidence
    # verify`: the export is not what was signed
    INCOMPLETE = 1
    CONFIG = 2  # a setting, option value or the policies file refused
    DATABASE = 3  # PostgreSQL unreachable (or the embedded one did not start)
    LISTEN = 4  # an address that cannot be listened on: in use, not on this host, no right
    SERVER = 5  # `run`: the server could not be reached or refused the request
    RUN_FAILED = 6  # `run --follow`: the run itself failed (publication gave up)
    USAGE = 64  # the command line itself: unknown option, missing argument (sysexits)
    # Ctrl-C before the command finished; a server (serve, worker, local) asked to stop by
    # Ctrl-C or SIGTERM drains and exits OK: stopping is what it was asked to do
    INTERRUPTED = 130


def report_problems(problems: Iterable[str]) -> None:
    """One line per configuration problem, on stderr."""
    for problem in problems:
        print(f"sweeper: configuration error: {problem}", file=sys.stderr)


def report_warnings(warnings: Iterable[str]) -> None:
    """One line per warning (a mistake that does not stop the command), on stderr."""
    for warning in warnings:
        print(f"sweeper: warning: {warning}", file=sys.stderr)
