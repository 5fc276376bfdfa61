"""The `sweeper` command line: `build_parser` puts together one small function per
subcommand (`_add_serve`, `_add_run`, ...), each naming its options, its help and the
function that runs it; commands shipped beside the service (`sweeper drill`) join through
the `sweeper.commands` entry point group. README.md's Commands table is generated from this
parser, and a test keeps the two equal.

Importing this module loads no server: the subcommands' modules import the app, uvicorn and
the worker only when their command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path
from typing import Any, NoReturn

from service.commands.check_config import cmd_check_config
from service.commands.demo import cmd_demo
from service.commands.exits import Exit
from service.commands.local import cmd_local
from service.commands.openapi import cmd_openapi
from service.commands.processes import cmd_migrate, cmd_serve, cmd_worker
from service.commands.rotate_credentials import cmd_rotate_credentials_key
from service.commands.run_client import cmd_run
from service.commands.verify_evidence import cmd_verify_evidence

PLUGIN_GROUP = "sweeper.commands"

DESCRIPTION = ("Sweeper: scheduled, rate-limited, crash-safe deletions in other systems "
               "(through an upstream's HTTP API, or in a store's own database). `sweeper "
               "COMMAND --help` describes a command and each of its options.")
EXIT_CODES = ("Exit codes: 0 success, 1 a run left dead items (run --follow), a stale file "
              "(openapi --check), a failed drill, a stored credential no key opens "
              "(credentials rotate-key) or an export not as signed (evidence verify), 2 "
              "configuration refused, 3 database unreachable, 4 cannot listen on the address, "
              "5 the server could not be reached or refused (run), 6 the run failed (run "
              "--follow), 64 usage error, 130 interrupted (Ctrl-C; a server stopped by Ctrl-C "
              "or SIGTERM drains and exits 0).")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, its subcommands in the order `sweeper --help` lists them."""
    parser = Parser(prog="sweeper", description=DESCRIPTION, epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"sweeper {sweeper_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_serve, _add_worker, _add_migrate, _add_check_config, _add_run,
                _add_local, _add_demo, _add_credentials, _add_evidence, _add_plugin_commands,
                _add_openapi):
        add(sub)
    return parser


def _add_serve(sub: argparse._SubParsersAction[Any]) -> None:
    serve = sub.add_parser("serve", help="run the HTTP API and the worker pool (and, on the "
                                         "elected leader, run publication, holds maintenance "
                                         "and retention)",
                           description="Run the HTTP API, the run publisher and the worker "
                                       "pool (configured by SWEEPER_* variables).")
    serve.add_argument("--host", default=None,
                       help="bind address (default SWEEPER_HOST, 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=None,
                       help="port, 1-65535 (default SWEEPER_PORT, 8080)")
    serve.add_argument("--api-only", action="store_true", help="do not start workers")
    serve.set_defaults(func=cmd_serve, prints_unknown_variables=False)  # logs them


def _add_worker(sub: argparse._SubParsersAction[Any]) -> None:
    worker = sub.add_parser("worker", help="run only the worker pool (no HTTP API)",
                            description="Run only the worker pool (SWEEPER_WORKERS of them).")
    worker.set_defaults(func=cmd_worker, prints_unknown_variables=False)  # logs them


def _add_migrate(sub: argparse._SubParsersAction[Any]) -> None:
    migrate = sub.add_parser("migrate", help="bring the database schema to a revision")
    migrate.add_argument("--revision", default="head", metavar="REV", help="target revision")
    migrate.set_defaults(func=cmd_migrate, prints_unknown_variables=False)  # logs them


def _add_check_config(sub: argparse._SubParsersAction[Any]) -> None:
    check = sub.add_parser("check-config",
                           help="validate settings and the policies file (each store "
                                "statement against its store), reach the database, then exit",
                           description="List every problem of the SWEEPER_* settings and the "
                                       "policies file at once, reach the database as `serve` "
                                       "would, and warn about unknown SWEEPER_* variables; "
                                       "exit 2 if there are problems, 3 if only the database "
                                       "cannot be reached. Each store's source queries and "
                                       "target statements are checked against the store and "
                                       "shown.")
    check.add_argument("--explain", action="store_true",
                       help="show each store statement's plan (EXPLAIN; nothing is deleted)")
    check.set_defaults(func=cmd_check_config, prints_unknown_variables=False)  # lists them


def _add_run(sub: argparse._SubParsersAction[Any]) -> None:
    run = sub.add_parser("run", help="trigger a run on a server (SWEEPER_URL, SWEEPER_TOKEN); "
                                     "--follow shows a progress bar until it drains",
                         description="Trigger a run on a server; with --follow, show its "
                                     "progress and exit 0 only if it ended with no dead item "
                                     "(1: dead items, 5: server unreachable or refused, "
                                     "6: the run failed).")
    run.add_argument("--url", default=os.environ.get("SWEEPER_URL", "http://127.0.0.1:8080"),
                     help="server base URL (default SWEEPER_URL or http://127.0.0.1:8080)")
    run.add_argument("--token", default=None, help="bearer token (default SWEEPER_TOKEN)")
    run.add_argument("--policy", default=None, metavar="P",
                     help="only this policy (default: all)")
    run.add_argument("--tenant", default=None, metavar="T",
                     help="only this tenant (default: all)")
    run.add_argument("--dry-run", action="store_true",
                     help="report only: count candidates, release nothing")
    run.add_argument("--max-items", type=bounded(1, 10_000_000), default=None, metavar="N",
                     help="release at most this many items (default: every due item)")
    run.add_argument("--idempotency-key", default=None, metavar="KEY",
                     help="the trigger's Idempotency-Key: the same key gives the same run "
                          "(default: none, every call is a new run)")
    run.add_argument("--follow", action="store_true",
                     help="show progress until the run drains, and exit by how it ended")
    run.set_defaults(func=cmd_run)


def _add_local(sub: argparse._SubParsersAction[Any]) -> None:
    local = sub.add_parser("local", help="the service with a ready local configuration: an "
                                         "embedded database, a simulated store, a token and "
                                         "three commands to try",
                           description="Serve the API and workers on 127.0.0.1 with an "
                                       "embedded database, a simulated store and the policies "
                                       "of service/commands/local/policies.toml; prints a "
                                       "token and three curl commands to try.")
    local.add_argument("--port", type=port_number, default=8080, metavar="PORT",
                       help="API port")
    local.add_argument("--store-port", type=port_number, default=8081, metavar="PORT",
                       help="the simulated store's port")
    local.add_argument("--workers", type=bounded(1, 256), default=8, metavar="N",
                       help="workers")
    local.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                       help="keep the database in this folder (default: a temporary one, "
                            "removed on exit)")
    local.set_defaults(func=cmd_local)


def _add_demo(sub: argparse._SubParsersAction[Any]) -> None:
    demo = sub.add_parser("demo", help="everything locally: an embedded database, the API and "
                                       "workers, a simulated rate-limited store, a few "
                                       "thousand items drained with a progress bar")
    demo.add_argument("--items", type=bounded(1, 1_000_000), default=3000, metavar="N",
                      help="expired carts to register")
    demo.add_argument("--tenants", type=bounded(1, 10_000), default=6, metavar="N",
                      help="tenants they belong to")
    demo.add_argument("--workers", type=bounded(1, 1024), default=32, metavar="N",
                      help="workers")
    demo.add_argument("--keep", type=Path, default=None, metavar="DIR",
                      help="keep the demo database in this folder (default: a temporary one)")
    demo.set_defaults(func=cmd_demo)


def _add_credentials(sub: argparse._SubParsersAction[Any]) -> None:
    credentials = sub.add_parser(
        "credentials", help="manage tenants' stored upstream credentials",
        description="Manage the upstream credentials stored through the API (encrypted "
                    "under SWEEPER_CREDENTIALS_KEY).")
    actions = credentials.add_subparsers(dest="action", required=True, metavar="ACTION",
                                         help="what to do")
    rotate = actions.add_parser(
        "rotate-key", help="re-encrypt every stored credential under the current key",
        description="Re-encrypt every stored credential under SWEEPER_CREDENTIALS_KEY (rows "
                    "under a key of SWEEPER_CREDENTIALS_PREVIOUS_KEYS); afterwards the "
                    "previous keys may be removed. Exit 1 if a row opens under no configured "
                    "key (logged by tenant and upstream, left as it is).")
    rotate.set_defaults(func=cmd_rotate_credentials_key)


def _add_evidence(sub: argparse._SubParsersAction[Any]) -> None:
    evidence = sub.add_parser(
        "evidence", help="verify deletion evidence exports",
        description="Work with the evidence exports of GET /v1/runs/{id}/evidence and "
                    "GET /v1/evidence/log.")
    actions = evidence.add_subparsers(dest="action", required=True, metavar="ACTION",
                                      help="what to do")
    verify = actions.add_parser(
        "verify", help="verify an export offline (log chain, checkpoints, manifest)",
        description="Check an evidence export (GET /v1/runs/{id}/evidence or "
                    "/v1/evidence/log): every entry's record chains onto the one before to "
                    "the head its slice's closing checkpoint signs, every checkpoint and "
                    "the manifest verify under one of the public keys given, and, with "
                    "--checkpoints, every checkpoint kept outside the database agrees with "
                    "the log. Exit 0 verified, 1 not (the first line that fails is named), "
                    "2 a file that cannot be read.")
    verify.add_argument("file", type=Path, metavar="EXPORT", help="the export (JSON lines)")
    verify.add_argument("--public-key", type=Path, action="append", required=True,
                        metavar="KEYS",
                        help="a PEM public key, base64 keys, or the JSON of GET "
                             "/v1/evidence/public-key (repeat for more)")
    verify.add_argument("--checkpoints", type=Path, metavar="KEPT",
                        help="checkpoints kept outside the database (the JSON of GET "
                             "/v1/evidence/checkpoints): the log must agree with each")
    verify.set_defaults(func=cmd_verify_evidence, prints_unknown_variables=False)


def _add_plugin_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """Commands shipped beside the service (`sweeper drill`) register through the
    `sweeper.commands` entry point group, so the service never imports them."""
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            register = entry.load()
        except ImportError as exc:  # a partial install must not take the other commands down
            print(f"sweeper: command {entry.name!r} is unavailable: {exc}", file=sys.stderr)
            continue
        register(sub)


def _add_openapi(sub: argparse._SubParsersAction[Any]) -> None:
    openapi = sub.add_parser("openapi", help="write (or, with --check, verify) the OpenAPI "
                                             "document")
    openapi.add_argument("--output", type=Path, default=Path("openapi/openapi.json"),
                         metavar="FILE",
                         help="file to write or check")
    openapi.add_argument("--check", action="store_true",
                         help="only check the file is current; exit 1 if stale")
    openapi.set_defaults(func=cmd_openapi, prints_unknown_variables=False)


class Parser(argparse.ArgumentParser):
    """argparse with usage errors on their own exit code (64), told apart from a refused
    configuration (2), and option defaults shown in --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(Exit.USAGE, f"{self.prog}: usage error: {message}\n")


class HelpFormatter(argparse.HelpFormatter):
    """Appends an option's default to its help, unless the help already tells it: `off`
    for a flag, the value otherwise (options without one say what happens instead)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (
                None, argparse.SUPPRESS):
            return text
        if action.default is False:
            return f"{text} (default off)"
        return f"{text} (default %(default)s)"


def port_number(text: str) -> int:
    """A TCP port, 1-65535: larger numbers would wrap to another port, 0 picks any."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (1-65535)")
    return port


def bounded(low: int, high: int) -> Callable[[str], int]:
    """An integer option within [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}-{high}")
        return value
    parse.__name__ = "number"
    return parse


def sweeper_version() -> str:
    """This installation's version, or the source tree's when it was never installed."""
    try:
        return version("sweeper")
    except PackageNotFoundError:  # running from a source tree that was never installed
        from service import __version__
        return __version__
