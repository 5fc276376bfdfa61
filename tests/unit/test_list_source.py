"""A policy's HTTP list source: what loading the policies file refuses (each problem naming
its key), how a list call is rendered, and how a page's JSON is read into entries, problems
and the next cursor (the walk itself: tests/integration/test_list_source.py)."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from drills.vendors import example_block
from service.config.list_sources import MAX_TENANTS
from service.config.policies import Policies, resolve_policies
from service.errors import ConfigError
from service.sweeps.list_pages import read_page

REPO = Path(__file__).resolve().parents[2]
CUTOFF = datetime(2026, 12, 1, 12, 30, 45, 123456, tzinfo=UTC)
OLD = "2026-10-01T00:00:00Z"


def document(**source: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "upstream": "shop", "path": "/shops/{tenant_id}/customers?updated_before={cutoff}"
                                    "&limit={page}&cursor={cursor}",
        "tenants": ["shop-a", "shop-b"], "items": "items[*]", "id": "id",
        "age": "updated_at", "next": "next_cursor"}
    base.update(source)
    return {"upstreams": {"shop": {"base_url": "https://api.example.com/v1"}},
            "policies": {"stale": {"version": 1, "upstream": "shop",
                                   "path": "/shops/{tenant_id}/customers/{object_id}",
                                   "scope": "shop:{tenant_id}",
                                   "rate": {"per_second": 5, "burst": 5},
                                   "source": {k: v for k, v in base.items()
                                              if v is not None}}}}


def load(doc: dict[str, Any]) -> Policies:
    return resolve_policies(doc, {}, source="p.toml")


def refused(doc: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load(doc)
    return str(info.value)


def test_the_example_block_loads_as_written(tmp_path: Path) -> None:
    doc = tomllib.loads(example_block(REPO / "policies.example.toml", "http-list"))
    doc["upstreams"]["shopify-admin"]["credentials"]["directory"] = str(tmp_path)
    policy = load(doc).policies["inactive-customers"]
    assert policy.list_source is not None and policy.listing is not None
    assert policy.store_source is None
    assert policy.listing.url("shop-a.myshopify.com", None, CUTOFF, 100) == (
        "https://shop-a.myshopify.com/admin/api/2025-10/graphql.json")
    body = json.loads(policy.listing.body("shop-a.myshopify.com", None,
                                          policy.listing.cutoff(CUTOFF), 100) or b"")
    assert body["variables"] == {"first": 100, "cursor": None,
                                 "query": "updated_at:<'2024-12-01T12:30:45Z'"}
    assert not policy.list_answers.reads_nothing  # its THROTTLED rule


def test_the_list_request_substitutes_values_where_they_go() -> None:
    listing = load(document()).policies["stale"].listing
    assert listing is not None
    # the first page: no cursor parameter at all; the cutoff to the second, encoded
    assert listing.url("shop-a", None, CUTOFF, 50) == (
        "https://api.example.com/v1/shops/shop-a/customers?updated_before="
        "2026-12-01T12%3A30%3A45Z&limit=50")
    # a cursor and a tenant are each one value: '&', '/', '?' and '#' cannot leave it
    assert listing.url("a/b?c", "x&y=z#w", CUTOFF, 50) == (
        "https://api.example.com/v1/shops/a%2Fb%3Fc/customers?updated_before="
        "2026-12-01T12%3A30%3A45Z&limit=50&cursor=x%26y%3Dz%23w")


def test_a_templated_host_refuses_a_tenant_outside_its_pattern() -> None:
    doc = document(tenants=["shop-a.myshopify.com", "evil.example"])
    doc["upstreams"]["shop"] = {"base_url": "https://{tenant_id}/admin",
                                "host_pattern": r"[a-z0-9][a-z0-9-]*\.myshopify\.com"}
    doc["policies"]["stale"]["source"]["path"] = "/customers.json?cursor={cursor}"
    doc["policies"]["stale"]["path"] = "/customers/{object_id}.json"
    problem = refused(doc)
    assert "policies.stale.source.tenants[1]" in problem and "host_pattern" in problem
    assert "tenants[0]" not in problem


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"pages": 3}, "policies.stale.source.pages", "unknown key"),
    ({"page": 1001}, "policies.stale.source.page", "less than or equal to 1000"),
    ({"page": 0}, "policies.stale.source.page", "greater than or equal to 1"),
    ({"pages_per_pass": 10_001}, "policies.stale.source.pages_per_pass", "10000"),
    ({"max_bytes": 10_000_000}, "policies.stale.source.max_bytes", "1048576"),
    ({"tenants": []}, "policies.stale.source.tenants", "at least 1"),
    ({"tenants": [f"shop-{n}" for n in range(MAX_TENANTS + 1)]},
     "policies.stale.source.tenants", "at most 1000"),
    ({"tenants": ["shop-a", "shop-a"]}, "policies.stale.source.tenants", "listed twice"),
    ({"tenants": ["shop a"]}, "policies.stale.source.tenants[0]", "pattern"),
    ({"items": "items[*"}, "policies.stale.source.items", "must end with [*]"),
    ({"items": "it ems[*]"}, "policies.stale.source.items", "not a body path"),
    ({"items": "items"}, "policies.stale.source.items", "must end with [*]"),
    ({"next": ""}, "policies.stale.source.next", "at least 1"),
    ({"id": None}, "policies.stale.source.id", "required key is missing"),
    ({"method": "DELETE"}, "policies.stale.source.method", "'GET' or 'POST'"),
    ({"path": "customers"}, "policies.stale.source.path", "must start with '/'"),
    ({"path": "/c?after={object_id}"}, "policies.stale.source.path",
     "unknown placeholder(s) ['object_id']"),
    ({"path": "/c?{cursor}=1"}, "policies.stale.source.path", "name=value"),
    ({"body": {"q": "{cursor}"}}, "policies.stale.source.body", "use method = \"POST\""),
    ({"method": "POST", "body": {"q": "{object_ids}"}}, "policies.stale.source.body.q",
     "unknown placeholder(s)"),
    ({"older_than": "P1M"}, "policies.stale.source.older_than", "ISO 8601 duration"),
    ({"upstream": "nowhere"}, "policies.stale.source.upstream", "unknown upstream"),
    ({"answers": [{"status": 200, "outcome": "deleted"}]},
     "policies.stale.source.answers[0].outcome", "Input should be"),
])
def test_a_bad_list_source_is_refused_naming_its_key(change: dict[str, Any], key: str,
                                                      words: str) -> None:
    problem = refused(document(**change))
    assert f"{key}:" in problem, problem
    assert words in problem, problem


def test_several_tenants_need_a_scope_per_tenant() -> None:
    doc = document()
    doc["policies"]["stale"]["scope"] = "credential:{upstream}"
    assert "policies.stale.scope: a list source of several tenants" in refused(doc)
    doc["policies"]["stale"]["source"]["tenants"] = ["shop-a"]
    load(doc)  # one tenant may share the upstream's scope


def test_a_store_source_key_still_names_the_store_source() -> None:
    doc = document()
    doc["policies"]["stale"]["source"] = {"page": 10}
    assert "policies.stale.source.store: required key is missing" in refused(doc)


POLICY = load(document(more="has_more")).policies["stale"]


def page(items: list[Any], **rest: Any) -> dict[str, Any]:
    return {"items": items, **rest}


def test_a_page_is_read_into_entries_problems_and_the_next_cursor() -> None:
    listing = POLICY.listing
    assert listing is not None
    listed = read_page(POLICY, "shop-a", None, page([
        {"id": 1, "updated_at": OLD},
        {"id": "gid-2", "updated_at": 1760000000},
        {"id": None, "updated_at": OLD},
        {"updated_at": OLD},
        {"id": 3.5, "updated_at": OLD},
        {"id": False, "updated_at": OLD},
        {"id": "4", "updated_at": "2026-10-01T00:00:00"},  # no offset
        {"id": "5"},
        {"id": "6", "updated_at": "2026-12-01T12:30:45Z"},  # not before the cutoff
    ], next_cursor="c2", has_more=True), listing.cutoff(CUTOFF))
    assert [(e.object_id, e.age.isoformat()) for e in listed.entries] == [
        ("1", "2026-10-01T00:00:00+00:00"), ("gid-2", "2025-10-09T08:53:20+00:00")]
    assert [(p["object_id"], p["problem"]) for p in listed.errors] == [
        ("None", "object_id is missing"), ("None", "object_id is missing"),
        ("3.5", "object_id is not a string or an integer"),
        ("False", "object_id is not a string or an integer"),
        ("'4'", "age is not an ISO 8601 time with an offset, nor Unix seconds"),
        ("'5'", "age is missing"),
        ("'6'", "age is not before the cutoff 2026-12-01T12:30:45Z the list call named")]
    assert listed.next == "c2" and listed.read == 1


@pytest.mark.parametrize(("rest", "following", "problem"), [
    ({"next_cursor": None}, None, None),
    ({"next_cursor": ""}, None, None),
    ({}, None, None),
    ({"next_cursor": "c2", "has_more": False}, None, None),  # `more` says the last page
    ({"next_cursor": 17}, "17", None),
    ({"next_cursor": {"after": 1}}, None, "the next cursor is no string"),
    ({"next_cursor": "x" * 2049}, None, "the next cursor is no string"),
    ({"next_cursor": "a\nb"}, None, "the next cursor is no string"),
    ({"next_cursor": "c1"}, None, "the next cursor repeats this page's"),
])
def test_the_next_cursor_ends_the_walk_cleanly_or_as_an_error(
        rest: dict[str, Any], following: str | None, problem: str | None) -> None:
    listed = read_page(POLICY, "shop-a", "c1", page([], **rest), CUTOFF)
    assert listed.next == following
    assert len(listed.errors) == (problem is not None)
    if problem is not None:
        assert listed.errors[0]["problem"].startswith(problem)
        assert listed.errors[0]["problem"].endswith("this tenant's walk ends here")


def test_a_document_of_another_shape_is_an_error_that_ends_the_walk() -> None:
    for document_ in ([1, 2], "text", None, {"items": {"id": 1}},
                     {"errors": [{"message": "Field 'customers' doesn't exist"}]}):
        listed = read_page(POLICY, "shop-a", None, copy.deepcopy(document_), CUTOFF)
        assert (listed.entries, listed.next) == ([], None)
        assert [e["problem"] for e in listed.errors] == [
            "the page holds no list at 'items': this tenant's walk ends here"]
    listed = read_page(POLICY, "shop-a", None, {"items": [], "next_cursor": None}, CUTOFF)
    assert (listed.entries, listed.errors, listed.next) == ([], [], None)  # empty: the end


def test_a_cutoff_is_sent_to_the_second_never_later() -> None:
    listing = POLICY.listing
    assert listing is not None
    assert listing.cutoff(CUTOFF) == CUTOFF.replace(microsecond=0) - timedelta(0)
    assert "2026-12-01T12%3A30%3A45Z" in listing.url("s", None, CUTOFF, 1)


def test_the_docs_examples_load_as_written(tmp_path: Path) -> None:
    """docs/stores.md, "Listing an upstream": its GraphQL source is the example's, and its
    REST source loads on the upstream the text names."""
    text = (REPO / "docs" / "stores.md").read_text(encoding="utf-8")
    section = text.split("\n## Listing an upstream\n", 1)[1]
    graphql, rest = re.findall(r"^```toml\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    doc = tomllib.loads(example_block(REPO / "policies.example.toml", "http-list"))
    doc["upstreams"]["shopify-admin"]["credentials"]["directory"] = str(tmp_path)
    written = load(doc).policies["inactive-customers"].list_source
    doc["policies"]["inactive-customers"]["source"] = tomllib.loads(graphql)["policies"][
        "inactive-customers"]["source"]
    documented = load(doc).policies["inactive-customers"].list_source
    assert documented is not None and written is not None
    assert documented.model_dump(exclude={"pages_per_pass", "answers"}) == written.model_dump(
        exclude={"pages_per_pass", "answers"})
    base_url = re.search(r"whose `base_url` is `([^`]+)`", section)
    assert base_url is not None
    doc = document()
    doc["upstreams"] = {"platform": {"base_url": base_url[1]}}
    doc["policies"]["stale"].update(upstream="platform", path="/customers/{object_id}",
                                    **tomllib.loads(rest))
    listing = load(doc).policies["stale"].listing
    assert listing is not None
    assert listing.url("shop-a", "c", CUTOFF, 100) == (
        "https://api.example.com/v1/shops/shop-a/customers?updated_before="
        "2026-12-01T12%3A30%3A45Z&limit=100&cursor=c")
