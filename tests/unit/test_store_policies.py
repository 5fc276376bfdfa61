"""A policy's store source, target and guard: what the policies file alone can refuse, each
with its key named (the store itself checks the rest: tests/integration/test_stores.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from service.budget import rules
from service.config import store_statements
from service.config.policies import resolve_policies
from service.errors import ConfigError
from tests.fakes.store_schema import CARTS_SOURCE, CARTS_TARGET, EXAMPLE, store_policy

ENV = {"SHOP_DATABASE_URL": "postgresql://shop.invalid/shop"}


def document(**overrides: Any) -> dict[str, Any]:
    return {"stores": {"shop": {"dsn_env": "SHOP_DATABASE_URL"}},
            "policies": {"carts": store_policy(CARTS_SOURCE, CARTS_TARGET, **overrides)}}


def refused(doc: dict[str, Any], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_policies(doc, ENV if env is None else env, source="p.toml")
    return str(info.value)


def test_the_worked_example_loads() -> None:
    policies = resolve_policies(document(), ENV, source="p.toml")
    policy = policies.policies["carts"]
    assert policy.request is None and policy.target_name == "shop"
    assert policy.scope_for("shop-1") == "store:shop:carts"
    assert policies.stores["shop"].dsn == ENV["SHOP_DATABASE_URL"]
    assert "postgresql" not in repr(policies.stores["shop"])  # the DSN is a secret
    # a budget in rows is counted in statements of max_objects rows
    assert rules.budget_of(policy) == (5000 / 20, 400 // 20, 20)


def test_the_example_block_loads_as_written() -> None:
    policies = resolve_policies(EXAMPLE, ENV, source="policies.example.toml")
    carts = policies.policies["expired-carts"].config
    assert carts.guard is not None and carts.guard.active_backends
    assert carts.source is not None and carts.source.page == 5000
    assert rules.budget_of(policies.policies["expired-carts"]) == (10.0, 1, 50)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return mutate


_DELETE = object()
P = "policies.carts"


@pytest.mark.parametrize(("mutate", "key", "words"), [
    (_set(f"{P}.source.query", "SELECT shop AS tenant_id, id AS object_id, updated_at AS age "
                               "FROM carts"), f"{P}.source.query", "must use :cutoff"),
    (_set(f"{P}.source.query", "DELETE FROM carts WHERE updated_at < :cutoff"),
     f"{P}.source.query", "must start with SELECT or WITH"),
    (_set(f"{P}.source.query", "SELECT 1 WHERE now() < :cutoff; DROP TABLE carts"),
     f"{P}.source.query", "must be one statement"),
    (_set(f"{P}.source.query", "SELECT * FROM carts WHERE updated_at < :cutoff AND shop = :x"),
     f"{P}.source.query", "unknown parameter(s) :x"),
    (_set(f"{P}.target.statement", "DELETE FROM carts WHERE id = ANY(:object_ids)"),
     f"{P}.target.statement", "must use :cutoff"),
    (_set(f"{P}.target.statement", "DELETE FROM carts WHERE id = ANY(:object_ids) AND "
                                   "updated_at < :cutoff"),
     f"{P}.target.statement", "RETURNING"),
    (_set(f"{P}.target.statement", "TRUNCATE carts"), f"{P}.target.statement",
     "must start with DELETE or UPDATE or WITH"),
    (_set(f"{P}.target.store", "warehouse"), f"{P}.target.store", "unknown store 'warehouse'"),
    (_set(f"{P}.source.store", "warehouse"), f"{P}.source.store", "unknown store"),
    (_set(f"{P}.upstream", "shop"), f"{P}.upstream", "calls no upstream"),
    (_set(f"{P}.method", "POST"), f"{P}.method", "is for an upstream's HTTP call"),
    (_set(f"{P}.scope", "store:{upstream}"), f"{P}.scope", "needs a scope holding {policy}"),
    (_set(f"{P}.lease_seconds", 5), f"{P}.lease_seconds", "lock and statement timeouts"),
    (_set(f"{P}.rate.unit", "points"), f"{P}.rate.unit", "counts calls (statements) or rows"),
    (_set(f"{P}.guard", {"store": "shop", "max": 1}), f"{P}.guard",
     "exactly one of query, replica_lag or active_backends"),
    (_set(f"{P}.guard", {"store": "shop", "max": 1, "query": "UPDATE t SET n = 1"}),
     f"{P}.guard.query", "must start with SELECT or WITH"),
    (_set(f"{P}.target", _DELETE), P, "name an upstream"),
    (_set("stores.shop.dsn_env", "not a name"), "stores.shop.dsn_env", "should match"),
    (_set("stores.shop.ledger_table", "x; DROP TABLE carts"), "stores.shop.ledger_table",
     "should match"),
    (_set("stores.shop.extra", 1), "stores.shop.extra", "unknown key"),
])
def test_each_fault_is_refused_with_its_key(mutate: Callable[[dict[str, Any]], None],
                                            key: str, words: str) -> None:
    doc = copy.deepcopy(document())
    mutate(doc)
    message = refused(doc)
    assert f"{key}:" in message and words in message, message


def test_a_store_without_its_dsn_is_refused_by_name() -> None:
    assert "stores.shop.dsn_env: environment variable SHOP_DATABASE_URL is not set" in \
        refused(document(), env={})


def test_a_guard_needs_a_target_and_a_rows_budget_a_store() -> None:
    doc = document()
    doc["upstreams"] = {"api": {"base_url": "https://api.example"}}
    doc["policies"]["http"] = {"version": 1, "upstream": "api", "path": "/x/{object_id}",
                               "rate": {"per_second": 1, "unit": "rows"},
                               "guard": {"store": "shop", "active_backends": True, "max": 5}}
    message = refused(doc)
    assert "policies.http.guard: a guard yields a store target's deletions" in message
    assert "policies.http.rate.unit: a budget in rows is for a store target" in message


@pytest.mark.parametrize(("sql", "found"), [
    ("SELECT 1 WHERE x < :cutoff", {"cutoff"}),
    ("SELECT ':cutoff'::text, a::int FROM t WHERE b = :b", {"cutoff", "b"}),  # as text() binds
    ("SELECT 1 -- :c\nWHERE a = :d", {"c", "d"}),
])
def test_binds_are_what_sqlalchemy_binds(sql: str, found: set[str]) -> None:
    from sqlalchemy import text

    assert store_statements.binds(sql) == found == set(text(sql)._bindparams)


def test_typed_parameters_leave_literals_and_casts_alone() -> None:
    assert store_statements.typed("SELECT a::int FROM t WHERE b < :cutoff AND c = ANY(:ids)",
                           {"cutoff": "timestamptz", "ids": "text[]"}) == (
        "SELECT a::int FROM t WHERE b < CAST(:cutoff AS timestamptz) AND c = "
        "ANY(CAST(:ids AS text[]))")
