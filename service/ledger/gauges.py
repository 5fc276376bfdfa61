"""The ledger-wide gauges of `/metrics`, read from the database at scrape time (every replica
reports the same values; a scrape reads them at most every LEDGER_CACHE_S), and the exporter
that renders them with the process's own series (service/observability/metrics.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import (
    CLOSURE_OVER,
    LEASED,
    Statement,
    active_hold,
    expired_lease,
    ready_item,
    run,
)
from service.observability.metrics import REGISTRY, initialise_series

log = logging.getLogger(__name__)

LEDGER_CACHE_S: Final = 5.0
LEDGER_QUERY_TIMEOUT_MS: Final = 2_000

# Each query reads a small table or walks an index of claimable rows only; none grows with
# finished history. Dead items are counted through their partial index: they stay until an
# operator re-drives or cancels them (or retention prunes them).
_LEDGER_TIMEOUT = Statement("gauges.ledger_timeout", (
    "Bound the ledger reading, so a slow database cannot hold a scrape."),
    f"SET LOCAL statement_timeout = {LEDGER_QUERY_TIMEOUT_MS}")
_LEDGER_ELIGIBLE = Statement("gauges.ledger_eligible", (
    "Per policy, the released unheld pending items: those claimable (the backlog workers "
    "could claim now) and the age of the oldest, those leased, and their expired leases."),
    f"""
    SELECT c.policy, count(*) FILTER (WHERE c.ready) AS n,
           coalesce(extract(epoch FROM now() - min(c.due_at) FILTER (WHERE c.ready)), 0)
               AS oldest,
           count(*) FILTER (WHERE c.leased) AS leased,
           count(*) FILTER (WHERE c.expired) AS expired
    FROM (SELECT i.policy, i.due_at, {ready_item("now()")} AS ready, {LEASED} AS leased,
                 {expired_lease("now()")} AS expired
          FROM items i
          -- items_ready's WHERE: a leased item stays pending (no index says leased)
          WHERE i.status = 'pending' AND i.released_at IS NOT NULL AND i.hold_id IS NULL
          OFFSET 0) c
    GROUP BY c.policy""")  # noqa: S608 - only constant fragments are interpolated
_LEDGER_DEAD = Statement("gauges.ledger_dead", (
    "Dead items per policy, through their partial index."),
    "SELECT policy, count(*) AS n FROM items WHERE status = 'dead' GROUP BY policy")
_LEDGER_HELD = Statement("gauges.ledger_held", (
    "Items under a legal hold per policy through their partial index, and those of them "
    "leased, with their expired leases."), f"""
    SELECT i.policy, count(*) AS n, count(*) FILTER (WHERE {LEASED}) AS leased,
           count(*) FILTER (WHERE {expired_lease("now()")}) AS expired
    FROM items i WHERE i.hold_id IS NOT NULL AND i.status = 'pending'
    GROUP BY i.policy""")  # noqa: S608 - only constant fragments are interpolated
_LEDGER_HOLDS = Statement("gauges.ledger_holds", "Legal holds in force.",
                          f"SELECT count(*) FROM holds hx WHERE {active_hold()}")  # noqa: S608
_LEDGER_SCOPES = Statement("gauges.ledger_scopes", (
    "Scopes closed by the upstream, paused, and in all."), f"""
    SELECT count(*) FILTER (WHERE NOT {CLOSURE_OVER}) AS closed,
           count(*) FILTER (WHERE s.paused) AS paused,
           count(*) AS total
    FROM scopes s""")  # noqa: S608 - only a constant fragment is interpolated
_LEDGER_CONTROL = Statement("gauges.ledger_control", (
    "Whether workers are paused everywhere."), "SELECT workers_paused FROM control")
# through runs_publishing (a partial index of the runs still publishing: a handful)
_LEDGER_PUBLISHING = Statement("gauges.ledger_publishing", (
    "How long the oldest run still publishing has been at it."), """
    SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
    FROM runs WHERE state = 'publishing'""")


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
    publishing_s: float = 0.0
    up: bool = False


def _add_leases(snap: LedgerSnapshot, row: Row[Any]) -> None:
    if row.leased:
        snap.leased[row.policy] = snap.leased.get(row.policy, 0) + row.leased
        snap.leases_expired[row.policy] = (snap.leases_expired.get(row.policy, 0)
                                           + row.expired)


async def read_ledger(engine: AsyncEngine) -> LedgerSnapshot:
    """Read every ledger-wide figure in one short read-only transaction."""
    snap = LedgerSnapshot()
    async with engine.connect() as conn:
        await run(conn, _LEDGER_TIMEOUT)
        for row in await run(conn, _LEDGER_ELIGIBLE):
            if row.n:
                snap.eligible[row.policy] = row.n
                snap.oldest_eligible_s[row.policy] = max(0.0, float(row.oldest))
            _add_leases(snap, row)
        for row in await run(conn, _LEDGER_DEAD):
            snap.dead[row.policy] = row.n
        for row in await run(conn, _LEDGER_HELD):
            snap.held[row.policy] = row.n
            _add_leases(snap, row)
        snap.holds_active = int((await run(conn, _LEDGER_HOLDS)).scalar_one())
        scopes = (await run(conn, _LEDGER_SCOPES)).one()
        snap.scopes_closed, snap.scopes_paused, snap.scopes = (
            scopes.closed, scopes.paused, scopes.total)
        snap.workers_paused = bool((await run(conn, _LEDGER_CONTROL)).scalar())
        snap.publishing_s = max(0.0, float((await run(conn, _LEDGER_PUBLISHING)).scalar_one()))
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
                               "Released pending items whose next attempt is due, under "
                               "no lease that still runs",
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
        yield GaugeMetricFamily("sweeper_run_publishing_age_seconds",
                                "How long the oldest run still publishing has been at it "
                                "(0: none)", value=snap.publishing_s)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


class _Signing(Collector):
    """Whether the app signs evidence: a series of the app's registry, so that a process
    without the API (`sweeper worker`) exports none and an alert reads the API's alone."""

    def __init__(self, signing: bool) -> None:
        self._signing = signing

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("sweeper_evidence_signing",
                                "1 when this API process signs evidence checkpoints and "
                                "exports (a signing key is set)", value=int(self._signing))


@dataclass(frozen=True)
class Exposition:
    """One rendered scrape: the body and the content type it is written in."""

    body: bytes
    content_type: str


class _ProcessSeries(Collector):
    """The process registry's series (service/observability/metrics.py), as one collector of
    an app's own registry."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()

    def describe(self) -> Iterator[Metric]:
        return iter(())


@dataclass
class Exporter:
    """What one app's `/metrics` renders: the process's series and this engine's ledger
    figures, in a registry of the app's own. Nothing is registered process-wide, so the
    apps one process builds (a test process builds many) never see each other's ledger."""

    collector: LedgerCollector
    signing: bool = False  # this app signs evidence (a signing key is set)
    registry: CollectorRegistry = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_ProcessSeries())
        self.registry.register(self.collector)
        self.registry.register(_Signing(self.signing))

    async def render(self, accept: str = "") -> Exposition:
        """The registry in the format the scraper's Accept header asks for, negotiated by
        prometheus_client itself: OpenMetrics when asked, else the Prometheus text format."""
        await self.collector.refresh()
        encode, content_type = choose_encoder(accept)
        return Exposition(encode(self.registry), content_type)


def ledger_exporter(engine: AsyncEngine, policies: Iterable[str], *, signing: bool = False
                    ) -> Exporter:
    """Initialise this process's series for the policies and return the exporter an app
    serves them with, beside this engine's ledger figures."""
    names = sorted(policies)
    initialise_series(names)
    return Exporter(LedgerCollector(engine, names), signing)
