"""The ledger's minutes (migration 0026): a process's tally added to them, the backlog sampled
into them by the leader, and the series the console's charts read from them.

Every chart reads one table through an index leading with its key over a window of at most
a week, bucketed in PostgreSQL (`date_bin`) to at most 168 points, so what a page costs does
not grow with the ledger (a million items or none) but with the minutes in its window. The
window ends at the reader's clock (`now`): a chart, not a lease or a budget. Retention
prunes the minutes (service/cluster/retention.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import Statement, fetch, fetch_none, run
from service.history.tally import OUTCOMES, Tally

# what each chart window spans and the width of its buckets: 60, 96 and 168 points
WINDOWS: Final[Mapping[str, tuple[int, int]]] = {
    "hour": (3_600, 60), "day": (86_400, 900), "week": (7 * 86_400, 3_600)}

_POLICY_COLUMNS: Final = (*OUTCOMES, "dead", "fenced", "reclaimed", "closures")
_SCOPE_COLUMNS: Final = ("calls", "succeeded", "throttled", "closures", "reclaimed")
_BATCH_COLUMNS: Final = ("succeeded", "dead", "skipped")


def _adding(table: str, key: Sequence[str], columns: Sequence[str], types: Mapping[str, str],
            what: str) -> Statement:
    """An upsert adding arrays of counts to `table`'s rows, keys in order (two processes
    adding to the same rows lock them in the same order: no deadlock)."""
    names = (*key, *columns)
    arrays = ", ".join(f"CAST(:{n} AS {types.get(n, 'integer')}[])" for n in names)
    return Statement(f"minutes.add_{table}", f"Add a process's counts to {what}.", f"""
        INSERT INTO {table} AS m ({", ".join(names)})
        SELECT * FROM unnest({arrays}) AS t({", ".join(names)})
        ORDER BY {", ".join(key)}
        ON CONFLICT ({", ".join(key)}) DO UPDATE SET
            {", ".join(f"{c} = m.{c} + excluded.{c}" for c in columns)}""")  # noqa: S608


_TIME = {"minute": "timestamptz", "policy": "text", "scope": "text", "batch_id": "bigint"}
_ADD_POLICIES = _adding("policy_minutes", ("minute", "policy"), _POLICY_COLUMNS, _TIME,
                        "each policy's minutes")
_ADD_SCOPES = _adding("scope_minutes", ("scope", "minute", "policy"), _SCOPE_COLUMNS, _TIME,
                      "each scope's minutes")
# a batch pruned meanwhile (retention) has no row to count against: its counts are dropped
_ADD_BATCHES = Statement("minutes.add_batch_minutes", "Add a process's counts to each "
                         "batch's minutes (batches that still exist).", f"""
    INSERT INTO batch_minutes AS m (batch_id, minute, {", ".join(_BATCH_COLUMNS)})
    SELECT t.* FROM unnest(CAST(:batch_id AS bigint[]), CAST(:minute AS timestamptz[]),
                           {", ".join(f"CAST(:{c} AS integer[])" for c in _BATCH_COLUMNS)})
         AS t(batch_id, minute, {", ".join(_BATCH_COLUMNS)})
    WHERE EXISTS (SELECT FROM batches b WHERE b.id = t.batch_id)
    ORDER BY t.batch_id, t.minute
    ON CONFLICT (batch_id, minute) DO UPDATE SET
        {", ".join(f"{c} = m.{c} + excluded.{c}" for c in _BATCH_COLUMNS)}""")  # noqa: S608


def _arrays(rows: Mapping[tuple[Any, ...], Mapping[str, int]], key: Sequence[str],
            columns: Sequence[str]) -> dict[str, list[Any]]:
    params: dict[str, list[Any]] = {name: [] for name in (*key, *columns)}
    for values, counts in rows.items():
        for name, value in zip(key, values, strict=True):
            params[name].append(value)
        for column in columns:
            params[column].append(counts.get(column, 0))
    return params


async def add(engine: AsyncEngine, tally: Tally) -> None:
    """Add `tally`'s counts to the minutes, in one transaction."""
    async with engine.begin() as conn:
        if tally.policies:
            await run(conn, _ADD_POLICIES, _arrays(
                tally.policies, ("minute", "policy"), _POLICY_COLUMNS))
        if tally.scopes:
            await run(conn, _ADD_SCOPES, _arrays(
                tally.scopes, ("minute", "scope", "policy"), _SCOPE_COLUMNS))
        if tally.batches:
            await run(conn, _ADD_BATCHES, _arrays(
                tally.batches, ("minute", "batch_id"), _BATCH_COLUMNS))


_SAMPLE = Statement("minutes.sample", (
    "Record each policy's backlog (eligible items, age of the oldest) in this minute."), """
    INSERT INTO policy_minutes AS m (minute, policy, eligible, oldest_eligible_s)
    SELECT date_trunc('minute', now()), t.policy, t.eligible, t.oldest
    FROM unnest(CAST(:policies AS text[]), CAST(:eligible AS integer[]),
                CAST(:oldest AS double precision[])) AS t(policy, eligible, oldest)
    ORDER BY t.policy
    ON CONFLICT (minute, policy) DO UPDATE
    SET eligible = excluded.eligible, oldest_eligible_s = excluded.oldest_eligible_s""")


async def sample(engine: AsyncEngine, backlog: Mapping[str, tuple[int, float]]) -> None:
    """Record `backlog` (policy -> eligible items, oldest's age in seconds) for this minute
    on the database's clock; a later sample in the same minute replaces it."""
    if backlog:
        names = sorted(backlog)
        await fetch_none(engine, _SAMPLE, {
            "policies": names, "eligible": [backlog[p][0] for p in names],
            "oldest": [backlog[p][1] for p in names]})


@dataclass(frozen=True)
class Series:
    """A chart's data: bucket starts (Unix seconds) and, per named series, a value per
    bucket (None: nothing recorded in it)."""

    x: list[float]
    ys: dict[str, list[float | None]]
    bucket_s: int


def _bucketed(sql_from: str, select: str, group: str = "") -> str:
    """A windowed, bucketed read: `select` over rows of `sql_from` in the window."""
    return f"""
    SELECT extract(epoch FROM date_bin(make_interval(secs => :bucket_s), minute,
                                        TIMESTAMPTZ '2000-01-01 00:00:00+00')) AS at,
           {select}
    FROM {sql_from} AND minute >= to_timestamp(:since)
    GROUP BY 1{group} ORDER BY 1"""  # noqa: S608 - constant fragments only


_OUTCOME_SUMS = ", ".join(f"sum({c}) AS {c}" for c in _POLICY_COLUMNS)
_POLICY_TOTALS = Statement("minutes.policy_totals", (
    "Outcomes and lease events per bucket of a window, over every policy or one."),
    _bucketed("policy_minutes WHERE (CAST(:policy AS text) IS NULL OR policy = :policy)",
              _OUTCOME_SUMS))
_BACKLOG = Statement("minutes.backlog", (
    "Each policy's sampled backlog per bucket of a window: the largest in the bucket."),
    _bucketed("policy_minutes WHERE eligible IS NOT NULL",
              "policy, max(eligible) AS eligible, max(oldest_eligible_s) AS oldest", ", 2"))
_SCOPE = Statement("minutes.scope", (
    "One scope's calls, successes, 429s, closures and expired leases per bucket of a "
    "window."), _bucketed("scope_minutes WHERE scope = :scope",
                          ", ".join(f"sum({c}) AS {c}" for c in _SCOPE_COLUMNS)))
_RUN = Statement("minutes.run", (
    "A run's items finished per bucket of a window, summed over its batches."), _bucketed(
    "batch_minutes m JOIN batches b ON b.id = m.batch_id WHERE b.run_id = :run_id",
    ", ".join(f"sum(m.{c}) AS {c}" for c in _BATCH_COLUMNS)))


def window(name: str, now: float) -> tuple[int, list[float]]:
    """The window's bucket width in seconds, and its bucket starts up to `now`."""
    span_s, bucket_s = WINDOWS[name]
    last = now - now % bucket_s
    first = last - (span_s // bucket_s - 1) * bucket_s
    return bucket_s, [first + i * bucket_s for i in range(span_s // bucket_s)]


def _series(rows: Sequence[Any], starts: list[float], columns: Sequence[str],
            bucket_s: int) -> Series:
    at = {float(r.at): r for r in rows}
    ys = {c: [None if (r := at.get(x)) is None else float(getattr(r, c) or 0)
              for x in starts] for c in columns}
    return Series(starts, ys, bucket_s)


async def _read(engine: AsyncEngine, statement: Statement, name: str, now: float,
                **params: Any) -> tuple[Sequence[Any], list[float], int]:
    bucket_s, starts = window(name, now)
    rows = await fetch(engine, statement, {"since": starts[0], "bucket_s": bucket_s, **params})
    return rows, starts, bucket_s


async def outcomes(engine: AsyncEngine, name: str, now: float, policy: str | None = None
                   ) -> Series:
    """Outcomes, dead items, fenced completions, expired leases taken over and closures per
    bucket of window `name`, over every policy or `policy`."""
    rows, starts, bucket_s = await _read(engine, _POLICY_TOTALS, name, now, policy=policy)
    return _series(rows, starts, _POLICY_COLUMNS, bucket_s)


async def backlog(engine: AsyncEngine, name: str, now: float) -> tuple[Series, Series]:
    """Per policy: eligible items, and the age of the oldest in seconds."""
    rows, starts, bucket_s = await _read(engine, _BACKLOG, name, now)
    eligible: dict[str, dict[float, float]] = {}
    oldest: dict[str, dict[float, float]] = {}
    for r in rows:
        eligible.setdefault(r.policy, {})[float(r.at)] = float(r.eligible)
        oldest.setdefault(r.policy, {})[float(r.at)] = float(r.oldest or 0)
    return (Series(starts, {p: [v.get(x) for x in starts] for p, v in sorted(eligible.items())},
                   bucket_s),
            Series(starts, {p: [v.get(x) for x in starts] for p, v in sorted(oldest.items())},
                   bucket_s))


async def scope(engine: AsyncEngine, name: str, now: float, scope_name: str) -> Series:
    rows, starts, bucket_s = await _read(engine, _SCOPE, name, now, scope=scope_name)
    return _series(rows, starts, _SCOPE_COLUMNS, bucket_s)


async def of_run(engine: AsyncEngine, name: str, now: float, run_id: int) -> Series:
    rows, starts, bucket_s = await _read(engine, _RUN, name, now, run_id=run_id)
    return _series(rows, starts, _BATCH_COLUMNS, bucket_s)

