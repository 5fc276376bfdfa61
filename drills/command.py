"""`sweeper drill NAME... [--list] [--json]`: rehearse failure drills against a deployment's
PostgreSQL server.

Each drill gets a scratch database on the server of SWEEPER_DATABASE_URL (created, migrated,
dropped afterwards: the role needs CREATEDB), its own fake upstream on loopback and its own
`sweeper worker` / `sweeper serve` processes from this installation. Real items are never
touched: the deployment's workers do not see the scratch database. One line per drill, or
a JSON document with --json; exit 1 if any drill failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from drills.base import Verdict
from drills.catalog import DRILLS, find
from drills.runner import run_drill
from drills.scratch import create_database, drop_database
from service.commands.exits import Exit


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add `sweeper drill` to the `sweeper` command (the `sweeper.commands` entry point)."""
    drill = sub.add_parser("drill", help="rehearse failure drills (scratch databases on "
                                         "the configured server)")
    drill.add_argument("names", nargs="*", metavar="NAME",
                       help="drill names or numbers, or `all` (see --list)")
    drill.add_argument("--list", action="store_true", help="describe the drills and exit")
    drill.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    drill.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                       help="keep every drill's process logs under DIR (default: only "
                            "a failed drill's logs are kept, in a temporary folder)")
    drill.set_defaults(func=cmd_drill)


def cmd_drill(args: argparse.Namespace) -> int:
    from service.commands.startup import database_server
    from service.config.settings import load_settings

    if args.list:
        return list_drills()
    names = [d.name for d in DRILLS] if args.names == ["all"] else list(args.names)
    unknown = [n for n in names if find(n) is None]
    if not names or unknown:
        print(f"sweeper drill: unknown drill(s) {unknown}; `sweeper drill --list` shows them"
              if unknown else "sweeper drill: name a drill, or `all`", file=sys.stderr)
        return Exit.USAGE
    # drills create their own databases on this server; never the configured one
    with database_server(load_settings()) as server:
        return run_drills(args, names, server)


def list_drills() -> int:
    for drill in DRILLS:
        print(drill.describe())
    return 0


async def _run(names: list[str], server_url: str, keep_logs: Path | None, quiet: bool
               ) -> list[Verdict]:
    verdicts = []
    for name in names:
        drill = find(name)
        assert drill is not None
        database = f"sweeper_drill_{uuid.uuid4().hex[:10]}"
        db_url = await create_database(server_url, database)
        try:
            verdict = await run_drill(drill, db_url, keep_logs=keep_logs)
        finally:
            await drop_database(server_url, database)
        verdicts.append(verdict)
        if not quiet:
            print(verdict.line(), flush=True)
            if verdict.status == "fail" and verdict.details():
                print("    " + verdict.details().replace("\n", "\n    "), flush=True)
    return verdicts


def run_drills(args: argparse.Namespace, names: list[str], server_url: str) -> int:
    """Run the named drills one after another; the exit code."""
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
    verdicts = asyncio.run(_run(names, server_url, args.keep_logs, quiet=args.json))
    if args.json:
        print(json.dumps([v.as_json() for v in verdicts], indent=2, default=str))
    return Exit.OK if all(v.status != "fail" for v in verdicts) else Exit.INCOMPLETE
