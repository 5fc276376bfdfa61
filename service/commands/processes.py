"""The commands that run the service itself: `serve` (the HTTP API and, unless --api-only,
the worker pool), `worker` (the pool alone) and `migrate`, which brings their database's
schema to a revision. Each starts from `startup.load_config` and `startup.database`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from service.commands.exits import Exit
from service.commands.startup import COMMAND_LOGGER, database, load_config, settle_heap
from service.db.migrate import migrate_database
from service.errors import ConfigError, ListenError

log = logging.getLogger(COMMAND_LOGGER)


def cmd_serve(args: argparse.Namespace) -> int:
    """`sweeper serve`: the address bound first, then the database (migrated when
    SWEEPER_MIGRATE_ON_START is on), then the app served until stopped."""
    from service.app import create_app
    from service.http.serving import GracefulServer, listening_socket, server_config

    settings, policies = load_config()
    host = args.host or settings.host
    port = settings.port if args.port is None else args.port
    # bound before the database starts: a port in use is refused at once, with exit 4
    sock = listening_socket(host, port)
    try:
        with database(settings) as url:
            if settings.migrate_on_start:
                asyncio.run(migrate_database(url, settings))
            app = create_app(settings, policies, url, run_workers=not args.api_only)
            settle_heap()
            log.info("serving", extra={"host": host, "port": sock.getsockname()[1],
                                       "workers": 0 if args.api_only else settings.workers,
                                       "tls": settings.tls_cert_file is not None})
            GracefulServer(server_config(app, settings, host=host, port=port)).run(
                sockets=[sock])
    finally:
        sock.close()
    return Exit.OK


def cmd_worker(_args: argparse.Namespace) -> int:
    """`sweeper worker`."""
    from service.worker import run_worker_process
    from service.worker.health import WorkerHealth, serve_probes

    settings, policies = load_config()
    if settings.workers < 1:
        raise ConfigError("SWEEPER_WORKERS: must be at least 1 for `sweeper worker`")
    health = WorkerHealth(time.monotonic)
    if settings.metrics_port:
        # /healthz, /readyz and the process registry over plain HTTP from a daemon thread
        # (service/worker/health.py): counters and histograms only; the API replicas report
        # the ledger gauges.
        try:
            serve_probes(health, settings.host, settings.metrics_port)
        except OSError as exc:
            raise ListenError(f"SWEEPER_METRICS_PORT: cannot listen on {settings.host}:"
                              f"{settings.metrics_port}: {exc.strerror}") from None
    with database(settings) as url:
        if settings.migrate_on_start:
            asyncio.run(migrate_database(url, settings))
        settle_heap()
        asyncio.run(run_worker_process(settings, policies, url, health=health))
    return Exit.OK


def cmd_migrate(args: argparse.Namespace) -> int:
    """`sweeper migrate --revision REV`."""
    settings, _ = load_config()
    with database(settings) as url:
        asyncio.run(migrate_database(url, settings, args.revision))
    print(f"schema at {args.revision}")
    return 0
