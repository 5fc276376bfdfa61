"""Prometheus metrics: every series Sweeper exports, in one place.

Naming: prefix `sweeper_`, base units (seconds, bytes), `_total` on counters. Labels come
only from closed sets: policy (from the policies file), outcome class, reason, source (a
configured webhook source), route templates. Never tenant, scope or object id.

Per-process series are updated where things happen. Ledger-wide series are read from the
database by `ledger.gauges.LedgerCollector` at scrape time (every replica reports the same value;
dashboards take `max`), from small tables and claimable-row indexes only, cached for a few
seconds so that many scrapers cannot multiply the cost.

Every name must stay distinct in OpenMetrics too, where a counter `X` is exposed as
`X_total`: no gauge may be called like a counter without its suffix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
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

import service
from service.outcomes import FAILURE_OUTCOMES, UNKNOWN_POLICY_VERSION, Failure, Outcome

log = logging.getLogger(__name__)

# `_created` series double every counter's output and no dashboard here reads them
disable_created_metrics()  # type: ignore[no-untyped-call]
REGISTRY: Final = CollectorRegistry(auto_describe=True)

# Upstream calls take milliseconds to tens of seconds (the per-call deadline).
_CALL_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# API requests and pool waits: sub-millisecond to the longest timeouts (the pool's and a
# body's 10 s, an export's 30 s), so a request that times out lands in a bucket of its own.
_FAST_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                        1.0, 2.5, 5.0, 10.0, 30.0)

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


def dead_reason_label(reason: str) -> str:
    """A dead item's reason as a metric label from a closed set (the ledger keeps the
    exact reason): `max_attempts`, a transport failure, a known HTTP status, else its
    class (`http_4xx`)."""
    if reason.startswith("max_attempts:"):
        return "max_attempts"
    if reason in _FAILURE_REASONS:
        return reason
    status = reason.removeprefix("http_").removeprefix("absent_")
    if status.isdigit():
        return f"http_{status}" if int(status) in _LABELLED_STATUSES else f"http_{status[0]}xx"
    return "other"


_FAILURE_REASONS: Final = frozenset({*(f.value for f in Failure), UNKNOWN_POLICY_VERSION,
                                     "no_status"})
_LABELLED_STATUSES: Final = frozenset({400, 401, 403, 404, 405, 409, 410, 411, 413, 415,
                                       422, 500, 501, 502, 503, 504})
# The labels a dead item gets unless a policy's answer rules make other answers permanent:
# retries exhausted, a failure permanent by itself, a 3xx or 4xx (service/outcomes.py; a
# 404 or 410 where absence is not deletion), each series exported from start at 0
DEAD_REASONS: Final = tuple(sorted({
    "max_attempts", UNKNOWN_POLICY_VERSION, "other",
    *(f.value for f, outcome in FAILURE_OUTCOMES.items() if outcome is Outcome.PERMANENT),
    *(dead_reason_label(f"http_{status}") for status in range(300, 500)
      if status not in (401, 403, 408, 429))}))


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


# --- broker mode (service/execution) ------------------------------------------------------
class BrokerEvent(StrEnum):
    """What became of a message (SWEEPER_EXECUTION=rabbitmq)."""

    PUBLISHED = "published"  # the relay handed an outbox row's items over (confirmed)
    SETTLED = "settled"      # a worker acked it: its items' outcomes committed or handed on
    DEFERRED = "deferred"    # a worker handed items back to come later (confirmed)
    DEAD = "dead"            # past the delivery limit: its items ended dead in the ledger
    REROUTED = "rerouted"    # items of another region's tenants went back to the relay


BROKER_MESSAGES: Final = Counter(
    "sweeper_broker_messages_total",
    "Broker messages by what became of them: published by the relay, settled, deferred, "
    "ended dead past the delivery limit, rerouted to another region", ["event"],
    registry=REGISTRY)
BROKER_IN_HAND: Final = Gauge(
    "sweeper_broker_messages_in_hand",
    "Messages this process holds unsettled (at most SWEEPER_BROKER_PREFETCH)",
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
RUNS_FAILED: Final = Counter(
    "sweeper_runs_failed_total",
    "Runs whose publication this process marked failed (the error is in the run's report)",
    registry=REGISTRY)

DISCOVERED: Final = Counter(
    "sweeper_discovered_rows_total",
    "Rows a store source's query returned to this process's discovery, by what became of "
    "them: candidate, or error (no item can be made of it)", ["policy", "result"],
    registry=REGISTRY)
DISCOVERY_PAGE_DURATION: Final = Histogram(
    "sweeper_discovery_page_duration_seconds",
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
    TRACING = "tracing"                # a span of a claim, call or completion not made
    MINUTES = "minutes"                # a process's tally added to the ledger's minutes
    RELAY = "relay"                    # the outbox handed to the broker (broker mode)
    DELIVERIES = "deliveries"          # a broker's deliveries sorted, settled or deferred


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
        for reason in DEAD_REASONS:
            ITEMS_DEAD.labels(policy, reason)
    for returned in LeaseReturn:
        LEASES_RETURNED.labels(returned)
    for signal in ScopeSignal:
        SCOPE_SIGNALS.labels(signal)
    for event in BrokerEvent:
        BROKER_MESSAGES.labels(event)
    for where in Where:
        INTERNAL_ERRORS.labels(where)
