"""The FastAPI application: the gate and request log, routers, problem handlers, and a
lifespan that owns the engine, the publisher and retention loops and (with `run_workers`
and SWEEPER_WORKERS above 0) the worker pool and its upstream clients."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypedDict

import httpx
from fastapi import Depends, FastAPI
from sqlalchemy.engine import URL
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
from service.errors import NotLeader
from service.evidence import chain
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
from service.http.api.gate import Gate
from service.http.api.links import install_links
from service.http.api.methods import RouteMethods
from service.http.api.problems import REQUEST_ID, install_problem_handlers
from service.http.console import ConsoleState, console_state
from service.http.console import routers as console_routers
from service.ledger import gauges, holds, tenant_spellings
from service.observability import metrics
from service.observability.failures import InternalErrors, expected
from service.observability.metrics import Where
from service.runs import publication
from service.runs.discovery import Discovery
from service.runtime import Runtime
from service.sweeps.store_databases import Stores
from service.sweeps.store_targets import ledger_tables
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from service.worker.pool import worker_name
from service.worker.scope_resumption import waiting_loop

log = logging.getLogger("service.http")

PUBLISHER_POLL_S = 1.0


class State(TypedDict):
    """Lifespan state, available to every request as `request.state`."""

    runtime: Runtime
    console: ConsoleState


class RequestLog:
    """One log line per request: method, path (no query string), status, duration. Never
    headers or bodies."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        request_id = uuid.uuid4().hex[:16]
        scope[REQUEST_ID] = request_id  # problem answers name the request by it

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - started
            matched = scope.get("route")
            # only methods the matched route declares are labelled, so requests with any
            # method to any path add at most one `other` per route template
            declared = getattr(matched, "methods", None) or ()
            method = scope["method"] if scope["method"] in declared else "other"
            metrics.HTTP_DURATION.labels(getattr(matched, "path", "unmatched"), method,
                                         metrics.status_class(status)).observe(elapsed)
            level = logging.WARNING if status >= 500 else logging.INFO
            if scope["path"] not in ("/healthz", "/readyz", "/metrics") or status >= 500:
                log.log(level, "request", extra={
                    "method": scope["method"], "path": scope["path"], "status": status,
                    "duration_ms": round(elapsed * 1000, 2),
                    "request_id": request_id})


async def _publisher(runtime: Runtime, term: int) -> None:
    """Publish runs left in state `publishing` (new ones, or ones a crash interrupted), as
    the leader of `term`: each chunk commits only while that term's lease holds. A run's
    own error is handled inside `publish_pending` (a retry, or the run marked failed and
    logged once); one reaching this loop came from listing the runs: the next pass lists
    them again."""
    discovery = Discovery(runtime.policies, runtime.stores, runtime.tenant_credentials)
    errors = InternalErrors(log)
    while True:
        # cleared before the pass: a run created while it lists runs wakes the next one
        runtime.publisher_wake.clear()
        try:
            await publication.publish_pending(runtime.engine,
                                              batch_size=runtime.settings.batch_size,
                                       discovery=discovery, term=term)
        except NotLeader:
            log.warning("publisher: the leader's term ended; publication stops here",
                        extra={"term": term})
            return
        except Exception as exc:
            if expected(exc):
                log.warning("publisher: database unavailable or busy",
                            extra={"error_type": type(exc).__name__})
            else:
                errors.caught(Where.PUBLISHER, exc)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PUBLISHER_POLL_S):
                await runtime.publisher_wake.wait()


def leader_duties(runtime: Runtime) -> dict[str, Duty]:
    """The loops that must run once in the cluster, on the leader only (service/cluster/leader.py):
    publication, holds maintenance (expired holds released, unfinished markings finished),
    the evidence log's periodic checkpoints and retention. Each is started with the
    leader's term and cancelled when it ends."""
    settings, engine = runtime.settings, runtime.engine
    duties: dict[str, Duty] = {
        "publisher": lambda term: _publisher(runtime, term),
        "holds": lambda _term: holds.maintenance_loop(engine),
        "evidence-checkpoints": lambda _term: chain.checkpoint_loop(engine,
                                                                           runtime.signer),
    }
    if settings.retention_days > 0:
        duties["retention"] = lambda _term: retention.retention_loop(
            engine, keep_seconds=settings.retention_days * 86_400,
            batch_size=settings.retention_batch_size,
            evidence_keep_seconds=settings.evidence_retention_days * 86_400,
            interval_s=settings.retention_interval_seconds, stores=runtime.stores,
            ledgers=ledger_tables(runtime.policies))
    return duties


def create_app(
    settings: Settings,
    policies: Policies,
    database_url: URL,
    *,
    run_workers: bool = True,
    upstream_transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """Build the application; nothing connects until the lifespan starts."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[State]:
        engine = make_engine(database_url, settings, pool_wait=metrics.POOL_WAIT.observe)
        keyring = Keyring.from_settings(settings)
        store = CredentialStore(engine, keyring) if keyring else None
        runtime = Runtime(settings=settings, policies=policies, engine=engine,
                          tokens=TokenSet.of(settings.role_tokens()), schema_head=head_revision(),
                          exporter=gauges.ledger_exporter(engine, policies.policies),
                          keyring=keyring, credentials=store,
                          tenant_credentials=Credentials.of(policies, engine, keyring, store),
                          signer=settings.local_evidence_signer(),
                          stores=Stores(policies.stores))
        # background loops, cancelled on shutdown; the worker pool stops by itself (grace).
        # The cluster's once-only loops run under the elector, on the leader alone.
        elector = Elector(engine, worker_name())
        loops = [asyncio.create_task(elector.run(leader_duties(runtime)), name="leader")]
        tasks = list(loops)
        pool = upstreams = None
        if run_workers and settings.workers > 0:
            upstreams = Upstreams(policies.upstreams, upstream_transport)
            pool = database_pool(engine, policies, upstreams, concurrency=settings.workers,
                                 listen_url=plain_url(database_url),
                                 grace_seconds=settings.shutdown_grace_seconds,
                                 credentials=runtime.tenant_credentials,
                                 stores=runtime.stores)
            # before the first claim: holds on an old tenant spelling cover its items
            tasks.append(asyncio.create_task(pool.run(
                first=lambda: tenant_spellings.reconcile(engine, policies)), name="workers"))
            # always: a scope paused before the policies file changed must resume too
            loops.append(asyncio.create_task(waiting_loop(
                engine, policies, runtime.tenant_credentials, runtime.stores), name="waits"))
            tasks.append(loops[-1])
        if runtime.signer is None:
            log.warning(health.UNSIGNED_WARNING)
        if not settings.role_tokens():
            log.warning("no API tokens configured: every /v1 request will answer 401 "
                        "(set SWEEPER_API_TOKENS)")
        try:
            yield {"runtime": runtime, "console": console_state(runtime)}
        finally:
            if pool is not None:
                pool.stop()
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if upstreams is not None:
                await upstreams.aclose()
            await runtime.stores.aclose()
            await engine.dispose()

    app = FastAPI(
        title="Sweeper",
        version=service.__version__,
        summary="Scheduled, rate-limited, crash-safe data cleanup",
        lifespan=lifespan,
    )
    install_problem_handlers(app)
    install_links(app)  # OpenAPI links for clients and the stateful contract test
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
    app.add_middleware(Gate, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_read_timeout_seconds,
                       webhooks=webhooks_routes.direct)
    app.add_middleware(RequestLog)  # outermost: it logs and times what the gate answers
    return app
