"""The composition root: `create_app` builds the application (problem handlers, routers,
the gate and the request log) and a lifespan that opens the process's `Runtime` and starts
its `Background` tasks: the leader's duties (`leader_duties`: publication, holds
maintenance, evidence checkpoints, retention) and, with `run_workers` and SWEEPER_WORKERS
above 0, the worker pool and its upstream clients. Wiring only: each loop lives with its
concept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypedDict

from fastapi import Depends, FastAPI
from sqlalchemy.engine import URL

import service
from service.budget.credential_waits import Credentials
from service.cluster import retention
from service.cluster.leader import Duty, Elector
from service.config.policies import Policies
from service.config.settings import Settings, plain_url
from service.config.tokens import TokenSet
from service.credentials import CredentialStore, Keyring
from service.db.engine import make_engine
from service.db.migrate import head_revision
from service.errors import DatabaseUnavailable
from service.evidence import chain
from service.execution.relay import Relay
from service.history import sampler
from service.http.api import credentials as credentials_routes
from service.http.api import evidence as evidence_routes
from service.http.api import health, items
from service.http.api import holds as holds_routes
from service.http.api import metrics as metrics_api
from service.http.api import policies as policies_api
from service.http.api import runs as runs_routes
from service.http.api import scopes as scopes_routes
from service.http.api import webhooks as webhooks_routes
from service.http.api.deps import strict_query
from service.http.api.document import install_document
from service.http.api.gate import Gate
from service.http.api.methods import RouteMethods
from service.http.api.problems import install_problem_handlers
from service.http.console import ConsoleState, console_state
from service.http.console import routers as console_routers
from service.http.request_log import RequestLog
from service.ledger import gauges, holds
from service.observability import metrics, tracing
from service.runs.discovery import Discovery
from service.runs.publisher import Publisher
from service.runtime import Runtime
from service.sweeps.store_databases import Stores
from service.sweeps.store_targets import ledger_tables
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from service.worker.broker_ports import open_broker
from service.worker.pool import WorkerPool, worker_name
from service.worker.process import agree_with_policies
from service.worker.scope_resumption import waiting_loop

log = logging.getLogger("service.http")


class State(TypedDict):
    """Lifespan state, available to every request as `request.state`."""

    runtime: Runtime
    console: ConsoleState


def leader_duties(runtime: Runtime) -> dict[str, Duty]:
    """The loops that must run once in the cluster, on the leader only (service/cluster/leader.py):
    publication, holds maintenance (expired holds released, unfinished markings finished),
    the evidence log's periodic checkpoints, the backlog's samples for the console's charts,
    retention and, in broker mode, the relay handing the outbox to the broker. Each is
    started with the leader's term and cancelled when it ends."""
    settings, engine = runtime.settings, runtime.engine
    duties: dict[str, Duty] = {
        "publisher": lambda term: Publisher(
            engine, Discovery(runtime.policies, runtime.stores, runtime.tenant_credentials),
            settings.batch_size, term, runtime.publisher_wake).run(),
        "holds": lambda _term: holds.maintenance_loop(engine),
        "evidence-checkpoints": lambda _term: chain.checkpoint_loop(engine, runtime.signer),
        "minutes": lambda _term: sampler.sampling_loop(
            engine, runtime.exporter.collector, list(runtime.policies.policies)),
    }
    if runtime.broker is not None:  # broker mode: the outbox goes to the broker
        broker = runtime.broker
        regions = runtime.policies.regions.served
        duties["relay"] = lambda _term: Relay(engine, broker, regions=regions).run()
    if settings.retention_days > 0:
        duties["retention"] = lambda _term: retention.retention_loop(
            engine, keep_seconds=settings.retention_days * 86_400,
            batch_size=settings.retention_batch_size,
            evidence_keep_seconds=settings.evidence_retention_days * 86_400,
            interval_s=settings.retention_interval_seconds, stores=runtime.stores,
            ledgers=ledger_tables(runtime.policies))
    return duties


def open_runtime(settings: Settings, policies: Policies, database_url: URL) -> Runtime:
    """What the process holds while it runs: the engine, the credentials, the stores'
    databases. Nothing connects yet."""
    engine = make_engine(database_url, settings, pool_wait=metrics.POOL_WAIT.observe)
    webhooks_routes.initialise_series(policies.webhooks)
    signer = settings.local_evidence_signer()
    keyring = Keyring.from_settings(settings)
    store = CredentialStore(engine, keyring) if keyring else None
    return Runtime(settings=settings, policies=policies, engine=engine,
                   tokens=TokenSet.of(settings.role_tokens()), schema_head=head_revision(),
                   exporter=gauges.ledger_exporter(engine, policies.policies,
                                                   signing=signer is not None),
                   keyring=keyring, credentials=store,
                   tenant_credentials=Credentials.of(policies, engine, keyring, store),
                   signer=signer, stores=Stores(policies.stores),
                   broker=open_broker(settings))


@dataclass
class Background:
    """The lifespan's background tasks: the elector running the leader's duties and, when
    the process calls upstreams, the worker pool and the loop resuming waiting scopes."""

    loops: list[asyncio.Task[None]]  # cancelled at stop
    pool: WorkerPool | None = None  # stopped at stop: it ends by itself within its grace
    workers: asyncio.Task[None] | None = None  # the pool's run

    @classmethod
    def start(cls, runtime: Runtime, upstreams: Upstreams | None, database_url: URL
              ) -> Background:
        """Start them; `upstreams` None: this process runs no workers."""
        engine, policies, settings = runtime.engine, runtime.policies, runtime.settings
        # the cluster's once-only loops run under the elector, on the leader alone
        elector = Elector(engine, worker_name())
        leader = asyncio.create_task(elector.run(leader_duties(runtime)), name="leader")
        if upstreams is None:
            return cls([leader])
        pool = database_pool(engine, policies, upstreams, concurrency=settings.workers,
                             listen_url=plain_url(database_url),
                             grace_seconds=settings.shutdown_grace_seconds,
                             credentials=runtime.tenant_credentials, stores=runtime.stores,
                             broker=runtime.broker, prefetch=settings.broker_prefetch,
                             region=settings.region)
        workers = asyncio.create_task(pool.run(
            first=lambda: agree_with_policies(engine, policies,
                                              broker=runtime.broker is not None)),
            name="workers")
        # always: a scope paused before the policies file changed must resume too
        waits = asyncio.create_task(waiting_loop(
            engine, policies, runtime.tenant_credentials, runtime.stores), name="waits")
        return cls([leader, waits], pool, workers)

    async def stop(self) -> None:
        """Stop the pool, cancel the loops, and wait for every task to end."""
        if self.pool is not None:
            self.pool.stop()
        for loop in self.loops:
            loop.cancel()
        running = [*self.loops, *([self.workers] if self.workers is not None else [])]
        await asyncio.gather(*running, return_exceptions=True)


def warn_at_start(runtime: Runtime) -> None:
    """Say at start what the configuration leaves unusable or unsigned."""
    if runtime.signer is None:
        log.warning(health.UNSIGNED_WARNING)
    if not runtime.settings.role_tokens():
        log.warning("no API tokens configured: every /v1 request will answer 401 "
                    "(set SWEEPER_API_TOKENS)")


def install_routes(app: FastAPI) -> None:
    """The API's routers, the console's, and the methods each path allows (the gate answers
    HEAD and OPTIONS from them)."""
    # operator API: an undeclared or repeated query parameter is refused, not ignored
    checked = [Depends(strict_query)]
    routers = [(health.router, []), (metrics_api.router, []),
               (policies_api.router, checked), (items.router, checked),
               (runs_routes.router, checked), (scopes_routes.router, checked),
               (credentials_routes.router, checked),
               (holds_routes.router, checked), (evidence_routes.router, checked),
               (webhooks_routes.router, [])]
    for router, dependencies in routers:
        app.include_router(router, dependencies=dependencies)
    for router in console_routers:  # outside /v1: signed in by cookie (service/http/console)
        app.include_router(router)
    app.state.route_methods = RouteMethods(
        [*app.router.routes, *(route for router, _ in routers for route in router.routes),
         *(route for router in console_routers for route in router.routes)])


def create_app(
    settings: Settings,
    policies: Policies,
    database_url: URL,
    *,
    run_workers: bool = True,
) -> FastAPI:
    """Build the application; nothing connects until the lifespan starts."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[State]:
        runtime = open_runtime(settings, policies, database_url)
        calls_upstreams = run_workers and settings.workers > 0
        upstreams = Upstreams(policies.upstreams) if calls_upstreams else None
        background = Background.start(runtime, upstreams, database_url)
        # /healthz reports it without a query of its own (each /readyz reads it again)
        with contextlib.suppress(DatabaseUnavailable):  # not answering yet: /readyz says so
            runtime.schema.revision = await health.schema_revision(runtime.engine)
        warn_at_start(runtime)
        try:
            yield {"runtime": runtime, "console": console_state(runtime)}
        finally:
            await background.stop()
            if upstreams is not None:
                await upstreams.aclose()
            await runtime.stores.aclose()
            if runtime.broker is not None:
                await runtime.broker.close()
            await runtime.engine.dispose()

    app = FastAPI(
        title="Sweeper",
        version=service.__version__,
        summary="Scheduled, rate-limited, crash-safe data cleanup",
        lifespan=lifespan,
    )
    install_problem_handlers(app)
    install_document(app)  # links, line schemas: for clients and the contract tests
    install_routes(app)
    app.add_middleware(Gate, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_read_timeout_seconds,
                       webhooks=webhooks_routes.direct)
    app.add_middleware(RequestLog)  # it logs and times what the gate answers
    tracing.instrument_app(app)  # outermost, tracing on: the request's span
    return app
