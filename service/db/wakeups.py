"""Waking the workers: the notification channels every worker process listens on, and the
one statement that wakes idle workers.

Workers poll for work anyway (service/worker/pool.py); a notification only makes an idle
one claim at once. Whatever makes items claimable wakes them with `WAKE_WORKERS`:
publication's chunks (service/runs/publication.py), a released legal hold
(service/ledger/holds.py) and a resumed scope or workers-wide resume
(service/budget/scope_controls.py), inside their transaction, so the notification is
delivered when it commits; and webhook intake (service/webhooks/intake.py), after its
commits, on its own asyncpg pool (it sends the statement's `.text`). A placed hold
announces itself on HOLDS_CHANNEL with its id (service/ledger/holds.py `_PLACE`). The
listener is service/worker/postgres.py.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy.ext.asyncio import AsyncConnection

from service.db.statements import Statement, run

RELEASED_CHANNEL: Final = "sweeper_released"  # items became claimable: no payload
HOLDS_CHANNEL: Final = "sweeper_holds"  # a hold committed: its id, as text

WAKE_WORKERS = Statement("wakeups.wake_workers", (
    "Wake idle workers: items became claimable (delivered when the sender's transaction "
    "commits)."), f"NOTIFY {RELEASED_CHANNEL}")


async def wake_workers(conn: AsyncConnection) -> None:
    """Wake idle workers once the caller's transaction commits."""
    await run(conn, WAKE_WORKERS)
