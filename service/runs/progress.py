"""A run as operators read it: its status and report, its progress counted from the ledger
(cached per process, shared by concurrent readers: `ProgressCache`), and the runs list."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import LEASED, Statement, fetch

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


# The newest operator action's id (one look at the end of the primary key), read with the
# run rows: a count is shared only beside the action it began after (see ProgressCache).
_LAST_ACTION: Final = "(SELECT coalesce(max(id), 0) FROM operator_actions) AS last_action"


_RUN = Statement("progress.get", (
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
# (run, 'attempts', outcome, n), (run, 'oldest', due_at) and (run, 'leased', held?, n).
# Each part reaches the items through the runs' batches (batches' (run_id, seq) key, then
# items_batch_cover, which holds their status, id and hold: no item row is read); only the
# unfinished items' rows are read, once, for the oldest remaining and the leases among
# them (a leased item is pending in status: its lease is in no index, migration 0024).
# The oldest is raised to Python's earliest instant as in _RECORD_CANDIDATES (per row: none
# is NULL).
_ITEMS_PART: Final = """
    SELECT b.run_id, 'items' AS kind,
           CASE WHEN i.status = 'pending' AND i.hold_id IS NOT NULL THEN 'held'
                ELSE i.status END AS key,
           count(*) AS n, CAST(NULL AS timestamptz) AS oldest
    FROM items i JOIN batches b ON b.id = i.batch_id
    WHERE b.run_id = ANY(CAST(:ids AS bigint[]))
    GROUP BY b.run_id, 3
"""
# The runs' attempts are gathered first, on their own (MATERIALIZED: item ids and
# statuses from items_batch_cover, each item's attempts from attempts_item), and only then
# is a success's attempt row written before 0024 (when a success had one; it is counted
# with its item below) looked up, one probe of its item per such row (OFFSET 0: PostgreSQL
# 18 would otherwise hash every item). Planned as one join, PostgreSQL walked the whole
# items or attempts table for a run of 50,000 among a million items (160 ms to 3 s:
# bench/reports/2026-12-05-console-charts).
_RUN_ATTEMPTS: Final = """
    WITH run_attempts AS MATERIALIZED (
        SELECT b.run_id, i.id, i.status, a.outcome, a.fenced, a.attempt_no
        FROM batches b JOIN items i ON i.batch_id = b.id JOIN attempts a ON a.item_id = i.id
        WHERE b.run_id = ANY(CAST(:ids AS bigint[])))
"""
_ATTEMPTS_PART: Final = """
    UNION ALL
    SELECT ra.run_id, 'attempts', ra.outcome, count(*), NULL
    FROM run_attempts ra
    WHERE ra.outcome <> 'succeeded' OR ra.fenced OR ra.status <> 'succeeded' OR NOT EXISTS (
        SELECT FROM items s
        WHERE s.id = ra.id AND s.last_started_at IS NULL AND s.attempts = ra.attempt_no
        OFFSET 0)
    GROUP BY ra.run_id, ra.outcome
"""
_REST_PART: Final = f"""
    UNION ALL
    SELECT u.run_id, v.kind, v.key, v.n, v.oldest FROM (
        SELECT b.run_id, min(greatest(i.due_at, '0001-01-01 00:00:00+00')) AS oldest,
               count(*) FILTER (WHERE {LEASED} AND i.hold_id IS NULL)
                   AS leased_open,
               count(*) FILTER (WHERE {LEASED} AND i.hold_id IS NOT NULL)
                   AS leased_held
        FROM items i JOIN batches b ON b.id = i.batch_id
        WHERE b.run_id = ANY(CAST(:ids AS bigint[])) AND i.status = 'pending'
        GROUP BY b.run_id
    ) u CROSS JOIN LATERAL (VALUES
        ('oldest', CAST(NULL AS text), CAST(0 AS bigint), u.oldest),
        ('leased', 'pending', u.leased_open, NULL),
        ('leased', 'held', u.leased_held, NULL)) AS v(kind, key, n, oldest)
"""  # noqa: S608 - only a constant fragment is interpolated
_PROGRESS = Statement("progress.progress", (
    "Runs' items counted by status, attempts by outcome and oldest unfinished due_at, for "
    "several runs at once (reads every item and attempt of those runs)."),
    _RUN_ATTEMPTS + _ITEMS_PART + _ATTEMPTS_PART + _REST_PART)
# the runs lists show no attempts: counting them probes every item's attempts one by one
_ITEM_PROGRESS = Statement("progress.item_progress", (
    "Runs' items counted by status and oldest unfinished due_at, for several runs at once "
    "(the items through their batches' covering index; no attempt is read)."),
    _ITEMS_PART + _REST_PART)


async def runs_progress(engine: AsyncEngine, run_ids: Sequence[int], *,
                        attempts: bool = True) -> dict[int, dict[str, Any]]:
    """Count each run's items by status and attempts by outcome (without `attempts`: none
    is read, and the succeeded items are all it says of them), and find its oldest
    remaining item, in one statement. A run with no items (or no such run) has empty
    counts."""
    progress: dict[int, dict[str, Any]] = {
        run_id: {"items": {}, "attempts": {}, "oldest_remaining_due_at": None}
        for run_id in run_ids}
    if not progress:
        return progress
    leased: list[Any] = []
    statement = _PROGRESS if attempts else _ITEM_PROGRESS
    for row in await fetch(engine, statement, {"ids": list(progress)}):
        counts = progress[row.run_id]
        if row.kind == "oldest":
            counts["oldest_remaining_due_at"] = row.oldest
        elif row.kind == "leased":
            if row.n:
                leased.append(row)
        else:
            counts[row.kind][row.key] = row.n
    for row in leased:  # counted as pending or held above: move them to leased
        items = progress[row.run_id]["items"]
        items[row.key] -= row.n
        if not items[row.key]:
            del items[row.key]
        items["leased"] = items.get("leased", 0) + row.n
    for counts in progress.values():
        # a succeeded item's last attempt has no row (service/ledger/completions.py); one
        # that succeeded before migration 0024 had, and the statement leaves it out (an
        # item confirmed before 0024 counts the success of its deletion call once less)
        if done := counts["items"].get("succeeded", 0):
            by_outcome = counts["attempts"]
            by_outcome["succeeded"] = by_outcome.get("succeeded", 0) + done
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
    replica, puts a drained run's items back to pending). `forget` drops every count.
    Ages are read on `monotonic` (seconds)."""

    max_age_s: float = PROGRESS_MAX_AGE_S
    drained_max_age_s: float = DRAINED_MAX_AGE_S
    max_runs: int = 1024
    monotonic: Callable[[], float] = field(default=time.monotonic, repr=False)
    # statements run and runs counted, since the process started
    statements: int = 0
    runs_counted: int = 0
    # by run and whether the count has its attempts (one that has serves either)
    _counts: dict[tuple[int, bool], _Count] = field(default_factory=dict, repr=False)

    async def get(self, engine: AsyncEngine, run_id: int, version: RunVersion
                  ) -> dict[str, Any]:
        """One run's progress."""
        return (await self.get_many(engine, {run_id: version}))[run_id]

    async def get_many(self, engine: AsyncEngine, versions: Mapping[int, RunVersion], *,
                       attempts: bool = True) -> dict[int, dict[str, Any]]:
        """Each run's progress, counting those without a count to share in one statement;
        without `attempts`, a count without them will do (the runs lists')."""
        now = self.monotonic()
        results: dict[int, asyncio.Future[dict[str, Any]]] = {}
        missing: list[int] = []
        for run_id, version in versions.items():
            keys = [(run_id, True)] if attempts else [(run_id, True), (run_id, False)]
            count = next((c for key in keys if (c := self._counts.get(key)) is not None
                          and self._shareable(c, version, now)), None)
            if count is not None:
                results[run_id] = count.result
            else:
                missing.append(run_id)
        if missing:
            self.statements += 1
            self.runs_counted += len(missing)
            batch = asyncio.ensure_future(runs_progress(engine, missing, attempts=attempts))
            loop = asyncio.get_running_loop()
            for run_id in missing:
                key = (run_id, attempts)
                result: asyncio.Future[dict[str, Any]] = loop.create_future()
                result.add_done_callback(functools.partial(self._forget_failure, key))
                self._counts.pop(key, None)  # re-inserted: the dict stays oldest first
                self._counts[key] = _Count(now, versions[run_id], result, batch)
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

    def _forget_failure(self, key: tuple[int, bool], result: asyncio.Future[dict[str, Any]]
                        ) -> None:
        count = self._counts.get(key)
        if (result.cancelled() or result.exception() is not None) and \
                count is not None and count.result is result:
            del self._counts[key]

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


_EXISTS = Statement("progress.exists", "Whether a run exists (one primary-key lookup).",
                    "SELECT 1 FROM runs WHERE id = :id")


async def run_exists(engine: AsyncEngine, run_id: int) -> bool:
    """Whether the run exists (one primary-key lookup)."""
    return bool(await fetch(engine, _EXISTS, {"id": run_id}))


_LIST = Statement("progress.list", (
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
                    state: str | None = None, dry_run: bool | None = None,
                    attempts: bool = True) -> list[dict[str, Any]]:
    """Newest first; `before` is the keyset cursor (a run id). Each run with its progress
    as run_status gives it (through `progress`; without `attempts`, its attempts need not
    be counted); the runs without a count to share are counted together in one
    statement."""
    params = {"before": before, "limit": limit, "policy": policy, "state": state,
              "dry_run": dry_run}
    rows = [dict(r._mapping) for r in await fetch(engine, _LIST, params)]
    counts = await progress.get_many(engine, {row["id"]: _version(row) for row in rows},
                                     attempts=attempts)
    return [{**row, **counts[row["id"]]} for row in rows]
