"""Moving the database's clock in tests: time travel on the data, not on the clock.

The service reads only the database's clock (now(), clock_timestamp()) and compares it with
instants its rows store: a bucket's last refill, a closure's end, a claim position's last
front read, an item's next attempt and lease expiry. Moving those instants `seconds` earlier
is, to every statement, the database's clock moving `seconds` ahead. Production SQL is
untouched (the admission statement keeps its text, plan and cost), and a test waits for a
refill or a closure to end without sleeping through it.

`CLOCK_COLUMNS` lists, per table, every instant the buckets' and the claims' statements
compare with the clock; `OTHER_TIME_COLUMNS` the timestamps they do not (records of when
something happened, and `due_at`, which publication compares with a run's cutoff, not with
the clock). test_db_clock.py fails when a timestamp column appears in neither, so a new
clock-relative column cannot silently escape the travel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

CLOCK_COLUMNS: Final = {
    "scopes": ("refilled_at", "closed_until", "front_scanned_at"),
    "items": ("next_attempt_at", "lease_expires_at"),
}
OTHER_TIME_COLUMNS: Final = {
    "scopes": ("created_at", "updated_at"),
    "items": ("due_at", "released_at", "created_at", "updated_at", "completed_at",
              "last_started_at"),
}
_SCOPE_COLUMN: Final = {"scopes": "name", "items": "scope"}


async def advance(engine: AsyncEngine, seconds: float, *,
                  scopes: Sequence[str] | None = None) -> None:
    """As if the database's clock moved `seconds` ahead, for `scopes` (every scope when None)
    and their items: buckets refill, closures end, front reads come due, retries and leases
    come due, exactly as if that much time had passed. NULLs stay NULL; -infinity stays."""
    if seconds < 0:
        raise ValueError("the clock only moves ahead")
    async with engine.begin() as conn:
        for table, columns in CLOCK_COLUMNS.items():
            shifted = ", ".join(f"{c} = {c} - make_interval(secs => :s)" for c in columns)
            await conn.execute(text(
                f"UPDATE {table} SET {shifted} "
                f"WHERE CAST(:scopes AS text[]) IS NULL "
                f"OR {_SCOPE_COLUMN[table]} = ANY(CAST(:scopes AS text[]))"),
                {"s": seconds, "scopes": None if scopes is None else list(scopes)})
