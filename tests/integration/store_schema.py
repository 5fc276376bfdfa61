"""A store's own database for the tests: carts and checkout attempts, as a storefront keeps
them, and the policies that sweep them (the worked example of docs/stores.md)."""

from __future__ import annotations

from typing import Any, Final

import asyncpg

from service.policies import Policies
from tests.conftest import policies_from

SCHEMA: Final = """
CREATE TABLE carts (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    shop       text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX carts_updated_at ON carts (updated_at);
CREATE TABLE checkouts (
    token        uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    shop         text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz
);
CREATE INDEX checkouts_created_at ON checkouts (created_at) WHERE completed_at IS NULL;
"""

CARTS_SOURCE: Final = ("SELECT shop AS tenant_id, id AS object_id, updated_at AS age FROM carts "
                       "WHERE updated_at < :cutoff - interval '7 days'")
CARTS_TARGET: Final = ("DELETE FROM carts WHERE id = ANY(CAST(:object_ids AS bigint[])) "
                       "AND updated_at < :cutoff - interval '7 days' "
                       "RETURNING id::text AS object_id")
CHECKOUTS_SOURCE: Final = ("SELECT shop AS tenant_id, token AS object_id, created_at AS age "
                           "FROM checkouts WHERE completed_at IS NULL "
                           "AND created_at < :cutoff - interval '1 day'")
CHECKOUTS_TARGET: Final = ("DELETE FROM checkouts WHERE token = ANY(CAST(:object_ids AS uuid[])) "
                           "AND completed_at IS NULL AND created_at < :cutoff - interval '1 day' "
                           "RETURNING token::text AS object_id")


async def create_store(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(SCHEMA)
    finally:
        await conn.close()


def store_policy(source_sql: str, target_sql: str, **overrides: Any) -> dict[str, Any]:
    policy: dict[str, Any] = {
        "version": 1,
        "source": {"store": "shop", "query": source_sql, "page": 50},
        "target": {"store": "shop", "statement": target_sql},
        "batch": {"max_objects": 20},
        "scope": "store:{upstream}:{policy}",
        "rate": {"per_second": 5000, "burst": 400, "unit": "rows"},
        "lease_seconds": 30, "max_attempts": 3,
        "backoff": {"base_seconds": 0.01, "max_seconds": 0.05},
    }
    policy.update(overrides)
    return policy


def store_policies(store_url: str, **overrides: Any) -> Policies:
    """The worked example's two policies on the store at `store_url`."""
    return policies_from({
        "stores": {"shop": {"dsn_env": "SHOP_DATABASE_URL"}},
        "policies": {"expired-carts": store_policy(CARTS_SOURCE, CARTS_TARGET, **overrides),
                     "abandoned-checkouts": store_policy(CHECKOUTS_SOURCE, CHECKOUTS_TARGET,
                                                         **overrides)},
    }, {"SHOP_DATABASE_URL": store_url})
