"""The `sweeper` command: serve, worker, migrate, check-config, run, demo, drill, openapi.

Exit codes: 0 success, 2 configuration refused, 3 database unreachable. Expected failures
print one line to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from pydantic import ValidationError
from sqlalchemy.engine import URL

from service.db.engine import is_unavailable, make_engine
from service.errors import ConfigError, DatabaseUnavailable
from service.follow import RunFailed
from service.logs import configure_logging
from service.policies import Policies, load_policies
from service.settings import Settings, async_url, plain_url

if TYPE_CHECKING:
    from service.worker.process import Faults

log = logging.getLogger("service.cli")

PLUGIN_GROUP = "sweeper.commands"
EXIT_CONFIG = 2
EXIT_DATABASE = 3


def load_settings() -> Settings:
    """Settings from the environment, with pydantic's errors turned into one message."""
    try:
        return Settings()
    except ValidationError as exc:
        err = exc.errors(include_input=False, include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"])
        name = f"SWEEPER_{field.upper()}" if field else "settings"
        message = str(err["msg"]).removeprefix("Value error, ")
        raise ConfigError(message if not field else f"{name}: {message}") from None


def load_config() -> tuple[Settings, Policies]:
    """Settings and the policies file they name, both validated."""
    settings = load_settings()
    return settings, load_policies(settings.policies_file)


@contextmanager
def database(settings: Settings) -> Iterator[URL]:
    """The configured database URL, or an embedded server for as long as the block runs."""
    url = settings.sqlalchemy_url()
    if url is not None:
        yield url
        return
    from service.db.embedded import EmbeddedPostgres

    embedded = EmbeddedPostgres(settings.data_dir)
    try:
        yield async_url(embedded.start())
    finally:
        embedded.stop()


async def migrate_database(url: URL, settings: Settings, target: str = "head") -> None:
    """Run migrations, mapping 'cannot connect' to DatabaseUnavailable with a clear message."""
    from service.db import migrate

    engine = make_engine(url, settings)
    try:
        await migrate.upgrade(engine, target)
    except Exception as exc:
        if is_unavailable(exc):
            where = url.set(drivername="postgresql").render_as_string(hide_password=True)
            reason = str(getattr(exc, "orig", None) or exc) or type(exc).__name__
            raise DatabaseUnavailable(f"cannot reach PostgreSQL at {where}: {reason}") from None
        raise
    finally:
        await engine.dispose()


def cmd_check_config(_args: argparse.Namespace) -> int:
    settings, policies = load_config()
    print(f"ok: {len(policies.upstreams)} upstream(s), {len(policies.policies)} policy(ies), "
          f"{len(policies.webhooks)} webhook source(s) from {policies.source}; "
          f"database: {'configured' if settings.database_url else 'embedded'}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    settings, _ = load_config()
    configure_logging(settings)
    with database(settings) as url:
        asyncio.run(migrate_database(url, settings, args.revision))
    print(f"schema at {args.revision}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from service.app import create_app
    from service.serving import server_config

    settings, policies = load_config()
    configure_logging(settings)
    with database(settings) as url:
        if settings.migrate_on_start:
            asyncio.run(migrate_database(url, settings))
        app = create_app(settings, policies, url, run_workers=not args.api_only)
        host = args.host or settings.host
        port = settings.port if args.port is None else args.port
        log.info("serving", extra={"host": host, "port": port, "workers": settings.workers,
                                   "tls": settings.tls_cert_file is not None})
        server = _graceful_server_class()(server_config(app, settings, host=host, port=port))
        server.run()
    return 0


def _graceful_server_class() -> type:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown, which would kill the process
        before the embedded database is stopped; a requested shutdown is a clean exit here."""

        def capture_signals(self) -> AbstractContextManager[None]:  # type: ignore[override]
            return _signals_to(self.handle_exit)

    return GracefulServer


@contextmanager
def _signals_to(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    import signal

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def cmd_worker(_args: argparse.Namespace, faults: Faults | None = None) -> int:
    """`sweeper worker`; `faults` wraps the pool's ports (drills/agent.py)."""
    from service.worker import run_worker_process

    settings, policies = load_config()
    configure_logging(settings)
    if settings.workers < 1:
        raise ConfigError("SWEEPER_WORKERS: must be at least 1 for `sweeper worker`")
    if settings.metrics_port:
        # The process registry over plain HTTP from a daemon thread (prometheus_client's own
        # server): counters and histograms only; the API replicas report the ledger gauges.
        from prometheus_client import start_http_server

        from service.metrics import REGISTRY

        try:
            start_http_server(settings.metrics_port, addr=settings.host, registry=REGISTRY)
        except OSError as exc:
            raise ConfigError(f"SWEEPER_METRICS_PORT: cannot listen on {settings.host}:"
                              f"{settings.metrics_port} ({exc.strerror})") from None
    with database(settings) as url:
        if settings.migrate_on_start:
            asyncio.run(migrate_database(url, settings))
        asyncio.run(run_worker_process(settings, policies, url, faults=faults))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from service.follow import run_command

    body = {k: v for k, v in {"policy": args.policy, "tenant_id": args.tenant,
                              "dry_run": args.dry_run, "max_items": args.max_items}.items()
            if v not in (None, False)}
    token = args.token or os.environ.get("SWEEPER_TOKEN")
    return asyncio.run(run_command(args.url, token, body, args.idempotency_key, args.follow))


def cmd_demo(args: argparse.Namespace) -> int:
    from service.demo import run_demo

    return run_demo(args.items, args.tenants, args.workers, args.keep)


@contextmanager
def database_server(settings: Settings) -> Iterator[str]:
    """The plain postgresql:// URL of the configured database's server (or an embedded
    one), for commands that create databases of their own there (`sweeper drill`)."""
    with database(settings) as url:
        yield plain_url(url)


def add_plugin_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Commands shipped beside the service (`sweeper drill`) register through the
    `sweeper.commands` entry point group, so the service never imports them."""
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            register = entry.load()
        except ImportError as exc:  # a partial install must not take the other commands down
            print(f"sweeper: command {entry.name!r} is unavailable: {exc}", file=sys.stderr)
            continue
        register(sub)


def cmd_openapi(args: argparse.Namespace) -> int:
    from service.openapi import render_openapi

    document = render_openapi()
    out: Path = args.output
    if args.check:
        current = out.read_text(encoding="utf-8") if out.exists() else ""
        if current != document:
            print(f"{out} is out of date; run `sweeper openapi`", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(document, encoding="utf-8")
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sweeper", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the HTTP API and the worker pool")
    serve.add_argument("--host", default=None, help="bind address (default SWEEPER_HOST)")
    serve.add_argument("--port", type=int, default=None, help="port (default SWEEPER_PORT)")
    serve.add_argument("--api-only", action="store_true", help="do not start workers")
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser("worker", help="run only the worker pool (no HTTP API)")
    worker.set_defaults(func=cmd_worker)

    migrate = sub.add_parser("migrate", help="bring the database schema to a revision")
    migrate.add_argument("--revision", default="head", help="target revision (default head)")
    migrate.set_defaults(func=cmd_migrate)

    check = sub.add_parser("check-config", help="validate settings and the policies file")
    check.set_defaults(func=cmd_check_config)

    run = sub.add_parser("run", help="trigger a run on a server (and follow it)")
    run.add_argument("--url", default=os.environ.get("SWEEPER_URL", "http://127.0.0.1:8080"),
                     help="server base URL (default SWEEPER_URL or http://127.0.0.1:8080)")
    run.add_argument("--token", default=None, help="bearer token (default SWEEPER_TOKEN)")
    run.add_argument("--policy", default=None)
    run.add_argument("--tenant", default=None, help="only this tenant (rollouts)")
    run.add_argument("--dry-run", action="store_true", help="report only; release nothing")
    run.add_argument("--max-items", type=int, default=None)
    run.add_argument("--idempotency-key", default=None)
    run.add_argument("--follow", action="store_true", help="show progress until it drains")
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="run everything locally against a simulated store")
    demo.add_argument("--items", type=int, default=3000)
    demo.add_argument("--tenants", type=int, default=6)
    demo.add_argument("--workers", type=int, default=32)
    demo.add_argument("--keep", type=Path, default=None,
                      help="keep the demo database in this folder")
    demo.set_defaults(func=cmd_demo)

    add_plugin_commands(sub)

    openapi = sub.add_parser("openapi", help="write the OpenAPI document")
    openapi.add_argument("--output", type=Path, default=Path("openapi/openapi.json"))
    openapi.add_argument("--check", action="store_true", help="fail if the file is stale")
    openapi.set_defaults(func=cmd_openapi)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sweeper` console script."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; expected failures become one line and an exit code."""
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as exc:
        print(f"sweeper: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except DatabaseUnavailable as exc:
        print(f"sweeper: database unavailable: {exc}", file=sys.stderr)
        return EXIT_DATABASE
    except RunFailed as exc:
        print(f"sweeper: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
