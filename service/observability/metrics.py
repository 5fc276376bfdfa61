"""Prometheus metrics: every series Sweeper exports, in one place.

Naming: prefix `sweeper_`, base units (seconds, bytes), `_total` on counters. Labels come
only from closed sets: policy (from the policies file), outcome class, reason, source (a
configured webhook source), route templates. Never tenant, scope or object id.

Per-process series are updated where things happen. Ledger-wide series are read from the
database by `LedgerCollector` at scrape time (every replica reports the same value;
dashboards take `max`), from small tables and claimable-row indexes only, cached for a few
seconds so that many scrapers cannot multiply the cost.

Every name must stay distinct in OpenMetrics too, where a counter `X` is exposed as
`X_total`: no gauge may be called like a counter without its suffix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncEngine

import service
from service.db.statements import (
    CLOSURE_OVER,
    Statement,
    active_hold,
    expired_lease,
    ready_item,
    run,
)
from service.outcomes import Outcome

log = logging.getLogger(__name__)

# `_created` series double every counter's output and no dashboard here reads them
disable_created_metrics()  # type: ignore[no-untyped-call]
REGISTRY: Final = CollectorRegistry(auto_describe=True)
LEDGER_CACHE_S: Final = 5.0
LEDGER_QUERY_TIMEOUT_MS: Final = 2_000

# Upstream calls take milliseconds to tens of seconds (the per-call deadline).
_CALL_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_FAST_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                        1.0, 2.5, 5.0)

BUILD_INFO: Final = Info("sweeper_build", "The running build", registry=REGISTRY)
BUILD_INFO.info({"version": service.__version__})
# the standard process_*, python_gc_* and python_info series, in this registry too
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

# --- the worker pipeline ------------------------------------------------------------------
ITEMS_CLAIMED: Final = Counter(
    "sweeper_items_claimed_total", "Items leased by this process's workers",
    ["policy"], registry=REGISTRY)
LEASES_RECLAIMED: Final = Counter(
    "sweeper_lease_expiries_reclaimed_total",
    "Claims that took over an expired lease (a worker died or stalled)",
    ["policy"], registry=REGISTRY)
COMPLETIONS: Final = Counter(
    "sweeper_completions_total", "Upstream calls committed, by outcome class",
    ["policy", "outcome"], registry=REGISTRY)
LATE_COMPLETIONS: Final = Counter(
    "sweeper_late_completions_total",
    "Completions fenced out because the lease had been re-claimed (attempt row only)",
    ["policy"], registry=REGISTRY)
ITEMS_DEAD: Final = Counter(
    "sweeper_items_dead_total", "Items this process moved to dead, by reason",
    ["policy", "reason"], registry=REGISTRY)


class LeaseReturn(StrEnum):
    """Why a claimed lease went back unstarted: the closed set of `reason` on
    sweeper_leases_returned_total."""

    SHUTDOWN = "shutdown"        # the pool was stopping
    SCOPE_HELD = "scope_held"    # this process heard the scope throttled or refused
    LATE_START = "late_token"    # the call would start too long after its token's moment
    HELD = "held"                # a legal hold placed after the claim covers it
    LEASE_ENDING = "lease_ending"  # its lease was about to run out before the write


LEASES_RETURNED: Final = Counter(
    "sweeper_leases_returned_total",
    "Leases handed back unstarted (shutdown, a held scope, a token that came too late, a "
    "legal hold, a lease about to end)",
    ["reason"], registry=REGISTRY)
UPSTREAM_DISTRUSTED: Final = Counter(
    "sweeper_upstream_distrusted_total",
    "Connections closed for saying something out of turn (bytes while idle or before the "
    "request, a second answer, a status below 100, a missing echo); the host then gets a "
    "new connection per request for a while",
    ["upstream", "reason"], registry=REGISTRY)
UPSTREAM_DURATION: Final = Histogram(
    "sweeper_upstream_request_duration_seconds",
    "Wall time of one upstream call, to its classified outcome",
    ["policy", "outcome"], buckets=_CALL_BUCKETS, registry=REGISTRY)
IN_FLIGHT: Final = Gauge(
    "sweeper_upstream_in_flight", "Upstream calls this process has in flight",
    registry=REGISTRY)

# --- the shared budget --------------------------------------------------------------------
TOKENS_GRANTED: Final = Counter(
    "sweeper_limiter_tokens_granted_total", "Tokens this process took from scope buckets",
    registry=REGISTRY)
TOKENS_RETURNED: Final = Counter(
    "sweeper_limiter_tokens_returned_total",
    "Granted tokens handed back unused (a late token is dropped, not handed back)",
    registry=REGISTRY)
LIMITER_WAITS: Final = Counter(
    "sweeper_limiter_waits_total",
    "Admission rounds that found work but no token (the budget, not the workers, limits)",
    registry=REGISTRY)


class ScopeSignal(StrEnum):
    """Upstream answers that close or pause a scope: the closed set of `reason` on
    sweeper_scope_signals_total."""

    THROTTLED = "throttled"              # 429, or 503 with Retry-After: scope closed
    UNAUTHORIZED = "unauthorized"        # 401/403: scope paused
    QUOTA_EXHAUSTED = "quota_exhausted"  # rate-limit headers say the quota is spent


SCOPE_SIGNALS: Final = Counter(
    "sweeper_scope_signals_total",
    "Upstream answers that closed or paused a scope, by reason",
    ["reason"], registry=REGISTRY)

# --- runs ---------------------------------------------------------------------------------
PUBLICATION_DURATION: Final = Histogram(
    "sweeper_run_publication_duration_seconds",
    "From a run's first publication chunk to its last, per run published by this process",
    buckets=_CALL_BUCKETS, registry=REGISTRY)
ITEMS_RELEASED: Final = Counter(
    "sweeper_run_items_released_total", "Items released to workers by run publication",
    registry=REGISTRY)
RUNS_CREATED: Final = Counter(
    "sweeper_runs_created_total", "Runs recorded (duplicate triggers excluded)",
    ["dry_run"], registry=REGISTRY)

DISCOVERED: Final = Counter(
    "sweeper_discovered_rows_total",
    "Rows a store source's query returned to this process's discovery, by what became of "
    "them: candidate, or error (no item can be made of it)", ["policy", "result"],
    registry=REGISTRY)
DISCOVERY_PAGE_DURATION: Final = Histogram(
    "shop_discovery_page_seconds",
    "One source page read on the store, in its own read-only transaction",
    ["policy"], buckets=_CALL_BUCKETS, registry=REGISTRY)

RETENTION_PRUNED: Final = Counter(
    "sweeper_retention_pruned_total", "Finished rows deleted by retention, by table",
    ["table"], registry=REGISTRY)

# --- webhooks -----------------------------------------------------------------------------
WEBHOOKS: Final = Counter(
    "sweeper_webhooks_total",
    "Webhook deliveries by result: accepted, duplicate, ignored (no rule) or rejected",
    ["source", "result", "reason"], registry=REGISTRY)

# --- the cluster's leader and failures nobody expected ------------------------------------
LEADER: Final = Gauge(
    "sweeper_leader", "1 while this process is the cluster's leader (service/cluster/leader.py)",
    registry=REGISTRY)
LEADER_TERM: Final = Gauge(
    "sweeper_leader_term", "The term this process last led in (0: never led)",
    registry=REGISTRY)


class Where(StrEnum):
    """Where an unexpected error was caught and survived: the closed set of `where` on
    sweeper_internal_errors_total (service/errors.py `internal_error`)."""

    URGENT_SIGNALS = "urgent_signals"  # a throttle or pause applied at once after a call
    SIGNALS = "signals"                # scope signals applied with a flush
    HAND_BACK = "hand_back"            # unstarted leases returned with a flush
    COMPLETIONS = "completions"        # outcomes written with a flush
    SHUTDOWN_FLUSH = "shutdown_flush"  # the last flush before a pool stops
    WARM_UP = "warm_up"                # the statements a pool prepares before its first claim
    LISTEN = "listen"                  # the LISTEN connection for wake-ups and holds
    CLAIM = "claim"                    # an admission round
    CALL = "call"                      # an upstream call that crashed (its outcome: unknown)
    ANSWER_RULES = "answer_rules"      # a policy's answer rules that could not read a body
    HOLDS_WATCH = "holds_watch"        # a pool learning of new legal holds
    FIRST_STEP = "first_step"          # the step before a pool's first claim
    LEADER = "leader"                  # an election or renewal of the leader's lease
    PUBLISHER = "publisher"            # a publisher pass listing runs
    MAINTENANCE = "maintenance"        # holds maintenance, retention (service/db/engine.repeat)
    WAITS = "waits"                    # the waiting scopes' checks


INTERNAL_ERRORS: Final = Counter(
    "sweeper_internal_errors_total",
    "Unexpected errors caught and survived (not a database outage), by where",
    ["where"], registry=REGISTRY)

# --- HTTP and the database pool -----------------------------------------------------------
HTTP_DURATION: Final = Histogram(
    "sweeper_http_request_duration_seconds",
    "Time to answer an API request, by route template and status class",
    ["route", "method", "status"], buckets=_FAST_BUCKETS, registry=REGISTRY)
POOL_WAIT: Final = Histogram(
    "sweeper_db_pool_wait_seconds", "Time spent waiting for a database connection",
    buckets=_FAST_BUCKETS, registry=REGISTRY)


def status_class(status: int) -> str:
    """`2xx` ... `5xx`: a closed label set for HTTP statuses."""
    return f"{status // 100}xx"


# --- ledger-wide gauges, read from the database ----------------------------------------------

# Each query reads a small table or walks an index of claimable rows only; none grows with
# finished history. Dead items are counted through their partial index: they stay until an
# operator re-drives or cancels them (or retention prunes them).
_LEDGER_TIMEOUT = Statement("metrics.ledger_timeout", (
    "Bound the ledger reading, so a slow database cannot hold a scrape."),
    f"SET LOCAL statement_timeout = {LEDGER_QUERY_TIMEOUT_MS}")
_LEDGER_ELIGIBLE = Statement("metrics.ledger_eligible", (
    "Ready items per policy and the age of the oldest: the backlog workers could claim now."),
    f"""
    SELECT i.policy, count(*) AS n,
           coalesce(extract(epoch FROM now() - min(i.due_at)), 0) AS oldest
    FROM items i
    WHERE {ready_item("now()")}
    GROUP BY i.policy""")  # noqa: S608 - only a constant fragment is interpolated
_LEDGER_LEASED = Statement("metrics.ledger_leased", (
    "Leased items per policy, and those whose lease ran out (a worker died or stalled)."),
    f"""
    SELECT i.policy, count(*) AS n,
           count(*) FILTER (WHERE {expired_lease("now()")}) AS expired
    FROM items i WHERE i.status = 'leased' GROUP BY i.policy""")  # noqa: S608 - as above
_LEDGER_DEAD = Statement("metrics.ledger_dead", (
    "Dead items per policy, through their partial index."),
    "SELECT policy, count(*) AS n FROM items WHERE status = 'dead' GROUP BY policy")
_LEDGER_HELD = Statement("metrics.ledger_held", (
    "Items under a legal hold per policy, through their partial index."),
    "SELECT policy, count(*) AS n FROM items WHERE hold_id IS NOT NULL "
    "AND status IN ('pending', 'leased') GROUP BY policy")
_LEDGER_HOLDS = Statement("metrics.ledger_holds", "Legal holds in force.",
                          f"SELECT count(*) FROM holds hx WHERE {active_hold()}")  # noqa: S608
_LEDGER_SCOPES = Statement("metrics.ledger_scopes", (
    "Scopes closed by the upstream, paused, and in all."), f"""
    SELECT count(*) FILTER (WHERE NOT {CLOSURE_OVER}) AS closed,
           count(*) FILTER (WHERE s.paused) AS paused,
           count(*) AS total
    FROM scopes s""")  # noqa: S608 - only a constant fragment is interpolated
_LEDGER_CONTROL = Statement("metrics.ledger_control", (
    "Whether workers are paused everywhere."), "SELECT workers_paused FROM control")


@dataclass
class LedgerSnapshot:
    """One reading of the ledger-wide figures."""

    eligible: dict[str, int] = field(default_factory=dict)
    oldest_eligible_s: dict[str, float] = field(default_factory=dict)
    leased: dict[str, int] = field(default_factory=dict)
    leases_expired: dict[str, int] = field(default_factory=dict)
    dead: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    holds_active: int = 0
    scopes_closed: int = 0
    scopes_paused: int = 0
    scopes: int = 0
    workers_paused: bool = False
    up: bool = False


async def read_ledger(engine: AsyncEngine) -> LedgerSnapshot:
    """Read every ledger-wide figure in one short read-only transaction."""
    snap = LedgerSnapshot()
    async with engine.connect() as conn:
        await run(conn, _LEDGER_TIMEOUT)
        for row in await run(conn, _LEDGER_ELIGIBLE):
            snap.eligible[row.policy] = row.n
            snap.oldest_eligible_s[row.policy] = max(0.0, float(row.oldest))
        for row in await run(conn, _LEDGER_LEASED):
            snap.leased[row.policy] = row.n
            snap.leases_expired[row.policy] = row.expired
        for row in await run(conn, _LEDGER_DEAD):
            snap.dead[row.policy] = row.n
        for row in await run(conn, _LEDGER_HELD):
            snap.held[row.policy] = row.n
        snap.holds_active = int((await run(conn, _LEDGER_HOLDS)).scalar_one())
        scopes = (await run(conn, _LEDGER_SCOPES)).one()
        snap.scopes_closed, snap.scopes_paused, snap.scopes = (
            scopes.closed, scopes.paused, scopes.total)
        snap.workers_paused = bool((await run(conn, _LEDGER_CONTROL)).scalar())
        await conn.rollback()
    snap.up = True
    return snap


class LedgerCollector(Collector):
    """Exports the last ledger snapshot. `refresh` runs before each scrape is rendered
    (from the event loop, with a cache), so `collect` itself never blocks on the database."""

    def __init__(self, engine: AsyncEngine, policies: Iterable[str]) -> None:
        self._engine = engine
        self._policies = sorted(policies)
        self._snapshot = LedgerSnapshot()
        self._read_at = -LEDGER_CACHE_S
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._read_at < LEDGER_CACHE_S:
                return
            try:
                self._snapshot = await read_ledger(self._engine)
            except Exception as exc:  # a scrape must answer even when the database cannot
                log.warning("metrics: ledger figures unavailable",
                            extra={"error": type(exc).__name__})
                self._snapshot = LedgerSnapshot()
            self._read_at = time.monotonic()

    @property
    def snapshot(self) -> LedgerSnapshot:
        """The last reading (`refresh` first for one at most LEDGER_CACHE_S old)."""
        return self._snapshot

    def _per_policy(self, name: str, doc: str, values: Mapping[str, float]
                    ) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["policy"])
        # every configured policy appears (0 when it has nothing), plus any the ledger
        # still holds from an earlier policies file: a bounded set either way
        for policy in sorted(set(self._policies) | set(values)):
            family.add_metric([policy], values.get(policy, 0))
        return family

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot
        yield GaugeMetricFamily("sweeper_ledger_up",
                                "1 if the last ledger reading succeeded", value=int(snap.up))
        yield self._per_policy("sweeper_oldest_eligible_age_seconds",
                               "Age (now - due_at) of the oldest item workers could claim now",
                               snap.oldest_eligible_s)
        yield self._per_policy("sweeper_items_eligible",
                               "Released pending items whose next attempt is due",
                               snap.eligible)
        yield self._per_policy("sweeper_items_leased", "Items under a lease", snap.leased)
        yield self._per_policy("sweeper_leases_expired",
                               "Leases past their expiry, waiting to be re-claimed",
                               snap.leases_expired)
        # not `sweeper_items_dead`: OpenMetrics refuses it beside the counter
        # sweeper_items_dead_total
        yield self._per_policy("sweeper_ledger_items_dead", "Items in status dead",
                               snap.dead)
        yield self._per_policy("sweeper_items_held",
                               "Pending and leased items under a legal hold", snap.held)
        yield GaugeMetricFamily("sweeper_holds_active", "Legal holds in force",
                                value=snap.holds_active)
        yield GaugeMetricFamily("sweeper_scopes_closed",
                                "Scopes closed by the upstream (429 or rate-limit headers)",
                                value=snap.scopes_closed)
        yield GaugeMetricFamily("sweeper_scopes_paused",
                                "Scopes paused (by an operator or a credential fault)",
                                value=snap.scopes_paused)
        yield GaugeMetricFamily("sweeper_scopes", "Scopes with a budget row", value=snap.scopes)
        yield GaugeMetricFamily("sweeper_workers_paused",
                                "1 while all workers are paused", value=int(snap.workers_paused))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


@dataclass(frozen=True)
class Exposition:
    """One rendered scrape: the body and the content type it is written in."""

    body: bytes
    content_type: str


@dataclass
class Exporter:
    """What `/metrics` renders: the process registry plus this engine's ledger figures."""

    collector: LedgerCollector

    async def render(self, accept: str = "") -> Exposition:
        """The registry in the format the scraper's Accept header asks for, negotiated by
        prometheus_client itself: OpenMetrics when asked, else the Prometheus text format."""
        await self.collector.refresh()
        encode, content_type = choose_encoder(accept)
        return Exposition(encode(REGISTRY), content_type)


def initialise_series(policies: Iterable[str]) -> None:
    """Create, at 0, every labelled counter series whose label values come from a closed
    set known at start (the configured policies, outcome classes, reasons): without a
    series before its first event, `rate()` misses that event and panels stay empty.
    Every process that serves metrics calls this once at start."""
    for policy in policies:
        for family in (ITEMS_CLAIMED, LEASES_RECLAIMED, LATE_COMPLETIONS):
            family.labels(policy)
        for outcome in Outcome:
            COMPLETIONS.labels(policy, outcome)
        for result in ("candidate", "error"):
            DISCOVERED.labels(policy, result)
    for returned in LeaseReturn:
        LEASES_RETURNED.labels(returned)
    for signal in ScopeSignal:
        SCOPE_SIGNALS.labels(signal)
    for where in Where:
        INTERNAL_ERRORS.labels(where)


def install_ledger(engine: AsyncEngine, policies: Iterable[str]) -> Exporter:
    """Initialise this process's series and register a ledger collector for this engine
    (replacing an earlier one: a test process builds many apps); return the exporter that
    serves them."""
    global _installed
    names = sorted(policies)
    initialise_series(names)
    if _installed is not None:
        REGISTRY.unregister(_installed)
    _installed = LedgerCollector(engine, names)
    REGISTRY.register(_installed)
    return Exporter(_installed)


_installed: LedgerCollector | None = None
