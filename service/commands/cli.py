"""The `sweeper` console script (and `python -m service`): the command line parsed by
`parser.build_parser`, the chosen command run, and its expected failures turned into one
line each on stderr and the exit code of exits.py, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from service.commands.exits import Exit, report_problems, report_warnings
from service.commands.parser import build_parser
from service.commands.run_client import RunFailed
from service.config.settings import unknown_variables
from service.errors import ConfigError, DatabaseUnavailable, ListenError


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sweeper` console script."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; expected failures become one line each and an exit code.
    SWEEPER_* variables nothing reads are warned about first (a misspelt one is otherwise
    ignored in silence), unless the command reads no settings or logs them itself."""
    func: Callable[[argparse.Namespace], int] = args.func
    if getattr(args, "prints_unknown_variables", True):
        report_warnings(unknown_variables(os.environ))
    try:
        return func(args)
    except ConfigError as exc:
        report_problems(exc.problems or (str(exc),))
        return Exit.CONFIG
    except DatabaseUnavailable as exc:
        print(f"sweeper: database unavailable: {exc}", file=sys.stderr)
        return Exit.DATABASE
    except ListenError as exc:
        print(f"sweeper: {exc}", file=sys.stderr)
        return Exit.LISTEN
    except RunFailed as exc:
        print(f"sweeper: {exc}", file=sys.stderr)
        return Exit.SERVER
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
