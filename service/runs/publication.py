"""Runs: a cron trigger records a cutoff; publication releases due items into batches.

Publication is driven from the run row in bounded chunks, each one short transaction that
releases batches of at most `batch_size` items of one policy version. A crash between
chunks loses nothing and duplicates nothing: released items no longer match the predicate,
and the next publisher (any replica) resumes from the run row.

PUBLICATION_LANES chunk transactions run side by side: they pick disjoint items (SKIP
LOCKED), share the run row (FOR KEY SHARE), number their batches from a sequence, and
add their counts to the run row as they commit. The run is marked published once every
lane found nothing left. A run with `max_items` publishes one chunk at a time, whichever
publisher runs it (FOR NO KEY UPDATE on the run row), so each reads the count the last
committed and the cap is exact.

The publisher runs on the cluster's leader (service/cluster/leader.py); given the leader's term, a
chunk commits only while that term's lease is in force (`_ADD_RELEASED`).

A run whose publication raises is isolated: runs are published one after another, and one
run's error never keeps the next from publishing. The database being unavailable or busy
leaves the run `publishing` for the next pass; any other error marks it `failed`, with an
error code and message in its report (from the exception's type and SQLSTATE, never its
text, which may quote customer values), logged once by the publisher that marked it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.cluster.leader import CLUSTER
from service.db.engine import is_busy, is_unavailable, sqlstate
from service.db.statements import Statement, fetch
from service.db.statements import run as run_statement
from service.errors import NotLeader, SweeperError
from service.ledger.claims import NOTIFY_CHANNEL
from service.observability import metrics
from service.sweeps.list_pages import SourceDeferred
from service.sweeps.store_databases import StoreError

if TYPE_CHECKING:
    from service.runs.discovery import Discovery

log = logging.getLogger(__name__)


class TriggerKeyReused(SweeperError):
    """A trigger key that already started a run with a different request."""

    def __init__(self, run_id: int) -> None:
        super().__init__(f"the trigger key started run {run_id} with a different request")
        self.run_id = run_id


@dataclass(frozen=True)
class RunRequest:
    """What a trigger asks for."""

    policy: str | None
    tenant_id: str | None
    cutoff: datetime | None
    dry_run: bool
    max_items: int | None

    def digest(self) -> str:
        doc = {"policy": self.policy, "tenant_id": self.tenant_id, "dry_run": self.dry_run,
               "cutoff": self.cutoff.isoformat() if self.cutoff else None,
               "max_items": self.max_items}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


_INSERT_RUN = Statement("publication.insert", (
    "Record a triggered run, or nothing when its trigger key already started one."), """
    INSERT INTO runs (trigger_key, request_digest, policy, tenant_id, cutoff, dry_run, max_items)
    VALUES (:key, :digest, :policy, :tenant, coalesce(CAST(:cutoff AS timestamptz), now()),
            :dry_run, :max_items)
    ON CONFLICT (trigger_key) DO NOTHING
    RETURNING id
""")
_BY_TRIGGER_KEY = Statement("publication.by_trigger_key", (
    "The run a trigger key started and its request's digest, to tell a retry from a reuse."),
    "SELECT id, request_digest FROM runs WHERE trigger_key = :key")


async def create_run(engine: AsyncEngine, request: RunRequest, trigger_key: str | None
                     ) -> tuple[int, bool]:
    """Record a run; returns (run id, created). The same trigger key returns the same run;
    the same key with a different request raises TriggerKeyReused. Replicas find a new run
    on their publisher's next poll; this one's is woken by the caller."""
    digest = request.digest()
    params = {"key": trigger_key, "digest": digest, "policy": request.policy,
              "tenant": request.tenant_id, "cutoff": request.cutoff,
              "dry_run": request.dry_run, "max_items": request.max_items}
    async with engine.begin() as conn:
        run_id = (await run_statement(conn, _INSERT_RUN, params)).scalar()
    if run_id is not None:
        metrics.RUNS_CREATED.labels(str(request.dry_run).lower()).inc()
        return int(run_id), True
    [row] = await fetch(engine, _BY_TRIGGER_KEY, {"key": trigger_key})
    if row.request_digest != digest:
        raise TriggerKeyReused(int(row.id))
    return int(row.id), False


# A candidate of a run: an item the run's cutoff (and its optional policy and tenant)
# selects that no batch has released yet. Its first terms are items_unreleased's WHERE; the
# figures, the chunks and the remainder all count exactly this set.
_CANDIDATE: Final = """status = 'pending' AND released_at IS NULL AND due_at <= :cutoff
      AND (CAST(:policy AS text) IS NULL OR policy = :policy)
      AND (CAST(:tenant AS text) IS NULL OR tenant_id = :tenant)"""


# Record the candidate figures for the run's exact predicate, per policy (dry runs report
# only these; `held`: candidates a legal hold keeps, which a run releases but no worker
# calls until the hold ends), in SQL: no due_at passes through Python, so publication does
# not depend on items_due_at_range keeping due_at where Python's datetime reaches (asyncpg
# cannot decode a year BC). The report renders each figure as the database does (ISO 8601
# under SET LOCAL TIME ZONE 'UTC'), exactly whatever the value; the typed columns, which
# every reader of the run row decodes, are raised to 0001-01-01, Python's earliest instant
# (per row: no candidates still leaves them NULL). Candidates are due by the run's cutoff,
# which Python holds (runs_cutoff_range), so no upper bound is needed.
_RECORD_CANDIDATES = Statement("publication.record_candidates", (
    "Count the run's candidates per policy, with their oldest and newest due_at, onto the "
    "run row and its report."), f"""
    WITH per_policy AS (
        SELECT policy, count(*) AS n, min(due_at) AS oldest, max(due_at) AS newest,
               count(*) FILTER (WHERE hold_id IS NOT NULL) AS held
        FROM items
        WHERE {_CANDIDATE}
        GROUP BY policy
    )
    UPDATE runs SET
        candidates = (SELECT coalesce(sum(n), 0) FROM per_policy),
        oldest_due_at = (SELECT min(greatest(oldest, '0001-01-01 00:00:00+00'))
                         FROM per_policy),
        newest_due_at = (SELECT max(greatest(newest, '0001-01-01 00:00:00+00'))
                         FROM per_policy),
        report = jsonb_build_object('policies', (
            SELECT coalesce(jsonb_object_agg(policy, jsonb_build_object(
                       'candidates', n, 'oldest_due_at', oldest, 'newest_due_at', newest,
                       'held', held)),
                   '{{}}')
            FROM per_policy))
    WHERE id = :id
    RETURNING candidates
""")  # noqa: S608 - only a constant fragment is interpolated

# One chunk: lock the next unreleased due items of one policy version (SKIP LOCKED: two
# publishers never take the same rows), oldest first. The order is items_unreleased's own
# (policy is fixed, so by due_at; ties in index order): an ordered index scan that stops at
# its limit, never a sort, whatever the statistics (a backlog registered in bulk may not
# have been analyzed yet). A tie-breaker such as `id`, which the index lacks, would bring
# the sort back.
_PICK = Statement("publication.pick", (
    "Lock the next unreleased due items of one policy version, oldest first, skipping rows "
    "another lane holds: one batch's items."), f"""
    SELECT id, policy, policy_version FROM items
    WHERE {_CANDIDATE}
      AND (policy, policy_version) = (
          SELECT policy, policy_version FROM items
          WHERE {_CANDIDATE}
          ORDER BY policy, due_at LIMIT 1)
    ORDER BY due_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
""")  # noqa: S608 - only a constant fragment is interpolated


# The batch row and the release of its items in one statement (one round trip per batch).
# `seq` comes from a sequence: lanes publishing one run side by side never share a number.
_RELEASE_BATCH = Statement("publication.release_batch", (
    "Insert a batch row and release its items into it, in one round trip."), """
    WITH batch AS (
        INSERT INTO batches (run_id, seq, digest, policy, policy_version, item_count)
        VALUES (:run, nextval('batches_seq'), :digest, :policy, :version, :n) RETURNING id
    )
    UPDATE items SET released_at = now(), batch_id = batch.id, updated_at = now()
    FROM batch WHERE items.id = ANY(CAST(:ids AS bigint[]))
""")
# A publication transaction takes several batches (fewer commits: each one waits for the
# WAL flush) but stays short: it stops after this many batches or this long, whichever
# comes first, so no lock is held for long and a crash loses at most one chunk's work.
# Few batches, because the other lanes' picks step over every row a chunk holds locked
# (SKIP LOCKED tries each one). Measurements: bench/reports/design-notes.md.
CHUNK_MAX_BATCHES: Final = 4
CHUNK_MAX_SECONDS: Final = 0.25
# Chunk transactions of one run at once. A release is never a HOT update, so its index
# inserts keep a backend busy: one lane would leave the database server's other cores idle.
# A run with `max_items` publishes in one lane per publisher, and its chunks take the run
# row one at a time (_CAPPED_LANE_RUN), which keeps its count exact.
PUBLICATION_LANES: Final = 2


def batch_digest(policy: str, version: int, cutoff: datetime, item_ids: list[int]) -> str:
    """A batch's durable identity: policy, version, cutoff and the sorted item ids."""
    h = hashlib.sha256(f"{policy}\x00{version}\x00{cutoff.isoformat()}\x00".encode())
    h.update(",".join(str(i) for i in sorted(item_ids)).encode())
    return h.hexdigest()


async def publish(engine: AsyncEngine, run_id: int, *, batch_size: int,
                  lanes: int = PUBLICATION_LANES, discovery: Discovery | None = None,
                  term: int | None = None) -> bool:
    """Publish one run to completion, its store sources' candidates discovered first
    (service/runs/discovery.py). False when another publisher holds it. With the leader's
    `term`, each chunk commits only while that term's lease is in force (NotLeader)."""
    started = time.perf_counter()
    async with engine.begin() as conn:
        run = await _publishing_run(conn, run_id, _TAKE_RUN)
        if run is None:
            return False
        sourced = bool(discovery and not run["report"] and discovery.sourced(run))
        if not run["report"] and not sourced:
            await _record_candidates(conn, run)
    if sourced:
        assert discovery is not None
        # page by page, each its own transaction: no ledger lock is held across the store
        await discovery.discover(engine, run)
        async with engine.begin() as conn:
            run = await _publishing_run(conn, run_id, _TAKE_RUN)
            if run is None:
                return False
            if not run["report"]:
                await _record_candidates(conn, run, discovered=True)
    if not run["dry_run"]:
        capped = run["max_items"] is not None
        await _all_lanes(engine, run_id, batch_size, 1 if capped else max(1, lanes),
                         _CAPPED_LANE_RUN if capped else _LANE_RUN, term)
    async with engine.begin() as conn:
        # waits for chunk transactions still open elsewhere (their KEY SHARE locks)
        run = await _publishing_run(conn, run_id, _FINISH_RUN)
        if run is not None:
            await _finish(conn, run)
    metrics.PUBLICATION_DURATION.observe(time.perf_counter() - started)
    return True


# The run's row while it is still publishing, under the lock each step needs.
_TAKE_RUN = Statement("publication.take_run", (
    "A publishing run's row for its first step, taken alone or not at all (another "
    "publisher has it)."),
    "SELECT * FROM runs WHERE id = :id AND state = 'publishing' FOR UPDATE SKIP LOCKED")
_LANE_RUN = Statement("publication.lane_run", (
    "A publishing run's row shared by the lanes for one chunk, so it is not finished under "
    "them."),
    "SELECT * FROM runs WHERE id = :id AND state = 'publishing' FOR KEY SHARE")
# A capped run's chunk must read the `released` the previous chunk committed, whichever
# publisher (replica) wrote it: FOR NO KEY UPDATE conflicts with itself, so a second
# publisher's chunk waits for the first to commit and then reads the row as it committed
# (a locking read returns the newest version), but it still lets the lanes' KEY SHARE and
# the items' foreign keys through. Under KEY SHARE two chunks read the same `released` and
# each released up to the remainder.
_CAPPED_LANE_RUN = Statement("publication.capped_lane_run", (
    "A capped publishing run's row for one chunk, one chunk at a time across publishers, "
    "so each reads the count the last one committed."),
    "SELECT * FROM runs WHERE id = :id AND state = 'publishing' FOR NO KEY UPDATE")
_FINISH_RUN = Statement("publication.finish_run", (
    "A publishing run's row locked to finish it, once every lane's chunk has committed."),
    "SELECT * FROM runs WHERE id = :id AND state = 'publishing' FOR UPDATE")


async def _publishing_run(conn: AsyncConnection, run_id: int, statement: Statement) -> Any:
    """The run's row while it is still publishing (None otherwise), under the lock of
    `statement`: the first step takes it alone or not at all, lanes share it, and finishing
    waits for them."""
    return (await run_statement(conn, statement, {"id": run_id})).mappings().one_or_none()


async def _all_lanes(engine: AsyncEngine, run_id: int, batch_size: int, lanes: int,
                     lock: Statement, term: int | None) -> None:
    """Run the lanes to the end, each chunk taking the run row with `lock`; the first
    failure stops the others and is raised as it is (callers tell a database outage from a
    bug by the exception itself)."""
    tasks = [asyncio.create_task(_publish_lane(engine, run_id, batch_size, lock, term))
             for _ in range(lanes)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _publish_lane(engine: AsyncEngine, run_id: int, batch_size: int,
                        lock: Statement, term: int | None) -> None:
    """Release chunk after chunk until none is left (or the run was finished elsewhere).
    FOR KEY SHARE lets lanes share the run row and keeps it from being finished under
    them (a capped run's chunks take it one at a time); each chunk adds its counts to the
    row as it commits."""
    while True:
        async with engine.begin() as conn:
            run = await _publishing_run(conn, run_id, lock)
            if run is None or await _release_chunk(conn, run, batch_size, term) == 0:
                return


def _filters(run: Any) -> dict[str, Any]:
    return {"cutoff": run["cutoff"], "policy": run["policy"], "tenant": run["tenant_id"]}


_REPORT_IN_UTC = Statement("publication.report_in_utc", (
    "Render the report's due_at figures in UTC for the rest of this transaction."),
    "SET LOCAL TIME ZONE 'UTC'")
_PREVIOUS_DRY_RUN = Statement("publication.previous_dry_run", (
    "The latest published dry run before this one with the same policy and tenant, to "
    "report the change in candidates."),
    "SELECT id, candidates FROM runs WHERE dry_run AND state = 'published' "
    "AND id < :id AND policy IS NOT DISTINCT FROM :policy "
    "AND tenant_id IS NOT DISTINCT FROM :tenant ORDER BY id DESC LIMIT 1")


async def previous_dry_run(conn: AsyncConnection, run_id: int, policy: str | None,
                           tenant: str | None) -> Any:
    """The latest published dry run before `run_id` over the same policy and tenant (its id
    and candidates), or None: what a report-only run is compared with."""
    return (await run_statement(conn, _PREVIOUS_DRY_RUN, {
        "id": run_id, "policy": policy, "tenant": tenant})).first()


_REPORT_COMPARISON = Statement("publication.report_comparison", (
    "Add the comparison with the previous dry run (or null) to a dry run's report."),
    "UPDATE runs SET report = report || jsonb_build_object("
    "'previous_dry_run', CAST(:comparison AS jsonb)) WHERE id = :id")


# A run with store sources: each discovered policy's figures join its report, `source`
# saying what discovery read. A report-only run registered nothing, so the discovered
# figures are its candidates for those policies (the ledger's would count only what an
# earlier run left behind); a real run's stay the ledger's, which hold what it registered.
_DISCOVERED_FIGURES = Statement("publication.discovered_figures", (
    "Add what discovery found per source policy to the run's report (for a report-only "
    "run, as its candidates) and total the run's figures again."), """
    WITH d AS (
        SELECT policy, candidates, oldest_age, newest_age,
               jsonb_build_object('pages', pages, 'candidates', candidates,
                                  'registered', registered, 'errors', errors,
                                  'error_samples', error_samples) AS source
        FROM discoveries WHERE run_id = :id
    ),
    merged AS (
        SELECT coalesce(r.report -> 'policies', '{}') || coalesce(jsonb_object_agg(d.policy,
                   CASE WHEN r.dry_run
                        THEN jsonb_build_object('candidates', d.candidates,
                                                'oldest_due_at', d.oldest_age,
                                                'newest_due_at', d.newest_age, 'held', 0)
                        ELSE coalesce(r.report -> 'policies' -> d.policy, jsonb_build_object(
                                 'candidates', 0, 'oldest_due_at', NULL,
                                 'newest_due_at', NULL, 'held', 0)) END
                   || jsonb_build_object('source', d.source)), '{}') AS policies
        FROM runs r LEFT JOIN d ON true
        WHERE r.id = :id
        GROUP BY r.id, r.report
    )
    UPDATE runs SET
        report = jsonb_set(report, '{policies}', merged.policies),
        candidates = (SELECT coalesce(sum(CAST(v ->> 'candidates' AS bigint)), 0)
                      FROM jsonb_each(merged.policies) AS e(k, v)),
        oldest_due_at = (SELECT min(CAST(v ->> 'oldest_due_at' AS timestamptz))
                         FROM jsonb_each(merged.policies) AS e(k, v)),
        newest_due_at = (SELECT max(CAST(v ->> 'newest_due_at' AS timestamptz))
                         FROM jsonb_each(merged.policies) AS e(k, v))
    FROM merged WHERE id = :id
    RETURNING candidates
""")


async def _record_candidates(conn: AsyncConnection, run: Any, discovered: bool = False
                             ) -> None:
    await run_statement(conn, _REPORT_IN_UTC)  # the report's rendering of due_at
    total = (await run_statement(conn, _RECORD_CANDIDATES, {**_filters(run), "id": run["id"]}
                                 )).scalar_one()
    if discovered:
        total = (await run_statement(conn, _DISCOVERED_FIGURES, {"id": run["id"]})
                 ).scalar_one()
    if run["dry_run"]:
        previous = await previous_dry_run(conn, run["id"], run["policy"], run["tenant_id"])
        comparison = ({"run_id": previous.id, "candidates": previous.candidates,
                       "difference": total - previous.candidates} if previous else None)
        await run_statement(conn, _REPORT_COMPARISON,
                            {"comparison": json.dumps(comparison), "id": run["id"]})


# The last statement of a chunk, so it is also where a leader's term fences the chunk: once
# that term's lease has lapsed (another process may lead), no row is returned and the chunk
# rolls back (NotLeader). clock_timestamp(), not the transaction's start: the chunk ran
# for a while.
_ADD_RELEASED = Statement("publication.add_released", (
    "Add a chunk's released items and batches to the run row, in the chunk's transaction, "
    "while the leader's term that publishes it holds its lease."), """
    UPDATE runs SET released = released + :n, batches = batches + :b
    WHERE id = :id
      AND (CAST(:term AS bigint) IS NULL  -- published outside the leader's loop (tools)
           OR EXISTS (SELECT FROM leader
                      WHERE name = :leader AND term = :term
                        AND expires_at > clock_timestamp()))
    RETURNING id
""")
# Sent inside the chunk's transaction: delivered to the workers when it commits.
_NOTIFY_RELEASED = Statement("publication.notify_released", (
    "Wake idle workers: items were released (delivered when the chunk commits)."),
    f"NOTIFY {NOTIFY_CHANNEL}")


async def _release_chunk(conn: AsyncConnection, run: Any, batch_size: int,
                         term: int | None = None, max_batches: int = CHUNK_MAX_BATCHES) -> int:
    """One publication transaction: up to `max_batches` batches, stopping early once it has
    run for CHUNK_MAX_SECONDS. Returns the items released (0: nothing left). Raises
    NotLeader (the caller's transaction rolls back) when `term`'s lease has lapsed."""
    started = time.perf_counter()
    released = batches = 0
    while batches < max_batches:
        limit = batch_size
        if run["max_items"] is not None:
            limit = min(limit, run["max_items"] - run["released"] - released)
            if limit <= 0:
                break
        rows = (await run_statement(conn, _PICK, {**_filters(run), "limit": limit})).all()
        if not rows:
            break
        ids = [r.id for r in rows]
        policy, version = rows[0].policy, rows[0].policy_version
        await run_statement(conn, _RELEASE_BATCH, {
            "run": run["id"], "policy": policy,
            "version": version, "digest": batch_digest(policy, version, run["cutoff"], ids),
            "n": len(ids), "ids": ids})
        released += len(ids)
        batches += 1
        if len(ids) < limit or time.perf_counter() - started > CHUNK_MAX_SECONDS:
            break
    if released:
        counted = (await run_statement(conn, _ADD_RELEASED, {
            "n": released, "b": batches, "id": run["id"], "term": term, "leader": CLUSTER})
        ).first()
        if counted is None:
            raise NotLeader(f"term {term} ended while publishing run {run['id']}")
        await run_statement(conn, _NOTIFY_RELEASED)
        metrics.ITEMS_RELEASED.inc(released)  # counted a moment before the commit
    return released


_REMAINING = Statement("publication.remaining", (
    "Candidates of the run still unreleased once every lane is done (left for a later run)."),
    f"SELECT count(*) FROM items WHERE {_CANDIDATE}")  # noqa: S608 - constant fragment
_MARK_PUBLISHED = Statement("publication.mark_published", (
    "Mark the run published, with the candidates it left unreleased."),
    "UPDATE runs SET state = 'published', published_at = clock_timestamp(), "
    "remaining = :remaining WHERE id = :id")


async def _finish(conn: AsyncConnection, run: Any) -> None:
    remaining = 0
    if not run["dry_run"]:
        remaining = (await run_statement(conn, _REMAINING, _filters(run))).scalar_one()
    await run_statement(conn, _MARK_PUBLISHED, {"remaining": remaining, "id": run["id"]})
    log.info("run published", extra={"run_id": run["id"], "dry_run": run["dry_run"],
                                     "remaining": remaining})


_PUBLISHING_RUNS = Statement("publication.publishing", (
    "Runs still publishing (new, or left by a crash), oldest first: the publisher's work."),
    "SELECT id FROM runs WHERE state = 'publishing' ORDER BY id")


async def publish_pending(engine: AsyncEngine, *, batch_size: int,
                          discovery: Discovery | None = None, term: int | None = None) -> int:
    """Publish every run still in state `publishing` (new, or left by a crash), each on its
    own: a run that raises is left for the next pass (database unavailable or busy) or
    marked failed, and the runs after it are published all the same. Returns the runs
    published."""
    ids = [row.id for row in await fetch(engine, _PUBLISHING_RUNS, {})]
    done = 0
    deferred: list[int] = []
    for run_id in ids:
        try:
            if await publish(engine, run_id, batch_size=batch_size, discovery=discovery,
                             term=term):
                done += 1
        except NotLeader:
            raise  # the pass ends: the run is the next leader's, as it stands
        except StoreError as exc:
            # a store could not answer discovery: recorded on the run's discovery row, and
            # the run waits for the next pass (nothing is lost)
            log.warning("run discovery deferred: store could not answer",
                        extra={"run_id": run_id, "store": exc.store,
                               "error": exc.failure.value})
        except SourceDeferred as exc:
            # a list source must wait (throttled, out of reach, or its pass's pages read):
            # the next pass resumes from the persisted cursor
            log.log(logging.INFO if exc.quiet else logging.WARNING,
                    "run discovery deferred: list source waits",
                    extra={"run_id": run_id, "policy": exc.policy, "reason": exc.reason})
        except Exception as exc:
            # a retry when the database could not answer (or the run could not be marked)
            if is_unavailable(exc) or is_busy(exc) or not await _fail(engine, run_id, exc):
                deferred.append(run_id)
    if deferred:
        # one line per pass, however many runs wait
        log.warning("run publication deferred: database unavailable or busy",
                    extra={"run_ids": deferred[:10], "runs": len(deferred)})
    return done


# A run whose publication cannot complete stops here, its error on the row and in its
# report. Batches already released stay released (workers drain them); items not released
# are left for a later run, whose predicate finds them.
_FAIL_RUN = Statement("publication.fail", (
    "Mark a still-publishing run failed with an error code and message in its report, "
    "returning it only to the replica that marked it."), """
    UPDATE runs SET state = 'failed', error = :code,
           report = report || jsonb_build_object('error', jsonb_build_object(
               'code', CAST(:code AS text), 'message', CAST(:message AS text)))
    WHERE id = :id AND state = 'publishing'  -- only the replica that fails it logs it
    RETURNING id
""")


async def _fail(engine: AsyncEngine, run_id: int, exc: Exception) -> bool:
    """Mark the run failed with `exc` described; log it once (only the caller whose update
    took the row). False when the mark itself could not be written: the run stays
    publishing and the next pass tries it again."""
    code, message = _failure_report(exc)
    try:
        marked = await fetch(engine, _FAIL_RUN, {"id": run_id, "code": code,
                                                 "message": message})
    except Exception as mark_exc:
        if not (is_unavailable(mark_exc) or is_busy(mark_exc)):
            log.exception("run publication failed and could not be marked failed",
                          extra={"run_id": run_id, "error_code": code})
        return False
    if marked:
        log.error("run publication failed", exc_info=exc,
                  extra={"run_id": run_id, "error_code": code})
    return True


def _failure_report(exc: BaseException) -> tuple[str, str]:
    """The error code and message a failed run reports: from the exception's type and
    SQLSTATE only, never its text (it may quote the values of the row that failed)."""
    if isinstance(exc, sa_exc.DBAPIError):
        orig = exc.orig
        cause = getattr(orig, "__cause__", None) or orig
        return ("database-error", f"the database refused a publication statement: "
                                  f"{type(cause).__name__} (SQLSTATE "
                                  f"{sqlstate(exc) or 'unknown'})")
    if isinstance(exc, OverflowError | ValueError):
        return ("unrepresentable-value", f"a value read from the ledger cannot be "
                                         f"represented: {type(exc).__name__}")
    return "publication-error", f"publication stopped by an unexpected {type(exc).__name__}"


# The newest operator action's id (one look at the end of the primary key), read with the
# run rows: a count is shared only beside the action it began after (see ProgressCache).
_LAST_ACTION: Final = "(SELECT coalesce(max(id), 0) FROM operator_actions) AS last_action"
_RUN = Statement("publication.get", (
    "One run's row by id, with the newest operator action's id (what its counts are shared "
    "beside)."), f"SELECT *, {_LAST_ACTION} FROM runs WHERE id = :id")  # noqa: S608


async def run_status(engine: AsyncEngine, run_id: int,
                     progress: ProgressCache) -> dict[str, Any] | None:
    """A run with its progress: items by status, attempts by outcome, oldest remaining
    (through `progress`: shared and at most its max age old)."""
    rows = await fetch(engine, _RUN, {"id": run_id})
    if not rows:
        return None
    run = dict(rows[0]._mapping)
    counts = await progress.get(engine, run_id, _version(run))
    return {**run, **counts}


def _version(run: dict[str, Any]) -> RunVersion:
    """What a count of `run` is shared beside (and `last_action` leaves the row)."""
    return RunVersion(run["state"], run["released"], run.pop("last_action"))


# One statement (one snapshot: items and attempts agree) for any number of runs: rows of
# (run, 'items', status, n) (pending items under a legal hold count as 'held'),
# (run, 'attempts', outcome, n) and (run, 'oldest', due_at).
# Each part reaches the items through the runs' batches (batches' (run_id, seq) key, then
# items_batch_cover, which holds their status, id and hold: no item row is read); only the
# oldest remaining reads item rows, and only unfinished ones. The oldest is raised to
# Python's earliest instant as in _RECORD_CANDIDATES (per row: none is NULL).
_PROGRESS = Statement("publication.progress", (
    "Runs' items counted by status, attempts by outcome and oldest unfinished due_at, for "
    "several runs at once (reads every item and attempt of those runs)."), """
    SELECT b.run_id, 'items' AS kind,
           CASE WHEN i.status = 'pending' AND i.hold_id IS NOT NULL THEN 'held'
                ELSE i.status END AS key,
           count(*) AS n, CAST(NULL AS timestamptz) AS oldest
    FROM items i JOIN batches b ON b.id = i.batch_id
    WHERE b.run_id = ANY(CAST(:ids AS bigint[]))
    GROUP BY b.run_id, 3
    UNION ALL
    SELECT b.run_id, 'attempts', a.outcome, count(*), NULL
    FROM attempts a JOIN items i ON i.id = a.item_id JOIN batches b ON b.id = i.batch_id
    WHERE b.run_id = ANY(CAST(:ids AS bigint[]))
    GROUP BY b.run_id, a.outcome
    UNION ALL
    SELECT b.run_id, 'oldest', NULL, 0, min(greatest(i.due_at, '0001-01-01 00:00:00+00'))
    FROM items i JOIN batches b ON b.id = i.batch_id
    WHERE b.run_id = ANY(CAST(:ids AS bigint[])) AND i.status IN ('pending', 'leased')
    GROUP BY b.run_id
""")


async def runs_progress(engine: AsyncEngine, run_ids: Sequence[int]
                        ) -> dict[int, dict[str, Any]]:
    """Count each run's items by status and attempts by outcome, and find its oldest
    remaining item, in one statement: every item and attempt of these runs is read. A run
    with no items (or no such run) has empty counts."""
    progress: dict[int, dict[str, Any]] = {
        run_id: {"items": {}, "attempts": {}, "oldest_remaining_due_at": None}
        for run_id in run_ids}
    if not progress:
        return progress
    for row in await fetch(engine, _PROGRESS, {"ids": list(progress)}):
        counts = progress[row.run_id]
        if row.kind == "oldest":
            counts["oldest_remaining_due_at"] = row.oldest
        else:
            counts[row.kind][row.key] = row.n
    return progress


# How old a run's progress may be when the API answers. Counting reads every item and
# attempt of the run, database CPU that a dashboard polling every second would otherwise
# take from the publication and the drain it watches.
PROGRESS_MAX_AGE_S: Final = 2.0
# How old a drained run's may be: publication is over and none of its items is pending or
# leased, so only a re-drive moves its items again (and that is an operator action, which
# ends the wait at once on every replica). What this bounds: retention pruning its finished
# items and a fenced late attempt recorded after it drained.
DRAINED_MAX_AGE_S: Final = 60.0
# Runs whose publication is over: no item joins their batches any more.
_SETTLED: Final = frozenset({"published", "failed"})
_UNFINISHED: Final = ("pending", "held", "leased")


@dataclass(frozen=True)
class RunVersion:
    """What a count is shown beside: the run row's state and released total, and the
    newest operator action's id, as they were when the count began."""

    state: str
    released: int
    last_action: int = 0


def _drained(version: RunVersion, progress: dict[str, Any]) -> bool:
    """The run's publication is over and none of its items is pending or leased."""
    return version.state in _SETTLED and not any(progress["items"].get(s)
                                                  for s in _UNFINISHED)


@dataclass
class _Count:
    started: float
    version: RunVersion  # what the run row and the audit trail said when the count began
    result: asyncio.Future[dict[str, Any]]
    # the statement counting this run and the others begun with it (held here: the event
    # loop keeps only a weak reference to a task)
    batch: asyncio.Future[dict[int, dict[str, Any]]]


@dataclass
class ProgressCache:
    """Run progress counted at most once per `max_age_s` per process (a drained run's at
    most once per `drained_max_age_s`): callers within that age share the last count,
    callers arriving while a count runs wait for it, and the runs one caller needs that
    have no count to share are counted together, in one statement.

    A count is only shared while the run row still says what it said when the count began
    (its state and released total), so no count taken before a publication step is shown
    beside the row after it (a run published with no items counted yet would look
    finished), and while no operator action has been recorded since (a re-drive, on any
    replica, puts a drained run's items back to pending). `forget` drops every count."""

    max_age_s: float = PROGRESS_MAX_AGE_S
    drained_max_age_s: float = DRAINED_MAX_AGE_S
    max_runs: int = 1024
    # statements run and runs counted, since the process started
    statements: int = 0
    runs_counted: int = 0
    _counts: dict[int, _Count] = field(default_factory=dict, repr=False)

    async def get(self, engine: AsyncEngine, run_id: int, version: RunVersion
                  ) -> dict[str, Any]:
        """One run's progress."""
        return (await self.get_many(engine, {run_id: version}))[run_id]

    async def get_many(self, engine: AsyncEngine, versions: Mapping[int, RunVersion]
                       ) -> dict[int, dict[str, Any]]:
        """Each run's progress, counting those without a count to share in one statement."""
        now = time.monotonic()
        results: dict[int, asyncio.Future[dict[str, Any]]] = {}
        missing: list[int] = []
        for run_id, version in versions.items():
            count = self._counts.get(run_id)
            if count is not None and self._shareable(count, version, now):
                results[run_id] = count.result
            else:
                missing.append(run_id)
        if missing:
            self.statements += 1
            self.runs_counted += len(missing)
            batch = asyncio.ensure_future(runs_progress(engine, missing))
            loop = asyncio.get_running_loop()
            for run_id in missing:
                result: asyncio.Future[dict[str, Any]] = loop.create_future()
                result.add_done_callback(functools.partial(self._forget_failure, run_id))
                self._counts.pop(run_id, None)  # re-inserted: the dict stays oldest first
                self._counts[run_id] = _Count(now, versions[run_id], result, batch)
                results[run_id] = result
            batch.add_done_callback(functools.partial(
                _settle, {run_id: results[run_id] for run_id in missing}))
            self._evict()
        # shielded: a caller that goes away does not cancel the count the others wait for
        return {run_id: await asyncio.shield(result) for run_id, result in results.items()}

    def forget(self) -> None:
        """Drop every count (items of some runs changed state backwards)."""
        self._counts.clear()

    def _shareable(self, count: _Count, version: RunVersion, now: float) -> bool:
        if count.version != version:
            return False
        if not count.result.done():
            return True  # wait for the count in progress
        if count.result.cancelled() or count.result.exception() is not None:
            return False
        drained = _drained(version, count.result.result())
        return now - count.started <= (self.drained_max_age_s if drained else self.max_age_s)

    def _forget_failure(self, run_id: int, result: asyncio.Future[dict[str, Any]]) -> None:
        count = self._counts.get(run_id)
        if (result.cancelled() or result.exception() is not None) and \
                count is not None and count.result is result:
            del self._counts[run_id]

    def _evict(self) -> None:
        while len(self._counts) > self.max_runs:
            del self._counts[next(iter(self._counts))]  # the oldest count


def _settle(results: dict[int, asyncio.Future[dict[str, Any]]],
            batch: asyncio.Future[dict[int, dict[str, Any]]]) -> None:
    """Hand each run its part of a finished batch count (or the batch's failure)."""
    for run_id, result in results.items():
        if result.done():
            continue
        if batch.cancelled():
            result.cancel()
        elif (error := batch.exception()) is not None:
            result.set_exception(error)
        else:
            result.set_result(batch.result()[run_id])


_EXISTS = Statement("publication.exists", "Whether a run exists (one primary-key lookup).",
                    "SELECT 1 FROM runs WHERE id = :id")


async def run_exists(engine: AsyncEngine, run_id: int) -> bool:
    """Whether the run exists (one primary-key lookup)."""
    return bool(await fetch(engine, _EXISTS, {"id": run_id}))


_LIST = Statement("publication.list", (
    "Runs newest first, before a keyset cursor (a run id), optionally of one policy, state "
    "or kind, with the newest operator action's id."), f"""
    SELECT *, {_LAST_ACTION} FROM runs
    WHERE (CAST(:before AS bigint) IS NULL OR id < :before)
      AND (CAST(:policy AS text) IS NULL OR policy = :policy)
      AND (CAST(:state AS text) IS NULL OR state = :state)
      AND (CAST(:dry_run AS boolean) IS NULL OR dry_run = :dry_run)
    ORDER BY id DESC LIMIT :limit
""")  # noqa: S608 - only a constant fragment is interpolated


async def list_runs(engine: AsyncEngine, *, limit: int, before: int | None,
                    progress: ProgressCache, policy: str | None = None,
                    state: str | None = None, dry_run: bool | None = None
                    ) -> list[dict[str, Any]]:
    """Newest first; `before` is the keyset cursor (a run id). Each run with its progress
    as run_status gives it (through `progress`); the runs without a count to share are
    counted together in one statement."""
    params = {"before": before, "limit": limit, "policy": policy, "state": state,
              "dry_run": dry_run}
    rows = [dict(r._mapping) for r in await fetch(engine, _LIST, params)]
    counts = await progress.get_many(engine, {row["id"]: _version(row) for row in rows})
    return [{**row, **counts[row["id"]]} for row in rows]
