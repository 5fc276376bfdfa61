"""A verified webhook delivery recorded in the ledger, exactly once per (source, webhook id):
its receipt and its hints' effect on items, in one statement.

    _RECORD         one statement per delivery: its receipt, bucket rows for new scopes, and
                    its hints' inserts and releases, or the original's receipt
    _RECORD_GROUP   the same for several deliveries at once, in one transaction: one round
                    trip and one commit (one WAL flush) for all of them

The statements are named `Statement`s like every other module's, but run on the intake's
own asyncpg pool (service/webhooks/intake.py), so they take asyncpg's positional `$n`
parameters and are sent as their `.text` (service/db/statements.py says why intake does not
go through `fetch` or `run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

import asyncpg

from service.budget.rules import budget_of
from service.db.statements import LEASED, Statement, covering_hold
from service.ledger import registration
from service.observability import tracing
from service.webhooks.deliveries import Delivery, DeliveryRejected, Hint

Result = Literal["applied", "ignored"]


@dataclass(frozen=True)
class Receipt:
    """What a delivery did (or, for a duplicate, what the original did)."""

    result: Result
    item_ids: tuple[int, ...]
    duplicate: bool
    released: int = 0  # items this delivery made claimable now


# Each delivery's hints: insert the items they name, or make pending ones due sooner and
# release them (a hint never postpones, finished items are left alone), in one lock order
# for every statement (no deadlocks). Shared by _RECORD and _RECORD_GROUP.
_TOUCH_ITEMS_SQL: Final = f"""touched AS (
        INSERT INTO items AS i (tenant_id, object_id, policy, policy_version, operation_key,
                                scope, due_at, released_at, hold_id, trace_parent, region)
        SELECT tenant_id, object_id, policy, policy_version, operation_key, scope, due_at,
               CASE WHEN due_at <= now() THEN now() END, {covering_hold("hints")},
               CASE WHEN due_at <= now() THEN trace_parent END, region
        FROM hints
        ORDER BY operation_key  -- one lock order for every delivery (no deadlocks)
        ON CONFLICT (tenant_id, object_id, policy, policy_version) DO UPDATE
            SET due_at = least(i.due_at, EXCLUDED.due_at),
                released_at = coalesce(i.released_at, EXCLUDED.released_at),
                -- released by this delivery: its calls join the delivery's trace
                trace_parent = CASE WHEN i.released_at IS NULL THEN EXCLUDED.trace_parent
                                    ELSE i.trace_parent END,
                next_attempt_at = CASE WHEN i.released_at IS NULL
                                       THEN least(i.next_attempt_at, now())
                                       ELSE i.next_attempt_at END,
                updated_at = now()
            WHERE i.status = 'pending' AND NOT {LEASED}  -- not in flight
              AND (EXCLUDED.due_at < i.due_at
                   OR (i.released_at IS NULL AND EXCLUDED.released_at IS NOT NULL))
        RETURNING i.id, i.operation_key, i.released_at IS NOT NULL AS released
    ),"""  # noqa: S608 - only a constant fragment is interpolated

# One statement, outside an explicit transaction: atomic by itself, in one round trip.
#  1. `existing`: the receipt of an earlier delivery with this webhook id. If there is one,
#     nothing below writes anything and the caller answers with the original result.
#  2. `new_scopes`: a budget row for each scope that has none yet (never an update: that
#     would lock a row every worker takes tokens from).
#  3. `touched`: insert each hinted item, or advance its due_at (never postpone) and release
#     it when it is due now; only pending items change. Released without a batch, so claims
#     take them first. A released item keeps its next_attempt_at (a backoff the upstream
#     asked for stands). Rows that would not change are not touched and not returned.
#  4. `receipt`: the receipt with the ids of the items touched. A concurrent delivery of
#     the same id that also found no receipt fails here on webhook_receipts_once, and its
#     whole statement (its effect included) rolls back: one effect per webhook id.
_RECORD = Statement("receipts.record", (
    "Apply one webhook delivery once per (source, webhook id): its receipt, new bucket rows, "
    "and its hints' inserts and releases, or the original's receipt."), f"""
    WITH existing AS (
        SELECT result, item_ids FROM webhook_receipts
        WHERE source = $1 AND webhook_id = $2
    ),
    hints AS (
        SELECT h.*, CAST($18 AS text) AS trace_parent,
               CASE WHEN h.delay IS NULL THEN now()
                    ELSE coalesce(to_timestamp(CAST($4 AS double precision)), now())
                         + make_interval(secs => h.delay) END AS due_at
        FROM unnest(CAST($6 AS text[]), CAST($7 AS text[]),
                    CAST($8 AS text[]), CAST($9 AS integer[]),
                    CAST($10 AS text[]), CAST($11 AS text[]),
                    CAST($12 AS double precision[]), CAST($13 AS text[]))
             AS h(tenant_id, object_id, policy, policy_version, operation_key, scope, delay,
                  region)
        WHERE NOT EXISTS (SELECT 1 FROM existing)
    ),
    new_scopes AS (
        INSERT INTO scopes (name, rate_per_second, burst, tokens, objects_per_call)
        SELECT b.name, b.rate, b.burst, b.burst, b.per_call
        FROM unnest(CAST($14 AS text[]), CAST($15 AS double precision[]),
                    CAST($16 AS integer[]), CAST($17 AS integer[]))
             AS b(name, rate, burst, per_call)
        WHERE NOT EXISTS (SELECT 1 FROM existing)
          AND NOT EXISTS (SELECT 1 FROM scopes s WHERE s.name = b.name)
        ORDER BY b.name
        ON CONFLICT (name) DO NOTHING
    ),
    {_TOUCH_ITEMS_SQL}
    receipt AS (
        INSERT INTO webhook_receipts (source, webhook_id, event_type, result, item_ids)
        SELECT $1, $2, $3, $5,
               coalesce((SELECT array_agg(id ORDER BY id) FROM touched), '{{}}')
        WHERE NOT EXISTS (SELECT 1 FROM existing)
        RETURNING item_ids
    )
    SELECT (SELECT item_ids FROM receipt) AS item_ids,
           (SELECT result FROM existing) AS original_result,
           (SELECT item_ids FROM existing) AS original_item_ids,
           (SELECT count(*) FROM touched WHERE released) AS released
""")  # noqa: S608 - only a constant fragment is interpolated
# `delivery_params`' keys in the statements' parameter order: a delivery's, its hints',
# its budgets'
_DELIVERY_COLUMNS: Final = ("source", "webhook_id", "event_type", "event_at", "result")
_HINT_COLUMNS: Final = ("tenants", "objects", "policies", "versions", "keys", "scopes",
                        "delays", "regions")
_BUDGET_COLUMNS: Final = ("budget_scopes", "rates", "bursts", "per_call")
# and last, the request's trace context (tracing on), kept on the items it releases
_RECORD_PARAMS: Final = (*_DELIVERY_COLUMNS, *_HINT_COLUMNS, *_BUDGET_COLUMNS, "trace_parent")

# The same for a group of deliveries (the intake's group commit), in one statement and so
# one transaction and one commit. Each delivery's rows are what `_RECORD` would make of it
# alone, because the intake (service/webhooks/intake.py `Intake._take`) never groups two
# deliveries of one webhook id nor two hints at one item: the group is the same as its
# deliveries applied one after another.
#  1. `deliveries` (one row each, numbered `n`) and `existing`: those whose webhook id has a
#     receipt already change nothing, and answer with it.
#  2. `new_scopes`: as in `_RECORD`, for the new deliveries' hints; a scope two deliveries
#     name gets the budget of the first (as it would applied in order).
#  3. `touched`: as in `_RECORD`, over every new delivery's hints, in one lock order.
#  4. `receipts`: one per new delivery, with the ids of the items its own hints touched. A
#     concurrent statement elsewhere that committed one of these webhook ids fails this whole
#     statement on webhook_receipts_once; nothing of it is written, and the caller applies
#     each delivery again alone.
_RECORD_GROUP = Statement("receipts.record_group", (
    "Apply several webhook deliveries in one transaction, each as receipts.record would alone: "
    "receipts, new bucket rows, inserts and releases, or the originals' receipts."), f"""
    WITH deliveries AS (
        SELECT * FROM unnest(CAST($1 AS integer[]), CAST($2 AS text[]), CAST($3 AS text[]),
                             CAST($4 AS text[]), CAST($5 AS double precision[]),
                             CAST($6 AS text[]), CAST($21 AS text[]))
             AS d(n, source, webhook_id, event_type, event_at, result, trace_parent)
    ),
    existing AS (
        SELECT d.n, r.result, r.item_ids
        FROM deliveries d
        JOIN webhook_receipts r ON r.source = d.source AND r.webhook_id = d.webhook_id
    ),
    hints AS (
        SELECT h.*, d.trace_parent,
               CASE WHEN h.delay IS NULL THEN now()
                    ELSE coalesce(to_timestamp(d.event_at), now())
                         + make_interval(secs => h.delay) END AS due_at
        FROM unnest(CAST($7 AS integer[]), CAST($8 AS text[]), CAST($9 AS text[]),
                    CAST($10 AS text[]), CAST($11 AS integer[]),
                    CAST($12 AS text[]), CAST($13 AS text[]),
                    CAST($14 AS double precision[]), CAST($15 AS text[]))
             AS h(n, tenant_id, object_id, policy, policy_version, operation_key, scope, delay,
                  region)
        JOIN deliveries d ON d.n = h.n
        WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.n = h.n)
    ),
    new_scopes AS (
        INSERT INTO scopes (name, rate_per_second, burst, tokens, objects_per_call)
        SELECT DISTINCT ON (b.name) b.name, b.rate, b.burst, b.burst, b.per_call
        FROM unnest(CAST($16 AS integer[]), CAST($17 AS text[]),
                    CAST($18 AS double precision[]), CAST($19 AS integer[]),
                    CAST($20 AS integer[]))
             AS b(n, name, rate, burst, per_call)
        WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.n = b.n)
          AND NOT EXISTS (SELECT 1 FROM scopes s WHERE s.name = b.name)
        ORDER BY b.name, b.n
        ON CONFLICT (name) DO NOTHING
    ),
    {_TOUCH_ITEMS_SQL}
    mine AS (
        SELECT h.n, t.id, t.released FROM hints h JOIN touched t USING (operation_key)
    ),
    receipts AS (
        INSERT INTO webhook_receipts (source, webhook_id, event_type, result, item_ids)
        SELECT d.source, d.webhook_id, d.event_type, d.result,
               coalesce((SELECT array_agg(m.id ORDER BY m.id) FROM mine m WHERE m.n = d.n),
                        '{{}}')
        FROM deliveries d
        WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.n = d.n)
        ORDER BY d.source, d.webhook_id  -- one lock order here too
        RETURNING source, webhook_id, item_ids
    )
    SELECT d.n, r.item_ids, e.result AS original_result, e.item_ids AS original_item_ids,
           (SELECT count(*) FROM mine m WHERE m.n = d.n AND m.released) AS released
    FROM deliveries d
    LEFT JOIN receipts r ON r.source = d.source AND r.webhook_id = d.webhook_id
    LEFT JOIN existing e ON e.n = d.n
""")  # noqa: S608 - only a constant fragment is interpolated
# the group's: each column numbered by its delivery (`n`), hints and budgets by theirs
_GROUP_PARAMS: Final = ("n", *_DELIVERY_COLUMNS, "hint_n", *_HINT_COLUMNS, "budget_n",
                        *_BUDGET_COLUMNS, "trace_parent")

_ORIGINAL = Statement("receipts.original", (
    "The receipt of the delivery that won a race for the same webhook id, to answer as a "
    "duplicate."),
    "SELECT result, item_ids FROM webhook_receipts WHERE source = $1 AND webhook_id = $2")

RECEIPT_CONSTRAINT: Final = "webhook_receipts_once"


def _delay(hint: Hint) -> float:
    return -1.0 if hint.delay_seconds is None else hint.delay_seconds


def _earliest(hints: tuple[Hint, ...]) -> list[Hint]:
    """One hint per obligation (a row can change only once per statement): the soonest."""
    kept: dict[tuple[str, str, str], Hint] = {}
    for hint in hints:
        key = (hint.tenant_id, hint.object_id, hint.policy.name)
        other = kept.get(key)
        if other is None or _delay(hint) < _delay(other):
            kept[key] = hint
    return sorted(kept.values(), key=lambda h: (h.tenant_id, h.object_id, h.policy.name))


def delivery_params(delivery: Delivery) -> dict[str, Any]:
    """A delivery's parameters, by name: its own, its hints' (the soonest per obligation),
    the budgets of the scopes they name (a bucket row for each new scope) and the current
    trace context (the request's, tracing on)."""
    hints = _earliest(delivery.hints)
    hint_scopes = [h.policy.scope_for(h.tenant_id) for h in hints]
    budgets = {scope: budget_of(h.policy)
               for scope, h in zip(hint_scopes, hints, strict=True)}
    scopes = sorted(budgets)
    return {
        "source": delivery.source, "webhook_id": delivery.webhook_id,
        "event_type": delivery.event_type, "event_at": delivery.event_at,
        "result": "applied" if hints else "ignored",
        "tenants": [h.tenant_id for h in hints], "objects": [h.object_id for h in hints],
        "policies": [h.policy.name for h in hints],
        "versions": [h.policy.version for h in hints],
        "keys": [registration.operation_key(h.tenant_id, h.object_id, h.policy.name,
                                            h.policy.version) for h in hints],
        "scopes": hint_scopes,
        "delays": [h.delay_seconds for h in hints],
        # where each item may be processed (service/config/regions.py)
        "regions": [h.policy.region(h.tenant_id) for h in hints],
        "budget_scopes": scopes, "rates": [budgets[s][0] for s in scopes],
        "bursts": [budgets[s][1] for s in scopes],
        "per_call": [budgets[s][2] for s in scopes],
        "trace_parent": tracing.traceparent(),
    }


async def record(conn: Any, params: dict[str, Any]) -> Receipt:
    """Apply one delivery (its `delivery_params`) exactly once per (source, webhook id) on
    `conn` (`_RECORD`) and return its receipt; a duplicate changes nothing and returns the
    original's."""
    try:
        row = await conn.fetchrow(_RECORD.text, *(params[name] for name in _RECORD_PARAMS))
    except asyncpg.CheckViolationError:
        # an id read_delivery let through but a ledger constraint refuses (e.g. a tenant
        # whose limiter scope passes 512 bytes): bad input, a 422
        raise DeliveryRejected("unmappable", "a tenant or object id the ledger refuses "
                                             "(e.g. too long for its limiter scope)") from None
    except asyncpg.UniqueViolationError as exc:
        if exc.constraint_name != RECEIPT_CONSTRAINT:
            raise
        # lost a race with a concurrent delivery of the same id, whose receipt is committed
        # by now (the unique index waited for it)
        original = await conn.fetchrow(_ORIGINAL.text, params["source"], params["webhook_id"])
        return Receipt(result=original["result"], item_ids=tuple(original["item_ids"]),
                       duplicate=True)
    return _receipt(params, row)


def _receipt(params: dict[str, Any], row: Any) -> Receipt:
    if row["original_result"] is not None:
        return Receipt(result=row["original_result"],
                       item_ids=tuple(row["original_item_ids"]), duplicate=True)
    return Receipt(result=params["result"], item_ids=tuple(row["item_ids"]), duplicate=False,
                   released=row["released"])


async def record_group(conn: Any, group: list[dict[str, Any]]) -> list[Receipt]:
    """Apply several deliveries (their `delivery_params`) in one statement (`_RECORD_GROUP`);
    their receipts in order. The group must hold distinct webhook ids and no item named by
    two of them (the intake's `_take` makes it so)."""
    columns: dict[str, list[Any]] = {name: [] for name in _GROUP_PARAMS}
    for n, params in enumerate(group):
        for name in (*_DELIVERY_COLUMNS, "trace_parent"):
            columns[name].append(params[name])
        columns["n"].append(n)
        columns["hint_n"].extend([n] * len(params["keys"]))
        for name in _HINT_COLUMNS:
            columns[name].extend(params[name])
        columns["budget_n"].extend([n] * len(params["budget_scopes"]))
        for name in _BUDGET_COLUMNS:
            columns[name].extend(params[name])
    rows = await conn.fetch(_RECORD_GROUP.text, *(columns[name] for name in _GROUP_PARAMS))
    by_n = {row["n"]: row for row in rows}
    return [_receipt(params, by_n[n]) for n, params in enumerate(group)]
