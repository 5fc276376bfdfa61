"""The operator console's page latency with a large ledger (#24).

Target: every console page answers in under 200 ms at the 95th percentile with 1,000,000
items in the ledger.

1. One fresh database is seeded once, in SQL (INSERT ... SELECT generate_series in chunks,
   then VACUUM (ANALYZE) of every table written): `--items` items over four policies and
   `--tenants` tenants (skewed: the first tenant holds about a tenth of the items, the
   last a few hundred), published by `--runs` runs (one in ten report-only) in batches of
   500, one of them of `--large-run-items` items; mostly succeeded, with dead and cancelled
   items throughout and pending and leased items in the newest tenth of the published
   items (recent runs still draining), and the newest 3% registered but not yet
   published; one or two attempt rows per finished item, one scope per tenant (a few
   paused, a few closed by their upstream), `--webhooks` webhook receipts over three days
   and `--actions` operator actions over twenty.
2. Each repetition starts a new `sweeper serve` process (workers 0, retention off: nothing
   changes underneath; every cache of the console starts cold), signs in through the form
   over plain HTTP as an operator does, and times `--requests` sequential requests of each
   page (send to the last byte of the answer). Back-to-back requests mostly share the
   figures the process keeps for a while (the overview's reading for 2 s and the metrics'
   ledger snapshot under it for 5 s, a run's progress for 2 s, a drained run's for 60 s),
   so the pages built on them (overview, overview/live, runs, a run) are then requested
   `--cold-requests` more times 5.1 s apart, when nothing is left to share: what an
   operator who opens the page, rather than polls it, waits. Last, one round with
   `--viewers` concurrent signed-in clients on the overview (`--requests` in all).
3. For each page whose p95 misses the target in any repetition, warm or cold (every page
   with `--explain all`): the statements the page runs, each prepared and executed as the
   service does, its plan logged by auto_explain (ANALYZE, BUFFERS) under plan_cache_mode
   force_custom_plan, force_generic_plan and auto after five executions (what a pooled
   connection settles on), with the execution time of each.

Reported per page: p50, p95 and max over the requests (ms), medians of the repetitions with
their ranges; the first request of the page in a fresh process; the cold requests' p50,
p95 and max; the server process's and PostgreSQL's CPU per request.

    python -m bench console --items 1000000 --requests 200 --viewers 8 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlencode

import asyncpg
import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.common import (
    BenchContext,
    Benchmark,
    backend_cpu,
    cpu_seconds,
    cpu_spent,
    fresh_database,
    plain_url,
    progress,
    summarize,
    vacuum_analyze,
)
from bench.server import TOKEN, sweeper_server
from service.budget import scope_controls
from service.db.statements import Statement
from service.history import minutes
from service.http.api.items import MAX_CHANGE
from service.http.console.overview import CHART_MAX_AGE_S, OVERVIEW_MAX_AGE_S, RECENT_RUNS
from service.http.console.pages import PAGE_SIZE
from service.ledger import gauges, item_selection, operator_reads
from service.runs import progress as run_progress

TARGET_P95_MS: Final = 200.0
SEED_CHUNK: Final = 250_000
BATCH: Final = 500  # items per batch, the service's default batch_size
UNPUBLISHED_SHARE: Final = 0.03  # the newest items: registered, no run has released them
RECENT_SHARE: Final = 0.10  # the newest published items: their runs are still draining
DRY_RUN_EVERY: Final = 10  # one run in ten is report-only
HORIZON_DAYS: Final = 20  # items were registered over this many days before the run
PAGE_SECONDS_DEFAULT: Final = 120.0
# Pages whose figures the process shares between requests: the overview (its own reading,
# and the metrics' ledger snapshot under it), run progress and the charts' readings. A
# request after the longest of those ages finds nothing to share (a drained run's
# progress, 60 s, aside).
CACHED_PAGES: Final = ("overview", "overview-live", "runs", "run", "chart-outcomes-hour",
                       "chart-outcomes-week", "chart-backlog-week", "chart-scope-week",
                       "chart-run")
COLD_GAP_S: Final = max(OVERVIEW_MAX_AGE_S, run_progress.PROGRESS_MAX_AGE_S,
                        gauges.LEDGER_CACHE_S, CHART_MAX_AGE_S) + 0.1
# policy, share of the runs (and of the unpublished items)
POLICIES: Final = (("carts", 0.50), ("sessions", 0.25), ("uploads", 0.15), ("exports", 0.10))
POLICIES_TOML: Final = """
[upstreams.shop]
base_url = "http://127.0.0.1:9"
timeout_seconds = 5
""" + "".join(f"""
[policies.{name}]
version = 1
upstream = "shop"
path = "/{name}/{{object_id}}"
scope = "tenant:{{tenant_id}}"
rate = {{ per_second = 50, burst = 50 }}
lease_seconds = 30
""" for name, _ in POLICIES)
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=int, default=1_000_000,
                        help="items in the ledger (default 1000000)")
    parser.add_argument("--tenants", type=int, default=1_000,
                        help="tenants, skewed (default 1000; at most items/20)")
    parser.add_argument("--runs", type=int, default=300,
                        help="runs, one in ten report-only (default 300; at most items/100)")
    parser.add_argument("--large-run-items", type=int, default=50_000,
                        help="items of the run whose page is timed (default 50000; at most "
                             "a fifth of the published items)")
    parser.add_argument("--webhooks", type=int, default=20_000,
                        help="webhook receipts, over the last three days (default 20000)")
    parser.add_argument("--actions", type=int, default=2_000,
                        help="operator actions in the audit trail (default 2000)")
    parser.add_argument("--requests", type=int, default=200,
                        help="sequential requests per page and repetition (default 200)")
    parser.add_argument("--viewers", type=int, default=8,
                        help="concurrent clients of the overview round (default 8)")
    parser.add_argument("--page-seconds", type=float, default=PAGE_SECONDS_DEFAULT,
                        help="stop timing one page after this long, with fewer requests "
                             f"(default {PAGE_SECONDS_DEFAULT:.0f})")
    parser.add_argument("--cold-requests", type=int, default=10,
                        help="requests of each page with shared figures (overview, runs, a "
                             f"run) made {COLD_GAP_S:.1f} s apart, when nothing is left to "
                             "share (default 10; 0: none)")
    parser.add_argument("--explain", choices=("misses", "all", "none"), default="misses",
                        help="explain the statements of the pages that miss the target in "
                             "any repetition (default), of every page, or of none")


# -- the ledger ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    id: int
    policy: str
    dry_run: bool
    first_id: int  # its items' ids (none for a report-only run)
    last_id: int
    first_batch: int
    cutoff: datetime

    @property
    def size(self) -> int:
        return 0 if self.dry_run else self.last_id - self.first_id + 1


@dataclass
class Layout:
    """Where the seeded rows go: the runs with their id ranges, and the clock."""

    items: int
    published: int  # ids 1..published belong to runs; the rest are unpublished
    tenants: int
    t0: datetime
    runs: list[Run]
    large_run: int

    def created(self, item_id: int) -> datetime:
        return self.t0 - timedelta(days=HORIZON_DAYS) + item_id * self.step

    @property
    def step(self) -> timedelta:
        return timedelta(days=HORIZON_DAYS) / self.items

    @property
    def real_runs(self) -> list[Run]:
        return [r for r in self.runs if not r.dry_run]


def plan_layout(items: int, tenants: int, run_count: int, large_run_items: int) -> Layout:
    """The runs (in time order, ids from 1) and their id ranges; deterministic."""
    rng = random.Random(24)
    published = items - max(1, round(items * UNPUBLISHED_SHARE))
    total = max(3, min(run_count, published // 100))
    dry = {i for i in range(total) if i % DRY_RUN_EVERY == DRY_RUN_EVERY // 2}
    real = total - len(dry)
    large_at = max(0, real - 10)  # among the newest runs: still draining
    large = max(1, min(large_run_items, published // 5))
    weights = [rng.uniform(0.5, 1.5) for _ in range(real)]
    rest_weight = sum(w for i, w in enumerate(weights) if i != large_at)
    rest = published - large
    sizes = [large if i == large_at else max(1, math.floor(rest * w / rest_weight))
             for i, w in enumerate(weights)]
    sizes[-1 if large_at != real - 1 else 0] += published - sum(sizes)
    names = [name for name, _ in POLICIES]
    shares = [share for _, share in POLICIES]
    t0 = datetime.now(UTC).replace(microsecond=0)
    layout = Layout(items, published, max(1, min(tenants, items // 20)), t0, [], 0)
    next_id, next_batch, k = 1, 1, 0
    for i in range(total):
        policy = rng.choices(names, shares)[0]
        if i in dry:
            last = layout.runs[-1].cutoff if layout.runs else layout.created(1)
            layout.runs.append(Run(i + 1, policy, True, 0, -1, 0, last + timedelta(minutes=5)))
            continue
        size = sizes[k]
        last_id = next_id + size - 1
        cutoff = layout.created(last_id) + timedelta(hours=1, minutes=1)
        layout.runs.append(Run(i + 1, policy, False, next_id, last_id, next_batch, cutoff))
        if k == large_at:
            layout.large_run = i + 1
        next_id, next_batch, k = last_id + 1, next_batch + math.ceil(size / BATCH), k + 1
    return layout


_SEED_RUNS = text("""
    INSERT INTO runs (id, request_digest, policy, cutoff, dry_run, state, candidates, released,
                      batches, remaining, oldest_due_at, newest_due_at, report, created_at,
                      published_at)
    OVERRIDING SYSTEM VALUE
    VALUES (:id, :digest, :policy, CAST(:cutoff AS timestamptz), :dry_run, 'published',
            :candidates, :released, :batches, 0, :oldest, :newest, CAST(:report AS jsonb),
            CAST(:cutoff AS timestamptz), CAST(:cutoff AS timestamptz) + interval '1 minute')
""")
_SEED_BATCHES = text("""
    INSERT INTO batches (id, run_id, seq, digest, policy, policy_version, item_count,
                         created_at)
    OVERRIDING SYSTEM VALUE
    SELECT CAST(:first_batch AS bigint) + s, CAST(:run_id AS bigint), s,
           encode(sha256(CAST('bench-batch-' || :run_id || '-' || s AS bytea)), 'hex'),
           :policy, 1, least(:batch, CAST(:size AS bigint) - s * :batch),
           CAST(:released AS timestamptz)
    FROM generate_series(0, (CAST(:size AS bigint) - 1) / :batch) AS s
""")

# Items :lo..:hi. Hash-derived uniforms (u1 tenant, u2 policy of the unpublished, u3 status,
# u4 a second attempt and the completion delay) keep the layout the same on every seeding.
# The run of an id: width_bucket over the runs' first ids (the last bound is the first
# unpublished id). Tenant k of T holds ((k+1)^(1/3) - k^(1/3)) / T^(1/3) of the items.
_SEED_ITEMS = text("""
    INSERT INTO items (id, tenant_id, object_id, policy, policy_version, operation_key, scope,
                       status, due_at, next_attempt_at, attempts, released_at, batch_id,
                       lease_owner, lease_token, lease_expires_at, last_outcome,
                       last_status_code, dead_reason, created_at, updated_at, completed_at)
    OVERRIDING SYSTEM VALUE
    SELECT g, t.tenant, 'obj-' || g, r.policy, 1,
           encode(sha256(CAST('bench-item-' || g AS bytea)), 'hex'), 'tenant:' || t.tenant,
           -- a leased item is pending with a lease (migration 0024)
           CASE WHEN s.status = 'leased' THEN 'pending' ELSE s.status END,
           c.created + interval '1 hour', '-infinity',
           CASE s.status WHEN 'succeeded' THEN 1 + CAST(h.u4 < 0.1 AS int)
                         WHEN 'dead' THEN 2 WHEN 'leased' THEN 1 ELSE 0 END,
           r.released, r.batch,
           CASE WHEN s.status = 'leased' THEN 'bench-worker' END,
           CASE WHEN s.status = 'leased' THEN gen_random_uuid() END,
           CASE WHEN s.status = 'leased' THEN CAST(:t0 AS timestamptz) + interval '1 day' END,
           CASE s.status WHEN 'succeeded' THEN 'succeeded' WHEN 'dead' THEN 'permanent' END,
           CASE s.status WHEN 'succeeded' THEN 204 WHEN 'dead' THEN 410 END,
           CASE WHEN s.status = 'dead' THEN 'permanent:410' END,
           c.created, coalesce(d.done, r.released, c.created), d.done
    FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g
    CROSS JOIN LATERAL (
        SELECT CAST((hashint8(g) & 2147483647) AS float8) / 2147483648 AS u1,
               CAST((hashint8(g + 1000003) & 2147483647) AS float8) / 2147483648 AS u2,
               CAST((hashint8(-g) & 2147483647) AS float8) / 2147483648 AS u3,
               CAST((hashint8(g * 7 + 5) & 2147483647) AS float8) / 2147483648 AS u4,
               width_bucket(g, CAST(:starts AS bigint[])) AS k
    ) h
    CROSS JOIN LATERAL (
        SELECT 'tenant-' || lpad(CAST(floor(:tenants * h.u1 ^ 3) AS int)::text, 4, '0')
               AS tenant
    ) t
    CROSS JOIN LATERAL (
        SELECT CAST(:t0 AS timestamptz) - make_interval(days => :horizon)
               + make_interval(secs => g * CAST(:step_s AS float8)) AS created
    ) c
    CROSS JOIN LATERAL (
        SELECT CASE WHEN h.k <= :nruns THEN (CAST(:run_policy AS text[]))[h.k]
                    ELSE (CAST(:policies AS text[]))[
                             width_bucket(h.u2, CAST(:policy_bounds AS float8[]))] END AS policy,
               CASE WHEN h.k <= :nruns THEN (CAST(:run_released AS timestamptz[]))[h.k] END
                   AS released,
               CASE WHEN h.k <= :nruns THEN (CAST(:run_batch AS bigint[]))[h.k]
                        + (g - (CAST(:starts AS bigint[]))[h.k]) / :batch END AS batch
    ) r
    CROSS JOIN LATERAL (
        SELECT CASE WHEN h.k > :nruns THEN 'pending'
                    WHEN g > :recent_from THEN
                        CASE WHEN h.u3 < 0.40 THEN 'pending' WHEN h.u3 < 0.45 THEN 'leased'
                             WHEN h.u3 < 0.48 THEN 'dead' WHEN h.u3 < 0.50 THEN 'cancelled'
                             ELSE 'succeeded' END
                    ELSE CASE WHEN h.u3 < 0.025 THEN 'dead' WHEN h.u3 < 0.05 THEN 'cancelled'
                              ELSE 'succeeded' END
               END AS status
    ) s
    CROSS JOIN LATERAL (
        SELECT CASE WHEN s.status IN ('succeeded', 'dead', 'cancelled')
                    THEN least(r.released + make_interval(secs => 7200 * h.u4),
                               CAST(:t0 AS timestamptz)) END AS done
    ) d
""")
# One attempt per finished item, two for a tenth of the succeeded (a 503 first) and for the
# dead (a 503, then the 410 that killed it).
_SEED_ATTEMPTS = text("""
    INSERT INTO attempts (item_id, attempt_no, worker, lease_token, started_at, finished_at,
                          outcome, http_status, latency_ms)
    SELECT i.id, a.n, 'bench-worker', gen_random_uuid(),
           i.completed_at - make_interval(secs => 60 * (i.attempts - a.n) + 0.05),
           i.completed_at - make_interval(secs => 60 * (i.attempts - a.n)),
           CASE WHEN a.n < i.attempts THEN 'transient' ELSE i.last_outcome END,
           CASE WHEN a.n < i.attempts THEN 503 ELSE i.last_status_code END, 50.0
    FROM items i CROSS JOIN LATERAL generate_series(1, i.attempts) AS a(n)
    WHERE i.id BETWEEN :lo AND :hi AND i.status IN ('succeeded', 'dead')
""")
_SEED_SCOPES = text("""
    INSERT INTO scopes (name, rate_per_second, burst, tokens, paused, paused_reason,
                        closed_until, closed_reason, backoff_level)
    SELECT name, 50, 50, 50, n % 97 = 3, CASE WHEN n % 97 = 3 THEN 'bench: paused' END,
           CASE WHEN n % 89 = 7 THEN CAST(:t0 AS timestamptz) + interval '1 day' END,
           CASE WHEN n % 89 = 7 THEN 'throttled' END, CASE WHEN n % 89 = 7 THEN 1 ELSE 0 END
    FROM (SELECT name, row_number() OVER (ORDER BY name) AS n
          FROM (SELECT DISTINCT scope AS name FROM items) d) s
""")
_SEED_RECEIPTS = text("""
    INSERT INTO webhook_receipts (source, webhook_id, event_type, result, item_ids,
                                  received_at)
    SELECT CASE WHEN g % 3 = 0 THEN 'billing' ELSE 'store' END, 'wh-' || g,
           'orders/cancelled', CASE WHEN g % 10 = 0 THEN 'ignored' ELSE 'applied' END,
           CASE WHEN g % 10 = 0 THEN CAST('{}' AS bigint[])
                ELSE ARRAY[1 + (hashint8(g) & 2147483647) % CAST(:items AS bigint)] END,
           CAST(:t0 AS timestamptz) - make_interval(secs => 259200.0 * (:n - g) / :n)
    FROM generate_series(1, CAST(:n AS bigint)) AS g
""")
_SEED_ACTIONS = text("""
    INSERT INTO operator_actions (at, actor, action, reason, details)
    SELECT CAST(:t0 AS timestamptz) - make_interval(secs => 1728000.0 * (:n - g) / :n),
           'token:bench' || g % 7 || ' (console)',
           (ARRAY['redrive', 'cancel', 'scope.pause', 'scope.resume', 'scope.budget'])[1 + g % 5],
           'bench: seeded', jsonb_build_object('count', g % 100, 'filter',
               jsonb_build_object('tenant_id', 'tenant-' || lpad((g % 1000)::text, 4, '0')))
    FROM generate_series(1, CAST(:n AS bigint)) AS g
""")
# A week of the ledger's minutes (service/history/), as a busy service leaves them: every
# policy every minute (outcomes and the sampled backlog), 50 scopes a minute (the big
# tenant's in each), three minutes for each batch from its release.
_SEED_POLICY_MINUTES = text("""
    INSERT INTO policy_minutes (minute, policy, succeeded, throttled, transient, unknown,
                                dead, reclaimed, closures, eligible, oldest_eligible_s)
    SELECT date_trunc('minute', CAST(:t0 AS timestamptz)) - make_interval(mins => m), p,
           600 + m % 300, m % 7, m % 5, m % 11 / 10, m % 13 / 12, m % 17 / 16, m % 7 / 6,
           5000 + (m * 37) % 4000, 60.0 + m % 600
    FROM generate_series(0, 10079) AS m CROSS JOIN unnest(CAST(:policies AS text[])) AS p
""")
_SEED_SCOPE_MINUTES = text("""
    INSERT INTO scope_minutes (scope, minute, policy, calls, succeeded, throttled, closures,
                               reclaimed)
    SELECT 'tenant:tenant-' || lpad((CASE WHEN k = 0 THEN 0
                                          ELSE (m * 7 + k * 20) % :tenants END)::text, 4, '0'),
           date_trunc('minute', CAST(:t0 AS timestamptz)) - make_interval(mins => m), 'carts',
           60 + k, 58 + k, m % 3, m % 7 / 6, 0
    FROM generate_series(0, 10079) AS m CROSS JOIN generate_series(0, 49) AS k
    ON CONFLICT DO NOTHING
""")
_SEED_BATCH_MINUTES = text("""
    INSERT INTO batch_minutes (batch_id, minute, succeeded, dead, skipped)
    SELECT b.id, date_trunc('minute', b.created_at) + make_interval(mins => k),
           b.item_count / 3, 0, 0
    FROM batches b CROSS JOIN generate_series(0, 2) AS k
""")
_SET_IDENTITIES = text("""
    SELECT setval(pg_get_serial_sequence('items', 'id'), CAST(:items AS bigint)),
           setval(pg_get_serial_sequence('runs', 'id'), CAST(:runs AS bigint)),
           setval(pg_get_serial_sequence('batches', 'id'), CAST(:batches AS bigint))
""")
_COUNTS = text("SELECT status, count(*) AS n FROM items GROUP BY status ORDER BY status")
_SIZES = text("""
    SELECT c.relname, pg_relation_size(c.oid) AS bytes
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'i')
      AND pg_relation_size(c.oid) > 1048576
    ORDER BY c.relname
""")
SEEDED_TABLES: Final = ("items", "attempts", "runs", "batches", "scopes", "webhook_receipts",
                        "operator_actions", "policy_minutes", "scope_minutes",
                        "batch_minutes")


async def seed(engine: AsyncEngine, layout: Layout, webhooks: int, actions: int
               ) -> dict[str, Any]:
    started = time.perf_counter()
    real = layout.real_runs
    async with engine.begin() as conn:
        for run in layout.runs:
            first_due = layout.created(run.first_id) + timedelta(hours=1)
            last_due = layout.created(run.last_id) + timedelta(hours=1)
            candidates = run.size or 1_000
            report = json.dumps({"policies": {run.policy: {"candidates": candidates,
                                                           "held": 0}}})
            await conn.execute(_SEED_RUNS, {
                "id": run.id, "digest": f"{run.id:064x}", "policy": run.policy,
                "cutoff": run.cutoff, "dry_run": run.dry_run,
                "candidates": candidates, "released": run.size,
                "batches": math.ceil(run.size / BATCH),
                "oldest": None if run.dry_run else first_due,
                "newest": None if run.dry_run else last_due, "report": report})
        for run in real:
            await conn.execute(_SEED_BATCHES, {
                "first_batch": run.first_batch, "run_id": run.id, "policy": run.policy,
                "size": run.size, "batch": BATCH,
                "released": run.cutoff + timedelta(seconds=30)})
    params = {
        "t0": layout.t0, "horizon": HORIZON_DAYS, "tenants": layout.tenants,
        "step_s": layout.step.total_seconds(), "nruns": len(real), "batch": BATCH,
        "starts": [r.first_id for r in real] + [layout.published + 1],
        "run_policy": [r.policy for r in real],
        "run_released": [r.cutoff + timedelta(seconds=30) for r in real],
        "run_batch": [r.first_batch for r in real],
        "policies": [name for name, _ in POLICIES],
        "policy_bounds": list(_bounds([share for _, share in POLICIES])),
        "recent_from": math.floor(layout.published * (1 - RECENT_SHARE)),
    }
    for lo in range(1, layout.items + 1, SEED_CHUNK):
        hi = min(layout.items, lo + SEED_CHUNK - 1)
        async with engine.begin() as conn:
            await conn.execute(_SEED_ITEMS, {**params, "lo": lo, "hi": hi})
            await conn.execute(_SEED_ATTEMPTS, {"lo": lo, "hi": hi})
        if layout.items > SEED_CHUNK:
            progress(f"console: seeded {hi:,} of {layout.items:,} items")
    batches = sum(math.ceil(r.size / BATCH) for r in real)
    async with engine.begin() as conn:
        await conn.execute(_SEED_SCOPES, {"t0": layout.t0})
        await conn.execute(_SEED_RECEIPTS, {"t0": layout.t0, "n": webhooks,
                                            "items": layout.items})
        await conn.execute(_SEED_ACTIONS, {"t0": layout.t0, "n": actions})
        await conn.execute(_SEED_POLICY_MINUTES, {"t0": layout.t0,
                                                  "policies": [p for p, _ in POLICIES]})
        await conn.execute(_SEED_SCOPE_MINUTES, {"t0": layout.t0, "tenants": layout.tenants})
        await conn.execute(_SEED_BATCH_MINUTES)
        await conn.execute(_SET_IDENTITIES, {"items": layout.items, "runs": len(layout.runs),
                                             "batches": batches})
    inserted = time.perf_counter()
    for table in SEEDED_TABLES:
        await vacuum_analyze(engine, table)
    async with engine.connect() as conn:
        statuses = {str(r.status): int(r.n) for r in await conn.execute(_COUNTS)}
        counts = {t: int((await conn.execute(text(f"SELECT count(*) FROM {t}"))
                          ).scalar_one()) for t in SEEDED_TABLES if t != "items"}
        sizes = {str(r.relname): int(r.bytes) for r in await conn.execute(_SIZES)}
    return {"items": layout.items, "items_by_status": statuses, "rows": counts,
            "runs": len(layout.runs), "report_only_runs": len(layout.runs) - len(real),
            "batches": batches, "published_items": layout.published,
            "insert_seconds": round(inserted - started, 1),
            "vacuum_analyze_seconds": round(time.perf_counter() - inserted, 1),
            "relation_bytes_over_1mb": sizes}


def _bounds(shares: Sequence[float]) -> list[float]:
    """Lower bounds of each share's interval in [0, 1) (width_bucket's thresholds)."""
    bounds, total = [], 0.0
    for share in shares:
        bounds.append(total)
        total += share
    return bounds


# -- what the pages are about ------------------------------------------------------------------


@dataclass
class Facts:
    """The rows the timed pages name, found after seeding."""

    large_run: int
    large_run_items: int
    newest_runs: list[int]
    big_tenant: str
    big_tenant_items: int
    small_tenant: str
    small_tenant_items: int
    object_id: str
    pending_policy: str
    dead_item: int
    dead_item_attempts: int

    def doc(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "newest_runs"}


async def find_facts(engine: AsyncEngine, layout: Layout) -> Facts:
    async with engine.connect() as conn:
        async def one(sql: str, **params: Any) -> Any:
            return (await conn.execute(text(sql), params)).one()

        tenants = (await conn.execute(text(
            "SELECT tenant_id, count(*) AS n FROM items GROUP BY tenant_id "
            "ORDER BY n DESC, tenant_id"))).all()
        big, small = tenants[0], tenants[len(tenants) * 3 // 4]
        obj = await one("SELECT object_id FROM items WHERE tenant_id = :t AND id >= :mid "
                        "ORDER BY id LIMIT 1", t=big.tenant_id, mid=layout.items // 2)
        dead = await one("SELECT id, attempts FROM items WHERE status = 'dead' "
                         "AND id >= :mid ORDER BY id LIMIT 1", mid=layout.items // 2)
        newest = [int(r.id) for r in await conn.execute(text(
            "SELECT id FROM runs ORDER BY id DESC LIMIT :n"), {"n": PAGE_SIZE})]
    large = next(r for r in layout.runs if r.id == layout.large_run)
    return Facts(large_run=large.id, large_run_items=large.size, newest_runs=newest,
                 big_tenant=str(big.tenant_id), big_tenant_items=int(big.n),
                 small_tenant=str(small.tenant_id), small_tenant_items=int(small.n),
                 object_id=str(obj.object_id),
                 pending_policy=POLICIES[-1][0],  # the least common policy
                 dead_item=int(dead.id), dead_item_attempts=int(dead.attempts))


@dataclass(frozen=True)
class Page:
    name: str
    path: str
    form: dict[str, str] | None = None  # a POST with the session's CSRF token added
    statements: list[tuple[Statement, dict[str, Any]]] = field(default_factory=list)

    @property
    def method(self) -> str:
        return "GET" if self.form is None else "POST"


def _items_params(status: str | None = None, policy: str | None = None,
                  tenant: str | None = None, obj: str | None = None) -> dict[str, Any]:
    return {"status": status, "after": None, "limit": PAGE_SIZE,
            **item_selection.filter_params(item_selection.ItemFilter(
                policy=policy, tenant_id=tenant, object_id=obj))}


def pages(f: Facts) -> list[Page]:
    """The timed pages, each with the statements it runs (as the service sends them)."""
    ledger_reading: list[tuple[Statement, dict[str, Any]]] = [
        (s, {}) for s in (gauges._LEDGER_ELIGIBLE, gauges._LEDGER_DEAD, gauges._LEDGER_HELD,
                          gauges._LEDGER_HOLDS, gauges._LEDGER_SCOPES)]
    overview = [*ledger_reading,
                (operator_reads._SUCCEEDED_RECENTLY,
                 {"window": operator_reads.THROUGHPUT_WINDOW_S}),
                (run_progress._LIST, _runs_params(RECENT_RUNS)),
                (run_progress._ITEM_PROGRESS, {"ids": f.newest_runs[:RECENT_RUNS]}),
                (operator_reads._TROUBLED_SCOPES, {})]
    scope_name = f"tenant:{f.big_tenant}"
    return [*_chart_pages(f, scope_name),
        Page("overview", "/console", statements=overview),
        Page("overview-live", "/console/overview/live", statements=overview),
        Page("runs", "/console/runs", statements=[
            (run_progress._LIST, _runs_params(PAGE_SIZE)),
            (run_progress._ITEM_PROGRESS, {"ids": f.newest_runs[:PAGE_SIZE]})]),
        Page("run", f"/console/runs/{f.large_run}", statements=[
            (run_progress._RUN, {"id": f.large_run}),
            (run_progress._PROGRESS, {"ids": [f.large_run]})]),
        Page("items", "/console/items", statements=[(item_selection._LIST, _items_params())]),
        Page("items-dead", "/console/items?status=dead",
             statements=[(item_selection._LIST, _items_params("dead"))]),
        Page("items-pending", "/console/items?status=pending",
             statements=[(item_selection._LIST, _items_params("pending"))]),
        Page("items-pending-policy",
             f"/console/items?status=pending&policy={f.pending_policy}",
             statements=[(item_selection._LIST, _items_params("pending", f.pending_policy))]),
        Page("items-big-tenant", f"/console/items?tenant_id={f.big_tenant}",
             statements=[(item_selection._LIST, _items_params(tenant=f.big_tenant))]),
        Page("items-small-tenant", f"/console/items?tenant_id={f.small_tenant}",
             statements=[(item_selection._LIST, _items_params(tenant=f.small_tenant))]),
        Page("items-tenant-object",
             f"/console/items?tenant_id={f.big_tenant}&object_id={f.object_id}",
             statements=[(item_selection._LIST, _items_params(tenant=f.big_tenant,
                                                              obj=f.object_id))]),
        Page("item", f"/console/items/{f.dead_item}", statements=[
            (operator_reads._ITEM, {"id": f.dead_item}),
            (operator_reads._ATTEMPTS, {"id": f.dead_item})]),
        Page("scopes", "/console/scopes", statements=[
            (scope_controls._LIST, {"after": None, "name": None, "limit": PAGE_SIZE}),
            (scope_controls._WORKERS_STATE, {})]),
        Page("scope", "/console/scope?" + urlencode({"name": scope_name}),
             statements=[(scope_controls._LIST, {"after": None, "name": scope_name, "limit": 1})]),
        Page("webhooks", "/console/webhooks", statements=[
            (operator_reads._RECEIPTS, {"source": None, "result": None, "before": None,
                                        "limit": PAGE_SIZE}),
            (operator_reads._RECEIPT_COUNTS, {})]),
        Page("audit", "/console/audit", statements=[
            (operator_reads._ACTIONS, {"before": None, "limit": PAGE_SIZE})]),
        Page("redrive-preview", "/console/items/action", form={
            "action": "redrive", "target": "filter", "why": "bench: preview only",
            "step": "preview", "policy": POLICIES[0][0], "tenant_id": f.big_tenant},
             statements=[(operator_reads._SELECTION_SIZE, {
                 "status": "dead", "cap": MAX_CHANGE,
                 **item_selection.filter_params(item_selection.ItemFilter(
                     policy=POLICIES[0][0], tenant_id=f.big_tenant))})]),
    ]


def _chart_pages(f: Facts, scope_name: str) -> list[Page]:
    """The console's charts, each over its longest window (a week: 168 hourly buckets)."""
    now = time.time()

    def window(name: str, **params: Any) -> dict[str, Any]:
        bucket_s, starts = minutes.window(name, now)
        return {"since": starts[0], "bucket_s": bucket_s, **params}

    return [
        Page("chart-outcomes-hour", "/console/charts/outcomes?window=hour",
             statements=[(minutes._POLICY_TOTALS, window("hour", policy=None))]),
        Page("chart-outcomes-week", "/console/charts/outcomes?window=week",
             statements=[(minutes._POLICY_TOTALS, window("week", policy=None))]),
        Page("chart-backlog-week", "/console/charts/backlog?window=week",
             statements=[(minutes._BACKLOG, window("week"))]),
        Page("chart-scope-week", "/console/charts/scope?" + urlencode(
            {"name": scope_name, "window": "week"}), statements=[
                (scope_controls._LIST, {"after": None, "name": scope_name, "limit": 1}),
                (minutes._SCOPE, window("week", scope=scope_name))]),
        Page("chart-run", f"/console/charts/runs/{f.large_run}", statements=[
            (run_progress._RUN, {"id": f.large_run}),
            (run_progress._PROGRESS, {"ids": [f.large_run]}),
            (minutes._RUN, window("week", run_id=f.large_run))]),
    ]


def _runs_params(limit: int) -> dict[str, Any]:
    return {"before": None, "limit": limit, "policy": None, "state": None, "dry_run": None}


# -- timing ----------------------------------------------------------------------------------


async def signed_in(base_url: str) -> tuple[httpx.AsyncClient, str]:
    """A client holding a console session (signed in through the form) and its CSRF."""
    client = httpx.AsyncClient(base_url=base_url, timeout=120)
    try:
        form = await client.get("/console/sign-in")
        found = CSRF.search(form.text)
        if found is None:
            raise RuntimeError(f"no sign-in form: {form.status_code}")
        answer = await client.post("/console/sign-in",
                                   data={"csrf": found.group(1), "token": TOKEN})
        if answer.status_code != 303 or answer.headers.get("location") != "/console":
            raise RuntimeError(f"sign-in refused: {answer.status_code}")
        overview = await client.get("/console")
        token = CSRF.search(overview.text)
        if overview.status_code != 200 or token is None:
            raise RuntimeError(f"signed in, but the overview answered {overview.status_code}")
    except BaseException:
        await client.aclose()
        raise
    return client, token.group(1)


def percentile(ms: Sequence[float], p: float) -> float | None:
    """Nearest rank on sorted values (as the webhooks benchmark reports)."""
    return round(ms[min(len(ms) - 1, int(p * len(ms)))], 2) if ms else None


def latency(ms: list[float]) -> dict[str, float | None]:
    ordered = sorted(ms)
    return {"p50": percentile(ordered, 0.50), "p95": percentile(ordered, 0.95),
            "max": round(ordered[-1], 2) if ordered else None,
            "mean": round(statistics.fmean(ordered), 2) if ordered else None}


async def one_request(client: httpx.AsyncClient, page: Page, csrf: str
                      ) -> tuple[float, int, str]:
    started = time.perf_counter()
    if page.form is None:
        answer = await client.get(page.path)
    else:
        answer = await client.post(page.path, data={"csrf": csrf, **page.form})
    elapsed = (time.perf_counter() - started) * 1000
    return elapsed, answer.status_code, answer.text


async def time_page(client: httpx.AsyncClient, csrf: str, page: Page, requests: int,
                    budget_s: float, db_url: str, db_name: str, pid: int) -> dict[str, Any]:
    ms: list[float] = []
    statuses: dict[str, int] = {}
    problem = None
    cpu_before, db_before = cpu_seconds(pid), await backend_cpu(db_url, db_name)
    started = time.perf_counter()
    for _ in range(requests):
        elapsed, status, body = await one_request(client, page, csrf)
        ms.append(elapsed)
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if status != 200 and problem is None:
            problem = body[:500]
        if time.perf_counter() - started > budget_s:
            break
    server_cpu = cpu_seconds(pid) - cpu_before
    db_cpu = cpu_spent(db_before, await backend_cpu(db_url, db_name))
    n = len(ms)
    return {"requests": n, "statuses": statuses, **latency(ms), "first": round(ms[0], 2),
            "server_cpu_ms_per_request": round(server_cpu * 1000 / n, 2),
            "postgres_cpu_ms_per_request": round(db_cpu * 1000 / n, 2)
            if db_cpu is not None else None,
            "stopped_early": n < requests, **({"first_error": problem} if problem else {})}


async def time_cold(client: httpx.AsyncClient, csrf: str, page: Page, requests: int
                    ) -> dict[str, Any]:
    """Requests COLD_GAP_S apart: each finds the process's shared figures expired."""
    ms: list[float] = []
    statuses: dict[str, int] = {}
    for _ in range(requests):
        await asyncio.sleep(COLD_GAP_S)
        elapsed, status, _body = await one_request(client, page, csrf)
        ms.append(elapsed)
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {"requests": len(ms), "gap_s": COLD_GAP_S, "statuses": statuses, **latency(ms)}


async def viewers_round(base_url: str, viewers: int, requests: int) -> dict[str, Any]:
    """`viewers` signed-in clients polling the overview at once, `requests` in all."""
    clients = [await signed_in(base_url) for _ in range(viewers)]
    each = max(1, math.ceil(requests / viewers))
    ms: list[float] = []
    statuses: dict[str, int] = {}
    overview = Page("overview", "/console")

    async def viewer(client: httpx.AsyncClient, csrf: str) -> None:
        for _ in range(each):
            elapsed, status, _body = await one_request(client, overview, csrf)
            ms.append(elapsed)
            statuses[str(status)] = statuses.get(str(status), 0) + 1

    started = time.perf_counter()
    try:
        await asyncio.gather(*(viewer(c, t) for c, t in clients))
    finally:
        for client, _ in clients:
            await client.aclose()
    seconds = time.perf_counter() - started
    return {"viewers": viewers, "requests": len(ms), "statuses": statuses, **latency(ms),
            "pages_per_s": round(len(ms) / seconds, 1)}


async def repetition(db_url: str, db_name: str, page_list: list[Page],
                     args: argparse.Namespace, label: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sweeper-bench-console-") as tmp:
        policies = Path(tmp) / "policies.toml"
        policies.write_text(POLICIES_TOML, encoding="utf-8")
        env = {"SWEEPER_POLICIES_FILE": str(policies), "SWEEPER_RETENTION_DAYS": "0"}
        async with sweeper_server(db_url, workers=0, extra_env=env) as server:
            load = os.getloadavg()[0]
            client, csrf = await signed_in(server.base_url)
            results: dict[str, Any] = {}
            try:
                for page in page_list:
                    results[page.name] = await time_page(
                        client, csrf, page, args.requests, args.page_seconds, db_url,
                        db_name, server.pid)
                    r = results[page.name]
                    progress(f"console {label} {page.name:<20} p50 {r['p50']:>8} ms  "
                             f"p95 {r['p95']:>8} ms  max {r['max']:>8} ms  first "
                             f"{r['first']:>8} ms  {r['statuses']}")
                if args.cold_requests > 0:
                    for page in page_list:
                        if page.name not in CACHED_PAGES:
                            continue
                        cold = await time_cold(client, csrf, page, args.cold_requests)
                        results[page.name]["cold"] = cold
                        progress(f"console {label} {page.name:<20} cold: p50 {cold['p50']} ms"
                                 f"  p95 {cold['p95']} ms  max {cold['max']} ms  "
                                 f"{cold['statuses']}")
            finally:
                await client.aclose()
            crowd = await viewers_round(server.base_url, args.viewers, args.requests)
            progress(f"console {label} overview x{args.viewers} viewers: p50 {crowd['p50']} ms"
                     f"  p95 {crowd['p95']} ms  max {crowd['max']} ms  {crowd['statuses']}")
    return {"load_average_1m_at_start": round(load, 2), "pages": results,
            "viewers": crowd}


# -- EXPLAIN -----------------------------------------------------------------------------------

_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")  # SQLAlchemy text()'s own bind pattern
_DURATION = re.compile(r"duration: ([0-9.]+) ms")
AUTO_EXPLAIN: Final = (
    "LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
    "SET auto_explain.log_analyze = on", "SET auto_explain.log_buffers = on",
    "SET auto_explain.log_timing = on", "SET auto_explain.log_level = notice",
    "SET client_min_messages = notice")


def positional(sql: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
    """`:name` parameters as asyncpg's `$n` (one number per name, as SQLAlchemy sends)."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}"

    return _BIND.sub(number, sql), [params[name] for name in order]


def _plan_of(message: str, sql: str) -> tuple[float | None, list[str]]:
    found = _DURATION.search(message)
    body = message.split("plan:\n", 1)[-1]
    head = "Query Text: " + sql
    if body.startswith(head):
        body = body[len(head):]
    return (float(found.group(1)) if found else None,
            [line for line in body.strip("\n").splitlines() if line.strip()])


async def explain_statement(db_url: str, statement: Statement, params: dict[str, Any]
                            ) -> dict[str, Any]:
    """The statement prepared and executed as the service sends it, its plans from
    auto_explain (ANALYZE, BUFFERS): custom, generic, and the one a session settles on
    after five executions (plan_cache_mode auto)."""
    sql, values = positional(statement.sql, params)
    doc: dict[str, Any] = {"statement": statement.name, "summary": statement.summary,
                           "params": {k: v for k, v in params.items() if v is not None}}
    conn = await asyncpg.connect(plain_url(db_url))
    messages: list[str] = []
    conn.add_log_listener(lambda _conn, message: messages.append(str(message.message)))
    try:
        for line in AUTO_EXPLAIN:
            await conn.execute(line)
        for mode in ("force_custom_plan", "force_generic_plan", "auto"):
            await conn.execute(f"SET plan_cache_mode = {mode}")
            prepared = await conn.prepare(sql)
            times = 6 if mode == "auto" else 1
            for _ in range(times):
                messages.clear()
                await prepared.fetch(*values)
                await asyncio.sleep(0)  # let the notice arrive
            plan_text = next((m for m in reversed(messages) if "plan:" in m), "")
            ms, plan = _plan_of(plan_text, sql)
            entry: dict[str, Any] = {"execution_ms": ms, "plan": plan}
            if mode == "auto":
                usage = await conn.fetchrow(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                    "WHERE statement = $1", sql)
                if usage is not None:
                    entry.update(generic_plans=usage["generic_plans"],
                                 custom_plans=usage["custom_plans"])
            doc[mode.removeprefix("force_").removesuffix("_plan")] = entry
    except asyncpg.PostgresError as exc:  # e.g. no auto_explain on this server: plain EXPLAIN
        doc["auto_explain_unavailable"] = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(asyncpg.PostgresError):
            await conn.execute("RESET plan_cache_mode")
        rows = await conn.fetch("EXPLAIN (ANALYZE, BUFFERS) " + sql, *values)
        plan = [str(r[0]) for r in rows]
        doc["custom"] = {"plan": plan, "execution_ms": next(
            (float(line.split(":")[1].split()[0]) for line in plan
             if line.startswith("Execution Time")), None)}
    finally:
        await conn.close()
    return doc


async def explain_page(db_url: str, page: Page) -> list[dict[str, Any]]:
    found = []
    seen: set[tuple[str, str]] = set()
    for statement, params in page.statements:
        key = (statement.name, repr(sorted(params.items())))
        if key in seen:
            continue
        seen.add(key)
        found.append(await explain_statement(db_url, statement, params))
    return sorted(found, key=lambda d: -max(
        (d.get(m, {}).get("execution_ms") or 0.0) for m in ("custom", "generic", "auto")))


# -- the benchmark -------------------------------------------------------------------------------


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    layout = plan_layout(args.items, args.tenants, args.runs, args.large_run_items)
    async with fresh_database(ctx.server_url, "console") as db:
        progress(f"console: seeding {args.items:,} items, {len(layout.runs)} runs")
        seeding = await seed(db.engine, layout, args.webhooks, args.actions)
        progress(f"console: seeded in {seeding['insert_seconds']} s + VACUUM ANALYZE "
                 f"{seeding['vacuum_analyze_seconds']} s: {seeding['items_by_status']}")
        facts = await find_facts(db.engine, layout)
        page_list = pages(facts)
        reps = [await repetition(db.url, db.name, page_list, args,
                                 f"rep {i + 1}/{args.repeat}") for i in range(args.repeat)]
        results: dict[str, Any] = {}
        for page in page_list:
            rows = [r["pages"][page.name] for r in reps]
            cell: dict[str, Any] = {
                "method": page.method, "path": page.path,
                **{f"{k}_ms": summarize([r[k] for r in rows if r[k] is not None])
                   for k in ("p50", "p95", "max", "first")},
                "server_cpu_ms_per_request": summarize(
                    [r["server_cpu_ms_per_request"] for r in rows]),
                "postgres_cpu_ms_per_request": summarize(
                    [r["postgres_cpu_ms_per_request"] for r in rows
                     if r["postgres_cpu_ms_per_request"] is not None]),
                "all_200": all(set(r["statuses"]) == {"200"} for r in rows),
                "statements": [s.name for s, _ in page.statements],
                "repetitions": rows}
            p95 = cell["p95_ms"]["median"]
            cell["p95_below_target"] = p95 is not None and p95 < TARGET_P95_MS
            colds = [r["cold"] for r in rows if "cold" in r]
            if colds:
                cell["cold"] = {f"{k}_ms": summarize([c[k] for c in colds if c[k] is not None])
                                for k in ("p50", "p95", "max")}
                cold_p95 = cell["cold"]["p95_ms"]["median"]
                cell["cold"]["p95_below_target"] = (cold_p95 is not None
                                                    and cold_p95 < TARGET_P95_MS)
            results[page.name] = cell
        viewers = {k: summarize([r["viewers"][k] for r in reps if r["viewers"][k] is not None])
                   for k in ("p50", "p95", "max", "pages_per_s")}
        viewers_p95 = viewers["p95"]["median"]
        viewers_doc = {"viewers": args.viewers, **{f"{k}_ms" if k != "pages_per_s" else k: v
                                                   for k, v in viewers.items()},
                       "p95_below_target": viewers_p95 is not None
                       and viewers_p95 < TARGET_P95_MS,
                       "all_200": all(set(r["viewers"]["statuses"]) == {"200"} for r in reps),
                       "repetitions": [r["viewers"] for r in reps]}
        missed = [name for name, cell in results.items() if not cell["p95_below_target"]]
        # explained: the misses, and the pages that missed in one repetition (at the edge)
        at_risk = [name for name, cell in results.items()
                   if (cell["p95_ms"]["max"] or 0) >= TARGET_P95_MS]
        cold_missed = [name for name, cell in results.items()
                       if "cold" in cell and not cell["cold"]["p95_below_target"]]
        explain: dict[str, Any] = {}
        chosen = [p for p in page_list if args.explain == "all"
                  or (args.explain == "misses" and p.name in at_risk + cold_missed)]
        if args.explain == "misses" and not viewers_doc["p95_below_target"]:
            chosen += [p for p in page_list if p.name == "overview" and p not in chosen]
        for page in chosen:
            progress(f"console: EXPLAIN of {page.name}'s statements")
            explain[page.name] = await explain_page(db.url, page)
    doc: dict[str, Any] = {
        "parameters": {"items": args.items, "tenants": layout.tenants, "runs": len(layout.runs),
                       "large_run_items": facts.large_run_items, "webhooks": args.webhooks,
                       "actions": args.actions, "requests": args.requests,
                       "viewers": args.viewers, "repeat": args.repeat,
                       "page_seconds": args.page_seconds, "explain": args.explain,
                       "cold_requests": args.cold_requests, "cold_gap_s": COLD_GAP_S,
                       "policies": dict(POLICIES),
                       "server": "python -m service serve (one uvicorn process, workers 0, "
                                 "retention off), a new process per repetition",
                       "client": "httpx, one keep-alive connection per client, sequential"},
        "seeding": seeding, "facts": facts.doc(),
        "pages": results, "viewers": viewers_doc, "explain": explain,
        "target": {"p95_ms_below": TARGET_P95_MS,
                   "met": not missed and bool(viewers_doc["p95_below_target"]),
                   "missed": missed + ([] if viewers_doc["p95_below_target"]
                                       else [f"overview x{args.viewers} viewers"]),
                   "met_cold": not cold_missed, "missed_cold": cold_missed},
        "load_average_1m_at_start": [r["load_average_1m_at_start"] for r in reps],
        "elapsed_seconds": round(time.perf_counter() - started, 1),
    }
    lines = ["console: median over repetitions (range) in ms"]
    for name, cell in results.items():
        p50, p95, mx = cell["p50_ms"], cell["p95_ms"], cell["max_ms"]
        lines.append(f"  {name:<22} p50 {p50['median']:>8} ({p50['min']}-{p50['max']})  p95 "
                     f"{p95['median']:>8} ({p95['min']}-{p95['max']})  max {mx['median']:>8}"
                     f"  {'ok' if cell['p95_below_target'] else 'MISS'}")
        if "cold" in cell:
            c95 = cell["cold"]["p95_ms"]
            lines.append(f"  {'':<22} cold p95 {c95['median']} ({c95['min']}-{c95['max']})  "
                         f"{'ok' if cell['cold']['p95_below_target'] else 'MISS'}")
    lines.append(f"  overview x{args.viewers:<13} p50 {viewers['p50']['median']:>8}  p95 "
                 f"{viewers_p95:>8}  max {viewers['max']['median']:>8}  "
                 f"{'ok' if viewers_doc['p95_below_target'] else 'MISS'}")
    verdict = ("met" if doc["target"]["met"]
               else "NOT met: " + ", ".join(doc["target"]["missed"]))
    lines.append(f"  target p95 < {TARGET_P95_MS:.0f} ms on every page: {verdict}; with "
                 "nothing shared (cold): " + ("met" if not cold_missed
                                              else "NOT met: " + ", ".join(cold_missed)))
    progress("\n".join(lines))
    return doc


BENCHMARK = Benchmark(name="console",
                      help="console page latency (p50/p95/max per page) over a seeded ledger "
                           "of 1,000,000 items against one sweeper serve process",
                      add_arguments=add_arguments, run=run)
