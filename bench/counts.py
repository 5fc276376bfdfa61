"""Counts that do not drift: what one drain made PostgreSQL do, per item.

Items/s and CPU per item move with the machine's load; these do not. Around one drain
(`Window.open()` before the drain's first connection, `Window.close()` after its last one
closed) this reads:

  transactions      xact_commit + xact_rollback of the drain's database (pg_stat_database)
  rows written      n_tup_ins / n_tup_upd / n_tup_hot_upd / n_tup_del of every table of the
                    drain's database (pg_stat_user_tables), and the share of the main
                    table's updates that were HOT (n_tup_hot_upd / n_tup_upd)
  WAL bytes         pg_current_wal_insert_lsn() after minus before: SERVER-WIDE, so any other
                    database's activity, autovacuum and checkpoints' full-page images in
                    the window count too (a floor on a quiet server, inflated on a busy one)
  pg_stat_statements, when the server preloads it (else these are null):
    statements      calls of top-level statements in the drain's database (BEGIN and COMMIT
                    included, as the server counts them)
    statement WAL   wal_bytes of those statements: the drain's database only
    dirtied         shared_blks_dirtied of those statements

Why they hold still: a backend keeps its table and database counters for up to 10 s before
it publishes them (PostgreSQL 15+, pgstat_report_stat), and pg_stat_force_next_flush()
only flushes the backend that calls it. A backend that exits publishes everything first,
before it leaves pg_stat_activity. So both ends of the window wait until the drain's
database has no client backend left: the caller closes its connections (engine.dispose(),
conn.close()), and `Window` waits for their backends to be gone. Every reading except the
table counters is taken from the maintenance database, so the window holds none of this
module's own statements or transactions; the table counters are read on a connection of
the drain's database outside the window (reading them writes no rows).

A window whose pg_stat_statements evicted entries meanwhile (pg_stat_statements_info.dealloc
moved) reports its statement figures as null: a sum over evicted entries would be short.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from bench.common import plain_url

QUIET_TIMEOUT_S = 30.0  # how long the drain's backends may take to exit
QUIET_POLL_S = 0.01
MIN_SERVER_VERSION = 150000  # the stats of exited backends are in shared memory from 15 on

# Per-item figures, in the order they are printed. Keys of `per_item`.
PER_ITEM = ("statements", "transactions", "rows_written", "rows_inserted", "rows_updated",
            "rows_hot_updated", "rows_deleted", "wal_bytes", "statement_wal_bytes",
            "buffers_dirtied")

_OTHER_CLIENTS = """
    SELECT count(*) FROM pg_stat_activity
    WHERE datname = $1 AND backend_type = 'client backend' AND pid <> pg_backend_pid()"""
_TABLES = """
    SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
    FROM pg_stat_user_tables WHERE schemaname = 'public'"""
_WAL_POSITION = "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"
_TRANSACTIONS = """
    SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1"""
_PGSS_READY = """
    SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'pg_stat_statements')
       AND 'pg_stat_statements' = ANY (string_to_array(
               replace(current_setting('shared_preload_libraries'), ' ', ''), ','))"""
_STATEMENTS = """
    SELECT coalesce(sum(calls), 0)::bigint AS calls,
           coalesce(sum(wal_bytes), 0)::bigint AS wal_bytes,
           coalesce(sum(shared_blks_dirtied), 0)::bigint AS dirtied,
           (SELECT dealloc FROM pg_stat_statements_info) AS dealloc
    FROM pg_stat_statements
    WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1)"""


@dataclass(frozen=True)
class Reading:
    """The server's counters at one end of a window."""

    wal_position: int  # bytes since 0/0
    transactions: int
    statements: asyncpg.Record | None


def _table_rows(rows: Sequence[asyncpg.Record]) -> dict[str, tuple[int, int, int, int]]:
    return {r["relname"]: (r["n_tup_ins"], r["n_tup_upd"], r["n_tup_hot_upd"], r["n_tup_del"])
            for r in rows}


class Window:
    """Counters of one database around one drain. `server_url` is the maintenance database
    (where the readings are taken), `db_url` the drain's; `main_table` is the table whose
    HOT share is the headline (items for Sweeper, the queue table for PgQueuer)."""

    def __init__(self, server_url: str, db_url: str, main_table: str) -> None:
        self.server_url = plain_url(server_url)
        self.db_url = plain_url(db_url)
        self.db_name = make_url(db_url).database or ""
        self.main_table = main_table
        self._tables: dict[str, tuple[int, int, int, int]] | None = None
        self._start: Reading | None = None

    async def open(self) -> None:
        """Start the window. Every connection to the drain's database must be closed (or
        closing) by now: the setup's counters must not land inside the window."""
        await self._wait_quiet()
        self._tables = await self._read_tables()
        await self._wait_quiet()  # the reader's own transaction counts before the window
        self._start = await self._read_server()

    async def close(self, items: int) -> dict[str, Any]:
        """End the window (the drain's connections closed by now) and report its counts."""
        if self._start is None or self._tables is None:
            raise RuntimeError("Window.close() before open()")
        await self._wait_quiet()
        end = await self._read_server()
        tables = await self._read_tables()
        return self._report(self._start, end, self._tables, tables, items)

    async def _wait_quiet(self) -> None:
        """Until no client backend is connected to the drain's database (each published
        its counters on its way out)."""
        conn = await asyncpg.connect(self.server_url)
        try:
            deadline = time.monotonic() + QUIET_TIMEOUT_S
            while await conn.fetchval(_OTHER_CLIENTS, self.db_name):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.db_name}: client backends still connected "
                                       f"after {QUIET_TIMEOUT_S:.0f}s")
                await asyncio.sleep(QUIET_POLL_S)
        finally:
            await conn.close()

    async def _read_tables(self) -> dict[str, tuple[int, int, int, int]] | None:
        conn = await asyncpg.connect(self.db_url)
        try:
            if int(await conn.fetchval("SHOW server_version_num")) < MIN_SERVER_VERSION:
                return None
            return _table_rows(await conn.fetch(_TABLES))
        finally:
            await conn.close()

    async def _read_server(self) -> Reading:
        conn = await asyncpg.connect(self.server_url)
        try:
            statements = None
            if await conn.fetchval(_PGSS_READY):
                statements = await conn.fetchrow(_STATEMENTS, self.db_name)
            return Reading(wal_position=int(await conn.fetchval(_WAL_POSITION)),
                           transactions=int(await conn.fetchval(_TRANSACTIONS, self.db_name)),
                           statements=statements)
        finally:
            await conn.close()

    def _report(self, start: Reading, end: Reading,
                before: dict[str, tuple[int, int, int, int]] | None,
                after: dict[str, tuple[int, int, int, int]] | None, items: int
                ) -> dict[str, Any]:
        tables: dict[str, dict[str, int]] | None = None
        if before is not None and after is not None:
            tables = {}
            for name, now in sorted(after.items()):
                then = before.get(name, (0, 0, 0, 0))
                ins, upd, hot, dele = (a - b for a, b in zip(now, then, strict=True))
                if ins or upd or dele:
                    tables[name] = {"inserted": ins, "updated": upd, "hot_updated": hot,
                                    "deleted": dele}
        total = {k: sum(t[k] for t in tables.values()) for k in
                 ("inserted", "updated", "hot_updated", "deleted")} if tables is not None else None
        main = (tables or {}).get(self.main_table)
        stmts = _statement_delta(start.statements, end.statements)
        doc: dict[str, Any] = {
            "items": items,
            "transactions": end.transactions - start.transactions,
            "rows": total, "tables": tables,
            "main_table": self.main_table,
            "hot_update_share": round(main["hot_updated"] / main["updated"], 4)
            if main and main["updated"] else None,
            "wal_bytes": end.wal_position - start.wal_position,
            "statements": None if stmts is None else stmts["calls"],
            "statement_wal_bytes": None if stmts is None else stmts["wal_bytes"],
            "buffers_dirtied": None if stmts is None else stmts["dirtied"],
            "pg_stat_statements": stmts is not None,
        }
        doc["per_item"] = per_item(doc)
        return doc


def _statement_delta(start: asyncpg.Record | None, end: asyncpg.Record | None
                     ) -> dict[str, int] | None:
    if start is None or end is None or start["dealloc"] != end["dealloc"]:
        return None
    return {k: int(end[k]) - int(start[k]) for k in ("calls", "wal_bytes", "dirtied")}


def per_item(doc: dict[str, Any]) -> dict[str, float | None]:
    """Each count divided by the items drained (None where the count is)."""
    rows = doc["rows"]
    counts: dict[str, int | None] = {
        "statements": doc["statements"], "transactions": doc["transactions"],
        "rows_written": None if rows is None
        else rows["inserted"] + rows["updated"] + rows["deleted"],
        **{f"rows_{k}": None if rows is None else rows[k]
           for k in ("inserted", "updated", "hot_updated", "deleted")},
        "wal_bytes": doc["wal_bytes"], "statement_wal_bytes": doc["statement_wal_bytes"],
        "buffers_dirtied": doc["buffers_dirtied"]}
    n = doc["items"]
    return {k: None if v is None else round(v / n, 4) for k, v in counts.items()}


def summarize_counts(reps: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """Median, min and max over repetitions of each per-item count and of the HOT share
    (null where no repetition had it)."""
    docs = [r for r in reps if r is not None]
    series: dict[str, list[float]] = {k: [d["per_item"][k] for d in docs
                                          if d["per_item"][k] is not None] for k in PER_ITEM}
    series["hot_update_share"] = [d["hot_update_share"] for d in docs
                                  if d["hot_update_share"] is not None]
    return {k: {"median": round(statistics.median(v), 4), "min": round(min(v), 4),
                "max": round(max(v), 4)} if v else None for k, v in series.items()}


def summary_line(cell: dict[str, Any] | None) -> str:
    """One line of per-item medians for the printed summary."""
    if not cell:
        return "counts: none"

    def median(key: str) -> str:
        return "null" if cell.get(key) is None else f"{cell[key]['median']:g}"

    return (f"per item: {median('statements')} statements, {median('transactions')} xacts, "
            f"{median('rows_written')} rows written ({median('rows_updated')} updated, "
            f"{median('rows_hot_updated')} HOT), WAL {median('wal_bytes')} B (statements "
            f"{median('statement_wal_bytes')}), {median('buffers_dirtied')} buffers dirtied; "
            f"HOT share {median('hot_update_share')}")
