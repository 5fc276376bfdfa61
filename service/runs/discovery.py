"""Discovery: a run of a policy with a source finds its candidates, a page at a time, before
publication releases them: by a store's query itself (service/sweeps/store_databases.py), or
by an upstream's list calls, each tenant of the source walked in turn by its cursor
(service/sweeps/list_pages.py).

Each page is read in its own short READ ONLY transaction on the store
(service/sweeps/store_databases.py), then applied in one ledger transaction that registers
the page's items (a report-only run registers nothing) and moves the run's cursor past the
page's last row. The cursor lives in `discoveries` and moves only if no other publisher
moved it since it was read (its page count is the version), so a crash resumes at the last
committed page and two publishers never apply the same page twice; registration is
idempotent per obligation besides.

A row that cannot become an item (a missing or malformed id, a tenant whose scope or host
the policy refuses: service/runs/page_sorting.py) is counted as a discovery error on the
run, with the first few problems kept, and discovery goes on. A store that cannot be reached
leaves the run publishing with the reason on its discovery row; the publisher tries again on
its next pass and nothing is lost.

Discovery reads at most the source's `rows_per_second`, and stops once a run with
`max_items` has that many candidates: the next run's walk finds the rest.

A list source's cursor is the tenant being walked and the upstream's next cursor
(`after_tenant`, `after_object`), moved in the page's transaction likewise. A list call that
must wait (a 429, an upstream out of reach, the pass's `pages_per_pass` read) leaves the run
publishing and the next pass resumes there; a tenant whose list calls are refused (401/403,
its scope paused) is skipped with the reason as a discovery error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget.credential_waits import Credentials
from service.config.policies import Policies, Policy
from service.config.policy_file import SourceConfig
from service.db.statements import Statement, fetch, fetch_none
from service.db.statements import run as run_statement
from service.ledger import registration
from service.observability import metrics
from service.runs import reports
from service.runs.page_sorting import EMPTY_PAGE, Page, per_tenant, sort_page
from service.sweeps.list_pages import Lister, SourceDeferred
from service.sweeps.store_databases import Cursor, SourceRows, StoreError, Stores

log = logging.getLogger(__name__)

MAX_ERROR_SAMPLES: Final = 20
# per tenant, the largest this many are answered in run status (all are kept)
MAX_TENANTS_SHOWN: Final = 1000

_START = Statement("discovery.start", (
    "The discovery row of a run's source policy, made on its first page."),
    "INSERT INTO discoveries (run_id, policy) VALUES (:run, :policy) "
    "ON CONFLICT (run_id, policy) DO NOTHING")
_STATE = Statement("discovery.state", "Where a run's discovery of one policy stands.",
                   "SELECT * FROM discoveries WHERE run_id = :run AND policy = :policy")
# The page's figures and the cursor after it, only if no publisher moved it meanwhile (a
# step that reads no page, a list source's tenant skipped, moves the cursor alone)
_ADVANCE = Statement("discovery.advance", (
    "Move a discovery's cursor past one page and add its figures, unless another publisher "
    "applied a page since it was read."), """
    UPDATE discoveries SET
        after_age = :age, after_tenant = :tenant, after_object = :object,
        pages = pages + :read, candidates = candidates + :candidates,
        registered = registered + :registered, errors = errors + :errors,
        error_samples = CASE WHEN jsonb_array_length(error_samples) >= :max_samples
                             THEN error_samples
                             ELSE error_samples || CAST(:samples AS jsonb) END,
        oldest_age = least(oldest_age, CAST(:oldest AS timestamptz)),
        newest_age = greatest(newest_age, CAST(:newest AS timestamptz)),
        done = :done, failure = NULL, updated_at = now()
    WHERE run_id = :run AND policy = :policy AND pages = :pages AND NOT done
      AND after_tenant IS NOT DISTINCT FROM CAST(:from_tenant AS text)
      AND after_object IS NOT DISTINCT FROM CAST(:from_object AS text)
    RETURNING *
""")
_TENANTS = Statement("discovery.tenants", (
    "Add one page's candidates per tenant, with their oldest and newest age."), """
    INSERT INTO discovery_tenants AS t (run_id, policy, tenant_id, candidates, oldest_age,
                                        newest_age)
    SELECT :run, :policy, u.tenant, u.n, u.oldest, u.newest
    FROM unnest(CAST(:tenants AS text[]), CAST(:counts AS bigint[]),
                CAST(:oldests AS timestamptz[]), CAST(:newests AS timestamptz[]))
         AS u(tenant, n, oldest, newest)
    ON CONFLICT (run_id, policy, tenant_id) DO UPDATE SET
        candidates = t.candidates + EXCLUDED.candidates,
        oldest_age = least(t.oldest_age, EXCLUDED.oldest_age),
        newest_age = greatest(t.newest_age, EXCLUDED.newest_age)
""")
_FAILED = Statement("discovery.failed", (
    "Record why a discovery's last page could not be read (it is tried again)."),
    "UPDATE discoveries SET failure = :failure, updated_at = now() "
    "WHERE run_id = :run AND policy = :policy")


class Discovery:
    """Discovers the candidates of a run's source policies (publication calls it first)."""

    def __init__(self, policies: Policies, stores: Stores,
                 credentials: Credentials | None = None) -> None:
        self.policies = policies
        self.stores = stores
        self.credentials = credentials  # the list sources' per-tenant credentials

    def sourced(self, run: Mapping[str, Any]) -> list[Policy]:
        """The policies of `run` whose candidates come from a source."""
        return [p for name, p in sorted(self.policies.policies.items())
                if p.config.source is not None and run["policy"] in (None, name)]

    async def discover(self, engine: AsyncEngine, run: Mapping[str, Any]) -> None:
        """Walk every source policy of `run` to the end of its query or lists. StoreError
        when a store could not answer, SourceDeferred when a list source must wait
        (recorded on the discovery row; the run waits for the next pass)."""
        lister = Lister(self.policies, self.credentials)
        try:
            for policy in self.sourced(run):
                if policy.list_source is not None:
                    await self._walk_list(engine, run, policy, lister)
                else:
                    await self._walk(engine, run, policy)
        finally:
            await lister.aclose()

    async def _walk(self, engine: AsyncEngine, run: Mapping[str, Any], policy: Policy) -> None:
        """Walk a store source's query page by page. The next page is read from the store
        while this one is applied to the ledger (its cursor is this page's last row); it is
        applied only after this one was, and dropped if another publisher moved the cursor
        meanwhile."""
        source = policy.store_source
        assert source is not None
        keys = {"run": run["id"], "policy": policy.name}
        await fetch_none(engine, _START, keys)
        [state] = await fetch(engine, _STATE, keys)
        started = time.monotonic()
        read = 0
        reading: asyncio.Future[SourceRows] | None = None
        try:
            while not state.done:
                if reading is None:
                    reading = asyncio.ensure_future(self._read(
                        source, run, Cursor(state.after_age, state.after_tenant,
                                            state.after_object), policy.name, 0.0))
                try:
                    rows = await reading
                except StoreError as exc:
                    # recorded only now, after the page before it was applied (whose
                    # cursor move clears the failure)
                    reading = None
                    await fetch_none(engine, _FAILED, {**keys, "failure": str(exc)})
                    raise
                reading = None
                page = sort_page(policy, rows, run["cutoff"], in_age_order=True)
                read += page.rows
                limit = run["max_items"]
                done = page.rows < source.page or (
                    limit is not None and not run["dry_run"]
                    and state.candidates + len(page.registrations) >= limit)
                if not done:
                    # never faster than the source's budget: the next page starts when
                    # the rows read so far are due
                    wait = 0.0 if source.rows_per_second is None else \
                        started + read / source.rows_per_second - time.monotonic()
                    reading = asyncio.ensure_future(self._read(
                        source, run, page.last, policy.name, wait))
                moved = await self._apply(engine, run, policy, state, page, done, page.last)
                if moved is None:
                    # another publisher applied a page: go on from where it left the cursor
                    if reading is not None:
                        reading.cancel()
                        reading = None
                    [state] = await fetch(engine, _STATE, keys)
                    continue
                state = moved
                metrics.DISCOVERED.labels(policy.name, "candidate").inc(
                    len(page.registrations))
                metrics.DISCOVERED.labels(policy.name, "error").inc(len(page.errors))
        finally:
            if reading is not None:
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError, StoreError):
                    await reading

    async def _read(self, source: SourceConfig, run: Mapping[str, Any], cursor: Cursor,
                    policy: str, wait: float) -> SourceRows:
        """The page after `cursor`, read after `wait` seconds (StoreError when the store
        cannot answer)."""
        if wait > 0:
            await asyncio.sleep(wait)
        began = time.perf_counter()
        rows = await self.stores.read_page(source, run["cutoff"], cursor,
                                           tenant=run["tenant_id"])
        metrics.DISCOVERY_PAGE_DURATION.labels(policy).observe(time.perf_counter() - began)
        return rows

    async def _walk_list(self, engine: AsyncEngine, run: Mapping[str, Any], policy: Policy,
                         lister: Lister) -> None:
        """Walk each tenant of a list source in turn, page by page after its cursor."""
        source = policy.list_source
        assert source is not None
        keys = {"run": run["id"], "policy": policy.name}
        await fetch_none(engine, _START, keys)
        tenants = lister.tenants(policy, run)
        steps = 0
        while True:
            [state] = await fetch(engine, _STATE, keys)
            if state.done:
                return
            # the tenant walked now: the cursor's, or the next one (the file may have
            # changed since); its cursor holds only while it is the cursor's tenant
            at = next((n for n, t in enumerate(tenants) if state.after_tenant is None
                       or t >= state.after_tenant), len(tenants))
            if at == len(tenants):
                await self._apply(engine, run, policy, state, EMPTY_PAGE, True, Cursor(), 0)
                return
            tenant = tenants[at]
            cursor = state.after_object if tenant == state.after_tenant else None
            if steps >= source.pages_per_pass:
                raise SourceDeferred(policy.name, f"read {steps} pages in this pass",
                                     quiet=True)
            began = time.perf_counter()
            try:
                listed = await lister.page(engine, run, policy, tenant, cursor)
            except SourceDeferred as exc:
                await fetch_none(engine, _FAILED, {**keys, "failure": exc.reason})
                raise
            steps += 1
            if listed.read:
                metrics.DISCOVERY_PAGE_DURATION.labels(policy.name).observe(
                    time.perf_counter() - began)
            entries = listed.entries
            page = sort_page(policy, SourceRows([e.tenant_id for e in entries],
                                                [e.object_id for e in entries],
                                                [e.age for e in entries]), run["cutoff"])
            page = dataclasses.replace(page, errors=listed.errors + page.errors)
            following = tenant if listed.next is not None else (
                tenants[at + 1] if at + 1 < len(tenants) else None)
            limit = run["max_items"]
            done = following is None or (
                limit is not None and not run["dry_run"]
                and state.candidates + len(page.registrations) >= limit)
            last = Cursor(None, following or tenant, listed.next)
            if await self._apply(engine, run, policy, state, page, done, last,
                                 listed.read) is not None:
                metrics.DISCOVERED.labels(policy.name, "candidate").inc(
                    len(page.registrations))
                metrics.DISCOVERED.labels(policy.name, "error").inc(len(page.errors))
            if done:
                return

    async def _apply(self, engine: AsyncEngine, run: Mapping[str, Any], policy: Policy,
                     state: Any, page: Page, done: bool, last: Cursor, read: int = 1
                     ) -> Any:
        """Register the page (not for a report-only run) and move the cursor from where
        `state` had it to `last`, in one transaction: the discovery row after it, or None
        when another publisher applied a page meanwhile."""
        keys = {"run": run["id"], "policy": policy.name}
        ages = page.ages
        async with engine.begin() as conn:
            moved = (await run_statement(conn, _ADVANCE, {
                **keys, "pages": state.pages, "from_tenant": state.after_tenant,
                "from_object": state.after_object, "read": read, "age": last.age,
                "tenant": last.tenant_id, "object": last.object_id,
                "candidates": len(page.registrations),
                "registered": 0 if run["dry_run"] else len(page.registrations),
                "errors": len(page.errors), "max_samples": MAX_ERROR_SAMPLES,
                "samples": json.dumps(page.errors[:MAX_ERROR_SAMPLES]),
                "oldest": min(ages) if ages else None, "newest": max(ages) if ages else None,
                "done": done})).first()
            if moved is None:
                await conn.rollback()
                return None
            if len(page.registrations):
                await run_statement(conn, _TENANTS, {**keys, **per_tenant(page)})
                if not run["dry_run"]:
                    await registration.register_in(conn, page.registrations)
        return moved



_RUN = Statement("discovery.run", "The run a discovery report is of: its filter and kind.",
                 "SELECT id, policy, tenant_id, dry_run FROM runs WHERE id = :run")
_POLICIES = Statement("discovery.policies", "What a run's discovery found, per policy.",
                      "SELECT policy, pages, candidates, registered, errors, error_samples, "
                      "oldest_age, newest_age, done, failure, updated_at FROM discoveries "
                      "WHERE run_id = :run ORDER BY policy")
# Per tenant, this run's figures beside the previous report-only run's (a tenant in only
# one of them too), largest first.
_TENANT_FIGURES = Statement("discovery.tenant_figures", (
    "A run's discovered candidates per tenant beside the previous report-only run's, "
    "largest first."), """
    SELECT coalesce(t.policy, p.policy) AS policy, coalesce(t.tenant_id, p.tenant_id)
               AS tenant_id,
           coalesce(t.candidates, 0) AS candidates, t.oldest_age, t.newest_age,
           p.candidates AS previous_candidates
    FROM (SELECT * FROM discovery_tenants WHERE run_id = :run) t
    FULL JOIN (SELECT * FROM discovery_tenants WHERE run_id = :previous) p
        ON p.policy = t.policy AND p.tenant_id = t.tenant_id
    ORDER BY 1, 3 DESC, 2
    LIMIT :limit
""")


async def report(engine: AsyncEngine, run_id: int, *, limit: int = MAX_TENANTS_SHOWN
                 ) -> dict[str, Any] | None:
    """What a run's discovery found per policy and per tenant (the largest `limit`); for a
    report-only run, each tenant beside the previous report-only run's figure. None when
    there is no such run."""
    found = await fetch(engine, _RUN, {"run": run_id})
    if not found:
        return None
    run = found[0]
    previous = None
    if run.dry_run:
        async with engine.connect() as conn:
            found_previous = await reports.previous_dry_run(conn, run_id, run.policy,
                                                            run.tenant_id)
        previous = int(found_previous.id) if found_previous is not None else None
    policies = {r.policy: {**r._mapping, "tenants": []}
                for r in await fetch(engine, _POLICIES, {"run": run_id})}
    for r in await fetch(engine, _TENANT_FIGURES, {"run": run_id, "previous": previous,
                                                   "limit": limit}):
        if r.policy not in policies:
            continue  # a policy the previous run discovered and this one did not
        difference = None if previous is None else r.candidates - (r.previous_candidates or 0)
        policies[r.policy]["tenants"].append({
            "tenant_id": r.tenant_id, "candidates": r.candidates, "oldest_age": r.oldest_age,
            "newest_age": r.newest_age, "previous_candidates": r.previous_candidates
            if previous is not None else None, "difference": difference})
    return {"run_id": run_id, "previous_dry_run": previous, "policies": list(policies.values())}
