"""Bulk registration (`registration.register`): one statement per request, its columns sent as
text. Each value must arrive in its own row, exactly as given."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.policies import Policies
from service.ledger import registration
from tests.conftest import policies_from
from tests.integration.test_pipeline import PAST, make_policies, statuses


def two_policies() -> Policies:
    base = make_policies("http://127.0.0.1:9")
    cfg = base.policies["carts"].config.model_dump(mode="json", exclude_none=True)
    return policies_from({
        "upstreams": {"shop": {"base_url": "http://127.0.0.1:9", "timeout_seconds": 2}},
        "policies": {"carts": cfg,
                     "orders": {**cfg, "version": 3, "scope": "shared:{upstream}",
                                "rate": {"per_second": 7, "burst": 9}}}})


async def rows(engine: AsyncEngine) -> list[dict[str, object]]:
    async with engine.connect() as conn:
        return [dict(r) for r in (await conn.execute(text(
            "SELECT tenant_id, object_id, policy, policy_version, operation_key, scope, due_at "
            "FROM items ORDER BY id"))).mappings()]


async def test_each_value_lands_in_its_own_row_exactly(engine: AsyncEngine) -> None:
    policies = two_policies()
    carts, orders = policies.policies["carts"], policies.policies["orders"]
    ist = timezone(timedelta(hours=5, minutes=30))
    given = [
        registration.Registration("acme", "cart/1 ü", carts,
                                  datetime(2026, 3, 1, 10, 0, 0, 123456, ist)),
        registration.Registration("globex", "🛒", orders,
                                  datetime(9999, 12, 31, tzinfo=UTC)),  # the range's end
        registration.Registration("acme", "o-2", orders, datetime(1970, 1, 1, tzinfo=UTC)),
        registration.Registration("a" * 505, "x" * 512, carts, PAST),
    ]
    result = await registration.register(engine, given)
    assert (result.inserted, result.advanced, result.unchanged) == (4, 0, 0)
    stored = await rows(engine)
    assert [(r["tenant_id"], r["object_id"], r["policy"], r["policy_version"], r["due_at"])
            for r in stored] == [(g.tenant_id, g.object_id, g.policy.name, g.policy.version,
                                  g.due_at) for g in given]
    assert [r["scope"] for r in stored] == ["tenant:acme", "shared:shop", "shared:shop",
                                            "tenant:" + "a" * 505]
    assert [r["operation_key"] for r in stored] == [
        registration.operation_key(g.tenant_id, g.object_id, g.policy.name, g.policy.version)
        for g in given]
    async with engine.connect() as conn:
        budgets = dict((await conn.execute(text(
            "SELECT name, (rate_per_second, burst)::text FROM scopes"))).all())
    assert budgets["shared:shop"] == "(7,9)" and budgets["tenant:acme"] == "(1000,1000)"


async def test_the_earliest_of_duplicates_in_one_request_wins(engine: AsyncEngine) -> None:
    carts = make_policies("http://127.0.0.1:9").policies["carts"]
    late, early = PAST, PAST - timedelta(days=3)
    result = await registration.register(engine, [
        registration.Registration("acme", "c1", carts, late),
        registration.Registration("acme", "c2", carts, late),
        registration.Registration("acme", "c1", carts, early),
        registration.Registration("acme", "c1", carts, late),
    ])
    assert (result.inserted, result.advanced, result.unchanged) == (2, 0, 2)
    assert sorted((r["object_id"], r["due_at"]) for r in await rows(engine)) == [
        ("c1", early), ("c2", late)]
    again = await registration.register(engine, [registration.Registration("acme", "c2", carts,
                                                                           early),
                                           registration.Registration("acme", "c2", carts, late)])
    assert (again.inserted, again.advanced, again.unchanged) == (0, 1, 1)


@pytest.mark.parametrize("tenant", ["a\x1fb", "\x1f"])
async def test_a_value_holding_the_column_separator_is_refused(engine: AsyncEngine,
                                                              tenant: str) -> None:
    # the API refuses control characters before this; a caller that did not must not have
    # its columns shifted by one
    carts = make_policies("http://127.0.0.1:9").policies["carts"]
    with pytest.raises(ValueError, match="U\\+001F"):
        await registration.register(engine, [registration.Registration("acme", "c1", carts, PAST),
                                             registration.Registration(tenant, "c2", carts, PAST)])
    assert await statuses(engine) == {}


async def test_a_tenant_too_long_for_its_scope_is_refused(engine: AsyncEngine) -> None:
    carts = make_policies("http://127.0.0.1:9").policies["carts"]  # "tenant:{tenant_id}"
    with pytest.raises(registration.ScopeTooLong, match="519 bytes") as refused:
        await registration.register(engine, [registration.Registration("a" * 512, "c1", carts,
                                                                       PAST)])
    assert (refused.value.policy, refused.value.tenant_id) == ("carts", "a" * 512)
    assert await statuses(engine) == {}


async def test_a_naive_due_at_is_refused(engine: AsyncEngine) -> None:
    carts = make_policies("http://127.0.0.1:9").policies["carts"]
    with pytest.raises(ValueError, match="timezone-aware"):
        await registration.register(engine, [registration.Registration("acme", "c1", carts,
                                                                       datetime(2026, 1, 1))])
    assert await statuses(engine) == {}
