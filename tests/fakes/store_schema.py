"""A store's own database for the tests: carts and checkout attempts, as a storefront keeps
them (the schema docs/stores.md shows), and the policies that sweep them (the worked
example of policies.example.toml and docs/stores.md)."""

from __future__ import annotations

import re
import tomllib
from typing import Any, Final

import asyncpg

from drills.vendors import example_block
from service.config.policies import Policies
from tests.conftest import REPO_ROOT, policies_from

# the first SQL block of docs/stores.md: the schema its worked example runs on
SCHEMA: Final = re.findall(r"^```sql\n(.*?)^```", (REPO_ROOT / "docs" / "stores.md").read_text(
    encoding="utf-8"), re.MULTILINE | re.DOTALL)[0]
EXAMPLE: Final = tomllib.loads(example_block(REPO_ROOT / "policies.example.toml", "store"))
CARTS_SOURCE: Final = EXAMPLE["policies"]["expired-carts"]["source"]["query"]
CARTS_TARGET: Final = EXAMPLE["policies"]["expired-carts"]["target"]["statement"]


async def create_store(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(SCHEMA)
    finally:
        await conn.close()


def store_policy(source_sql: str, target_sql: str, **overrides: Any) -> dict[str, Any]:
    """A store policy of the test suite's scale: small pages and batches, a fast backoff."""
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
    """The worked example's two policies (policies.example.toml's `store` block, its SQL as
    written) at the test suite's scale, on the store at `store_url`; without its guard
    unless `overrides` names one."""
    doc = {"stores": EXAMPLE["stores"], "policies": {
        name: store_policy(policy["source"]["query"], policy["target"]["statement"],
                           **overrides)
        for name, policy in EXAMPLE["policies"].items()}}
    return policies_from(doc, {"SHOP_DATABASE_URL": store_url})
