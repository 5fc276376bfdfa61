"""Publication: a run's due items released into batches, for the workers to claim.

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
import hashlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.cluster.leader import CLUSTER
from service.db.engine import is_busy, is_unavailable, sqlstate
from service.db.statements import Statement, fetch
from service.db.statements import run as run_statement
from service.db.wakeups import wake_workers
from service.errors import NotLeader
from service.observability import metrics, tracing
from service.runs.reports import CANDIDATE, candidate_params, record_candidates
from service.sweeps.list_pages import SourceDeferred
from service.sweeps.store_databases import StoreError

if TYPE_CHECKING:
    from service.runs.discovery import Discovery

log = logging.getLogger(__name__)

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
    WHERE {CANDIDATE}
      AND (policy, policy_version) = (
          SELECT policy, policy_version FROM items
          WHERE {CANDIDATE}
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
    UPDATE items SET released_at = now(), batch_id = batch.id, updated_at = now(),
                     trace_parent = :trace
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


_TRACE_PARENT = Statement("publication.trace_parent", (
    "The trace context of the request that triggered a run (read only while tracing)."),
    "SELECT trace_parent FROM runs WHERE id = :id")


async def publish(engine: AsyncEngine, run_id: int, *, batch_size: int,
                  lanes: int = PUBLICATION_LANES, discovery: Discovery | None = None,
                  term: int | None = None) -> bool:
    """Publish one run to completion, its store sources' candidates discovered first
    (service/runs/discovery.py). False when another publisher holds it. With the leader's
    `term`, each chunk commits only while that term's lease is in force (NotLeader).
    Tracing on: a span in the trace of the request that triggered it."""
    tracer = tracing.tracer()
    if tracer is None:
        return await _publish(engine, run_id, batch_size, lanes, discovery, term)
    rows = await fetch(engine, _TRACE_PARENT, {"id": run_id})
    parent = tracing.stored_context(rows[0].trace_parent if rows else None)
    with tracer.start_as_current_span("sweeper.publish", context=parent,
                                      attributes={"sweeper.run.id": run_id}):
        return await _publish(engine, run_id, batch_size, lanes, discovery, term)


async def _publish(engine: AsyncEngine, run_id: int, batch_size: int, lanes: int,
                   discovery: Discovery | None, term: int | None) -> bool:
    started = time.perf_counter()
    async with engine.begin() as conn:
        run = await _publishing_run(conn, run_id, _TAKE_RUN)
        if run is None:
            return False
        sourced = bool(discovery and not run["report"] and discovery.sourced(run))
        if not run["report"] and not sourced:
            await record_candidates(conn, run)
    if sourced:
        assert discovery is not None
        # page by page, each its own transaction: no ledger lock is held across the store
        await discovery.discover(engine, run)
        async with engine.begin() as conn:
            run = await _publishing_run(conn, run_id, _TAKE_RUN)
            if run is None:
                return False
            if not run["report"]:
                await record_candidates(conn, run, discovered=True)
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
        rows = (await run_statement(conn, _PICK, {**candidate_params(run), "limit": limit})).all()
        if not rows:
            break
        ids = [r.id for r in rows]
        policy, version = rows[0].policy, rows[0].policy_version
        with _batch_span(run["id"], policy, len(ids)) as trace_parent:
            await run_statement(conn, _RELEASE_BATCH, {
                "run": run["id"], "policy": policy, "version": version,
                "digest": batch_digest(policy, version, run["cutoff"], ids),
                "n": len(ids), "ids": ids, "trace": trace_parent})
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
        await wake_workers(conn)  # inside the chunk's transaction: sent at its commit
        metrics.ITEMS_RELEASED.inc(released)  # counted a moment before the commit
    return released


@contextmanager
def _batch_span(run_id: int, policy: str, items: int) -> Iterator[str | None]:
    """Tracing on: a span for the batch, whose `traceparent` its items keep (their claims,
    calls and completions are its children); else nothing to keep."""
    tracer = tracing.tracer()
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span("sweeper.batch", attributes={
            "sweeper.run.id": run_id, "sweeper.policy": policy,
            "sweeper.items": items}) as span:
        yield tracing.traceparent(span)


_REMAINING = Statement("publication.remaining", (
    "Candidates of the run still unreleased once every lane is done (left for a later run)."),
    f"SELECT count(*) FROM items WHERE {CANDIDATE}")  # noqa: S608 - constant fragment


_MARK_PUBLISHED = Statement("publication.mark_published", (
    "Mark the run published, with the candidates it left unreleased."),
    "UPDATE runs SET state = 'published', published_at = clock_timestamp(), "
    "remaining = :remaining WHERE id = :id")


async def _finish(conn: AsyncConnection, run: Any) -> None:
    remaining = 0
    if not run["dry_run"]:
        remaining = (await run_statement(conn, _REMAINING, candidate_params(run))).scalar_one()
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
        metrics.RUNS_FAILED.inc()
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
