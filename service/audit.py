"""The operator audit trail: who changed what by hand, and why."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

_RECORD = text("""
    INSERT INTO operator_actions (actor, action, reason, details)
    VALUES (:actor, :action, :reason, CAST(:details AS jsonb))
""")


async def record(conn: AsyncConnection, *, actor: str, action: str, reason: str | None,
                 details: dict[str, Any]) -> None:
    """Append one operator action inside the caller's transaction (the change and its
    audit row commit together)."""
    await conn.execute(_RECORD, {"actor": actor, "action": action, "reason": reason,
                                 "details": json.dumps(details)})
