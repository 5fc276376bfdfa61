"""Wiring a worker: a pool on a database (`database_pool`), and the `sweeper worker` process.

A pool is built from its ports (`WorkerPool(ports, ...)`), here as in the tests. The process
opens what it runs on (`open_worker_process`: the engine, the upstreams' clients, the stores,
the tenants' credentials), makes the pool's ports on it (`WorkerProcess.ports`), builds its
pool on them (`WorkerProcess.pool`) and runs it until SIGTERM or SIGINT (`WorkerProcess.run`).
`run_worker_process` is those steps with the process's own ports; the failure drills take
the same steps with those ports wrapped (drills/agent.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget.credential_waits import Credentials
from service.config.policies import Policies
from service.config.settings import Settings, plain_url
from service.credentials import Keyring
from service.db.engine import make_engine
from service.execution.ports import Broker
from service.ledger import region_pins, tenant_spellings
from service.observability.metrics import POOL_WAIT, initialise_series
from service.sweeps.store_databases import Stores
from service.upstreams.deletion_api import Upstreams
from service.worker.broker_ports import broker_ports, open_broker
from service.worker.health import WorkerHealth
from service.worker.pool import WorkerPool, worker_name
from service.worker.ports import Ports
from service.worker.postgres import database_ports
from service.worker.scope_resumption import waiting_loop

log = logging.getLogger("service.worker")


def database_pool(engine: AsyncEngine, policies: Policies, upstreams: Upstreams, *,
                  concurrency: int, listen_url: str | None = None,
                  grace_seconds: float = 20.0, name: str | None = None,
                  rng: random.Random | None = None, credentials: Credentials | None = None,
                  stores: Stores | None = None, broker: Broker | None = None,
                  prefetch: int = 16, region: str | None = None) -> WorkerPool:
    """A pool claiming `region`'s items (None: those of tenants pinned nowhere) from
    `engine`'s ledger (with `broker`: from among the items its deliveries name, `prefetch`
    messages at most in hand; the broker's region) and calling `upstreams` with
    `credentials` (default: the policies' sources; the API's store needs the keyring)."""
    name = name or worker_name()
    rng = rng or random.Random()
    if credentials is None:
        credentials = Credentials.of(policies, engine, None)
    ports = (database_ports(engine, policies, upstreams, owner=name, listen_url=listen_url,
                            rng=rng, credentials=credentials, stores=stores, region=region)
             if broker is None else
             broker_ports(engine, policies, upstreams, broker, owner=name, prefetch=prefetch,
                          listen_url=listen_url, rng=rng, credentials=credentials,
                          stores=stores))
    return WorkerPool(ports, policies, concurrency=concurrency, name=name,
                      grace_seconds=grace_seconds, rng=rng)


async def agree_with_policies(engine: AsyncEngine, policies: Policies, *,
                              broker: bool) -> None:
    """Before a pool's first claim: holds on an old tenant spelling cover its items, and
    items stand in the regions their tenants are pinned to now (with `broker`, the
    released ones moved handed to the relay for their new region's queues)."""
    await tenant_spellings.reconcile(engine, policies)
    await region_pins.reconcile(engine, policies.regions, hand_over=broker)


@dataclass(frozen=True)
class WorkerProcess:
    """What one `sweeper worker` process runs on, opened by `open_worker_process`."""

    settings: Settings
    policies: Policies
    engine: AsyncEngine
    listen_url: str
    upstreams: Upstreams
    stores: Stores
    credentials: Credentials
    broker: Broker | None = None  # SWEEPER_EXECUTION=rabbitmq
    name: str = field(default_factory=worker_name)  # the lease owner, in attempts too
    rng: random.Random = field(default_factory=random.Random)

    def ports(self) -> Ports:
        """The pool's ports on this process's database (or broker), upstreams and stores."""
        if self.broker is not None:
            return broker_ports(self.engine, self.policies, self.upstreams, self.broker,
                                owner=self.name, prefetch=self.settings.broker_prefetch,
                                listen_url=self.listen_url, rng=self.rng,
                                credentials=self.credentials, stores=self.stores)
        return database_ports(self.engine, self.policies, self.upstreams, owner=self.name,
                              listen_url=self.listen_url, rng=self.rng,
                              credentials=self.credentials, stores=self.stores,
                              region=self.settings.region)

    def pool(self, ports: Ports) -> WorkerPool:
        """A pool of the settings' size on `ports`, owning leases as this process."""
        return WorkerPool(ports, self.policies, concurrency=self.settings.workers,
                          name=self.name, grace_seconds=self.settings.shutdown_grace_seconds,
                          rng=self.rng)

    async def run(self, pool: WorkerPool, health: WorkerHealth | None = None) -> None:
        """Run `pool` until SIGTERM or SIGINT, beside the loop that resumes waiting scopes;
        `health` (the probes) watches the pool."""
        if health is not None:
            health.pool = pool
        # always: a scope paused before the policies file changed must resume too
        waits = asyncio.create_task(waiting_loop(self.engine, self.policies, self.credentials,
                                                 self.stores), name="waits")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, pool.stop)
        log.info("worker started", extra={"worker": pool.name,
                                          "concurrency": pool.concurrency})
        try:
            await pool.run(first=lambda: agree_with_policies(
                self.engine, self.policies, broker=self.broker is not None))
        finally:
            waits.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waits
            # the last line of the pool (closing what it ran on logs nothing)
            log.info("worker stopped", extra={"worker": pool.name, "completed": pool.completed,
                                              "unwritten": pool.unwritten})


@contextlib.asynccontextmanager
async def open_worker_process(settings: Settings, policies: Policies, url: URL
                              ) -> AsyncIterator[WorkerProcess]:
    """Open what a worker process runs on (nothing connects yet); closed on the way out."""
    initialise_series(policies.policies)
    engine = make_engine(url, settings, pool_wait=POOL_WAIT.observe)
    upstreams = Upstreams(policies.upstreams)
    stores = Stores(policies.stores)
    credentials = Credentials.of(policies, engine, Keyring.from_settings(settings))
    broker = open_broker(settings)
    try:
        yield WorkerProcess(settings, policies, engine, plain_url(url), upstreams, stores,
                            credentials, broker)
    finally:
        if broker is not None:
            await broker.close()
        await upstreams.aclose()
        await stores.aclose()
        await engine.dispose()


async def run_worker_process(settings: Settings, policies: Policies, url: URL, *,
                             health: WorkerHealth | None = None) -> None:
    """`sweeper worker`: a pool on this process's own ports, until SIGTERM or SIGINT;
    `health` (its probes) watches the pool."""
    async with open_worker_process(settings, policies, url) as process:
        await process.run(process.pool(process.ports()), health)
