"""What the drills read of the ledger, as operators read it: items by status (a leased item
is pending with a lease), an item's attempts with its success (which has no attempt row),
and when each call started."""

from __future__ import annotations

from typing import Final

from service.db.statements import item_status

# An item's attempts as (outcome, fenced), in the order they finished: its attempt rows,
# and its success, which has no row (the item records it: service/ledger/completions.py)
ATTEMPT_HISTORY_SQL: Final = """
    SELECT outcome, fenced FROM (
        SELECT a.outcome, a.fenced, a.finished_at AS at, a.id AS n
        FROM attempts a JOIN items i ON i.id = a.item_id WHERE i.object_id = $1
        UNION ALL
        SELECT 'succeeded', false, i.completed_at, 0 FROM items i
        WHERE i.object_id = $1 AND i.status = 'succeeded'
    ) h
    ORDER BY at, n"""

CALL_STARTS_SQL: Final = """
    SELECT t FROM (
        SELECT extract(epoch FROM started_at) AS t, outcome FROM attempts
        UNION ALL
        SELECT extract(epoch FROM last_started_at), 'succeeded' FROM items
        WHERE status = 'succeeded'
    ) c
    WHERE $1::text IS NULL OR outcome = $1 ORDER BY t"""

# items by status as operators read it (a leased item is pending with a lease)
STATUSES_SQL: Final = (f"SELECT {item_status('items')} AS status, "  # noqa: S608
                        "count(*) AS n FROM items GROUP BY 1")
