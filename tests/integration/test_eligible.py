"""`eligible` in GET /v1/scopes and the sweeper_items_eligible gauge count one set: the items
a worker may claim now (service.db.statements.ready_item), pending, released, due on the
database's clock, and under no lease that still runs (a lease that ran out is work a worker
takes over). An item waiting out a retry delay is in neither until its delay ends, a leased
one until its lease runs out; the scope being closed or paused changes neither."""

from __future__ import annotations

import hashlib
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import scope_controls
from service.ledger import gauges
from tests.conftest import LiveServer, test_settings
from tests.integration.db_clock import advance
from tests.integration.test_metrics import samples, scrape
from tests.integration.test_pipeline import make_policies

WAIT = timedelta(hours=1)  # the retry delay of the item that is not due yet

# kind -> (status, released, next attempt from now, lease expiry from now, due days ago)
KINDS: dict[str, tuple[str, bool, timedelta | None, timedelta | None, int]] = {
    "ready": ("pending", True, None, None, 1),
    "retry_due": ("pending", True, timedelta(seconds=-1), None, 2),
    "retry_waiting": ("pending", True, WAIT, None, 3),  # the oldest: due longest ago
    "unreleased": ("pending", False, None, None, 4),
    "leased": ("leased", True, None, timedelta(seconds=30), 5),
    "lease_expired": ("leased", True, None, timedelta(seconds=-1), 6),
    "succeeded": ("succeeded", True, None, None, 7),
    "dead": ("dead", True, None, None, 8),
    "cancelled": ("cancelled", True, None, None, 9),
}
# scope a (open, policy carts) holds one item of every kind; scope b (paused and closed,
# policy exports) the claimable ones and the waiting one
ITEMS = ([("a", "carts", kind) for kind in KINDS]
         + [("b", "exports", kind) for kind in ("ready", "ready", "retry_waiting")])

_INSERT = text("""
    INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key, scope,
                       status, due_at, next_attempt_at, released_at, lease_owner, lease_token,
                       lease_expires_at, completed_at, dead_reason)
    VALUES (:tenant, :object_id, :policy, 1, :key, 'tenant:' || CAST(:tenant AS text),
            -- a leased item is pending with a lease (migration 0024)
            CASE WHEN :status = 'leased' THEN 'pending' ELSE :status END,
            now() - make_interval(days => :due_days),
            coalesce(now() + CAST(:next_attempt AS interval), '-infinity'),
            CASE WHEN CAST(:released AS boolean) THEN now() - interval '1 day' END,
            CASE WHEN :status = 'leased' THEN 'w' END,
            CAST(:token AS uuid), now() + CAST(:lease AS interval),
            CASE WHEN :status IN ('succeeded', 'dead', 'cancelled') THEN now() END,
            CASE WHEN :status = 'dead' THEN 'http_400' END)
""")


async def seed(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO scopes (name, rate_per_second, burst, tokens) "
            "VALUES ('tenant:a', 10, 10, 10), ('tenant:b', 10, 10, 10)"))
        await conn.execute(text(
            "UPDATE scopes SET paused = true, paused_reason = 'operator', "
            "closed_until = now() + interval '1 day' WHERE name = 'tenant:b'"))
        for n, (tenant, policy, kind) in enumerate(ITEMS):
            status, released, next_attempt, lease, due_days = KINDS[kind]
            await conn.execute(_INSERT, {
                "tenant": tenant, "object_id": f"{kind}-{n}", "policy": policy,
                "key": hashlib.sha256(f"{n}".encode()).hexdigest(), "status": status,
                "due_days": due_days, "next_attempt": next_attempt, "released": released,
                "token": uuid.uuid4() if status == "leased" else None,
                "lease": lease if status == "leased" else None})


# how long ago the oldest eligible item of each scope was due, in days, while the waiting
# item waits: a's expired lease (6), b's newest ready item (1); after the delay b's waiting
# item (3)
OLDEST_DAYS = {"tenant:a": 6, "tenant:b": 1}


def expected(*claimable: str) -> dict[str, int]:
    """Per scope letter, how many of its items are of the `claimable` kinds."""
    counts = {"a": 0, "b": 0}
    for tenant, _, kind in ITEMS:
        counts[tenant] += kind in claimable
    return counts


async def both_counts(engine: AsyncEngine) -> tuple[dict[str, Any], gauges.LedgerSnapshot]:
    listed = {r["name"]: r for r in await scope_controls.list_scopes(engine)}
    return listed, await gauges.read_ledger(engine)


async def test_scopes_eligible_and_the_gauge_count_the_same_items(engine: AsyncEngine) -> None:
    await seed(engine)

    listed, snap = await both_counts(engine)
    want = expected("ready", "retry_due", "lease_expired")
    assert {n: r["eligible"] for n, r in listed.items()} == {
        "tenant:a": want["a"], "tenant:b": want["b"]} == {"tenant:a": 3, "tenant:b": 2}
    assert snap.eligible == {"carts": want["a"], "exports": want["b"]}
    # the oldest is that of the same set: not the waiting item's, due longest ago
    for name, policy in (("tenant:a", "carts"), ("tenant:b", "exports")):
        days = listed[name]["oldest_eligible_age_seconds"] / 86_400
        assert abs(days - OLDEST_DAYS[name]) < 0.01, (name, days)
        assert abs(snap.oldest_eligible_s[policy]
                   - listed[name]["oldest_eligible_age_seconds"]) < 5

    # once its delay has passed on the database's clock, the waiting item is in both, and
    # so is the leased one, whose lease ran out meanwhile
    await advance(engine, WAIT.total_seconds() + 1)
    listed, snap = await both_counts(engine)
    want = expected("ready", "retry_due", "retry_waiting", "leased", "lease_expired")
    assert {n: r["eligible"] for n, r in listed.items()} == {
        "tenant:a": want["a"], "tenant:b": want["b"]} == {"tenant:a": 5, "tenant:b": 3}
    assert snap.eligible == {"carts": want["a"], "exports": want["b"]}
    for name, policy in (("tenant:a", "carts"), ("tenant:b", "exports")):
        days = listed[name]["oldest_eligible_age_seconds"] / 86_400
        assert abs(days - {"tenant:a": 6, "tenant:b": 3}[name]) < 0.01, (name, days)
        assert abs(snap.oldest_eligible_s[policy]
                   - listed[name]["oldest_eligible_age_seconds"]) < 5


async def test_the_http_listing_and_the_scrape_agree(db_url: str, engine: AsyncEngine) -> None:
    await seed(engine)
    policies = make_policies("http://127.0.0.1:9")
    async with LiveServer(test_settings(db_url, workers=0), policies, db_url) as live:
        async with live.client() as api:
            listing = (await api.get("/v1/scopes")).json()["scopes"]
        got = samples(await scrape(live.base_url))
    eligible = {s["name"]: s["eligible"] for s in listing}
    assert eligible == {"tenant:a": 3, "tenant:b": 2}
    gauge = {policy: got[("sweeper_items_eligible", (("policy", policy),))]
             for policy in ("carts", "exports")}
    assert gauge == {"carts": 3, "exports": 2}
    assert sum(eligible.values()) == sum(gauge.values())
