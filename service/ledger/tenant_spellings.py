"""Rows written before tenant ids had one spelling (service/config/tenants.py), found at start-up.

- An active hold on another spelling of a tenant whose policies build their host from it
  would no longer cover the items registered from now on (they are stored canonical), so it
  gets a twin on the canonical spelling, placed by `sweeper` with the same policy, objects
  and expiry (and, like any hold, released by an operator). Keeping more is the safe side.
- Open items stored in another spelling are reported in the log, once per policy: their
  calls are refused (templates.checked_host), so they end `dead` as `invalid_request`
  instead of reaching the upstream under a second identity; register them again in the
  canonical spelling, then cancel the old ones.
"""

from __future__ import annotations

import logging
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.policies import Policies
from service.config.tenants import host_form
from service.db.statements import Statement, active_hold, fetch
from service.ledger import holds

log = logging.getLogger(__name__)

# What a stored spelling other than the canonical one can differ by: case and a trailing dot
# (registration refused non-ASCII tenant ids of these policies before, as no host name).
_NOT_CANONICAL: Final = "(tenant_id <> lower(tenant_id) OR right(tenant_id, 1) = '.')"

_HOLDS = Statement("tenant_spellings.holds", (
    "Active holds on a tenant spelling other than the canonical one, of every policy or of "
    "a policy whose host is built from the tenant id."), f"""
    SELECT hx.* FROM holds hx
    WHERE {active_hold()} AND {_NOT_CANONICAL.replace("tenant_id", "hx.tenant_id")}
      AND (hx.policy IS NULL OR hx.policy = ANY(CAST(:policies AS text[])))
    ORDER BY hx.id
""")  # noqa: S608 - only constant fragments are interpolated

_TWIN = Statement("tenant_spellings.twin", (
    "Whether an active hold already covers what this one does, on the canonical spelling."),
    f"""
    SELECT EXISTS (
        SELECT FROM holds hx
        WHERE {active_hold()} AND hx.tenant_id = :tenant
          AND hx.policy IS NOT DISTINCT FROM CAST(:policy AS text)
          AND hx.object_ids IS NOT DISTINCT FROM CAST(:object_ids AS text[])
          AND hx.object_id_prefix IS NOT DISTINCT FROM CAST(:prefix AS text)
    ) AS found
""")  # noqa: S608 - only constant fragments are interpolated

_ITEMS = Statement("tenant_spellings.items", (
    "Open items of policies whose host is built from the tenant id, stored in a spelling "
    "other than the canonical one, by policy."), f"""
    SELECT policy, count(*) AS n FROM items
    WHERE policy = ANY(CAST(:policies AS text[])) AND status = 'pending'
      AND {_NOT_CANONICAL}
    GROUP BY policy ORDER BY policy
""")  # noqa: S608 - only a constant fragment is interpolated


async def reconcile(engine: AsyncEngine, policies: Policies) -> int:
    """Give each active hold on a non-canonical spelling its canonical twin and log the open
    items stored in one; returns the number of twins placed."""
    names = list(policies.tenant_in_host)
    if not names:
        return 0
    placed = 0
    for hold in await fetch(engine, _HOLDS, {"policies": names}):
        tenant = host_form(hold.tenant_id)
        [twin] = await fetch(engine, _TWIN, {
            "tenant": tenant, "policy": hold.policy, "object_ids": hold.object_ids,
            "prefix": hold.object_id_prefix})
        if twin.found:
            continue
        await holds.place(engine, holds.HoldSpec(
            tenant_id=tenant, policy=hold.policy, object_ids=hold.object_ids,
            object_id_prefix=hold.object_id_prefix, expires_at=hold.expires_at,
            reference=hold.reference,
            reason=f"hold {hold.id} on the tenant's canonical spelling"),
            actor=holds.SYSTEM_ACTOR)
        placed += 1
        log.warning("a hold on a non-canonical tenant spelling got a canonical twin",
                    extra={"hold_id": hold.id, "policy": hold.policy})
    for row in await fetch(engine, _ITEMS, {"policies": names}):
        log.warning("open items stored with a non-canonical tenant spelling: their calls are "
                    "refused (invalid_request); register them again in the canonical form",
                    extra={"policy": row.policy, "items": row.n})
    return placed
