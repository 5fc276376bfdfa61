"""Wiring: a pool on a database, and the `sweeper worker` process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Callable

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget.credential_waits import Credentials
from service.config.policies import Policies
from service.config.settings import Settings, plain_url
from service.credentials import Keyring
from service.db.engine import make_engine
from service.ledger import tenant_spellings
from service.observability.metrics import POOL_WAIT, initialise_series
from service.sweeps.store_databases import Stores
from service.upstreams.deletion_api import Upstreams
from service.worker.health import WorkerHealth
from service.worker.pool import WorkerPool, worker_name
from service.worker.ports import Ports
from service.worker.postgres import database_ports
from service.worker.scope_resumption import waiting_loop

log = logging.getLogger("service.worker")

Faults = Callable[[Ports], Ports]


def database_pool(engine: AsyncEngine, policies: Policies, upstreams: Upstreams, *,
                  concurrency: int, listen_url: str | None = None,
                  grace_seconds: float = 20.0, name: str | None = None,
                  rng: random.Random | None = None, faults: Faults | None = None,
                  credentials: Credentials | None = None, stores: Stores | None = None
                  ) -> WorkerPool:
    """A pool claiming from `engine`'s ledger and calling `upstreams` with `credentials`
    (default: the policies' sources; the API's store needs the keyring). `faults` may wrap
    its ports (the drills' fault injection)."""
    name = name or worker_name()
    rng = rng or random.Random()
    if credentials is None:
        credentials = Credentials.of(policies, engine, None)
    ports = database_ports(engine, policies, upstreams, owner=name, listen_url=listen_url,
                           rng=rng, credentials=credentials, stores=stores)
    if faults is not None:
        ports = faults(ports)
    return WorkerPool(ports, policies, concurrency=concurrency, name=name,
                      grace_seconds=grace_seconds, rng=rng)


async def run_worker_process(settings: Settings, policies: Policies, url: URL, *,
                             faults: Faults | None = None,
                             health: WorkerHealth | None = None) -> None:
    """`sweeper worker`: the pool alone, until SIGTERM or SIGINT; `health` (its probes)
    watches the pool."""
    initialise_series(policies.policies)
    engine = make_engine(url, settings, pool_wait=POOL_WAIT.observe)
    upstreams = Upstreams(policies.upstreams)
    stores = Stores(policies.stores)
    credentials = Credentials.of(policies, engine, Keyring.from_settings(settings))
    pool = database_pool(engine, policies, upstreams, concurrency=settings.workers,
                         listen_url=plain_url(url),
                         grace_seconds=settings.shutdown_grace_seconds, faults=faults,
                         credentials=credentials, stores=stores)
    if health is not None:
        health.pool = pool
    # always: a scope paused before the policies file changed must resume too
    waits = asyncio.create_task(waiting_loop(engine, policies, credentials, stores),
                                name="waits")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pool.stop)
    log.info("worker started", extra={"worker": pool.name, "concurrency": settings.workers})
    try:
        # before the first claim: holds on an old tenant spelling cover its items
        await pool.run(first=lambda: tenant_spellings.reconcile(engine, policies))
    finally:
        waits.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waits
        await upstreams.aclose()
        await stores.aclose()
        await engine.dispose()
        log.info("worker stopped", extra={"worker": pool.name, "completed": pool.completed,
                                          "unwritten": pool.unwritten})
