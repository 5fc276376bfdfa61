"""The operator audit trail: who changed what by hand, and why."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from service.db.statements import Statement, run

_RECORD = Statement("audit_trail.record", (
    "Append one operator action (who, what, why, on which rows) in the transaction of the "
    "change it records."), """
    INSERT INTO operator_actions (actor, action, reason, details)
    VALUES (:actor, :action, :reason, CAST(:details AS jsonb))
""")


async def record(conn: AsyncConnection, *, actor: str, action: str, reason: str | None,
                 details: dict[str, Any]) -> None:
    """Append one operator action inside the caller's transaction (the change and its
    audit row commit together)."""
    await run(conn, _RECORD, {"actor": actor, "action": action, "reason": reason,
                              "details": json.dumps(details)})
