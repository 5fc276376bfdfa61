"""Reading a delivery without a database: body paths, extractors, and how rules become hints."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest

from service.config.policies import Policies
from service.config.policy_file import parse_body_path
from service.webhooks.deliveries import DeliveryRejected, extract, read_delivery
from tests.conftest import policies_from

SECRET = "shpss_unit"


@pytest.mark.parametrize(("path", "steps"), [
    ("id", ("id",)),
    ("customer.id", ("customer", "id")),
    ("line_items[0].id", ("line_items", 0, "id")),
    ("grid[1][2]", ("grid", 1, 2)),
])
def test_body_paths(path: str, steps: tuple[object, ...]) -> None:
    assert parse_body_path(path) == steps


@pytest.mark.parametrize("path", ["", "a..b", "a[x]", "[0]", "a.[0]", "a[0", "a b"])
def test_bad_body_paths_are_refused(path: str) -> None:
    with pytest.raises(ValueError, match="body path"):
        parse_body_path(path)


PAYLOAD = {"id": 820982911946154508, "name": "#1001", "flag": True, "ratio": 1.5,
           "customer": {"id": "c-1", "tags": None}, "line_items": [{"id": 7}, {"id": "x"}]}


@pytest.mark.parametrize(("extractor", "value"), [
    ("body:id", "820982911946154508"),
    ("body:name", "#1001"),
    ("body:customer.id", "c-1"),
    ("body:line_items[1].id", "x"),
    ("body:line_items[0].id", "7"),
    ("body:line_items[2].id", None),   # out of range
    ("body:customer.tags", None),      # null
    ("body:flag", None),               # booleans are not ids
    ("body:ratio", None),              # nor are floats
    ("body:customer", None),           # nor objects
    ("body:id.deeper", None),          # a step into a scalar
    ("header:X-Shop", "acme"),
    ("header:X-Missing", None),
])
def test_extract(extractor: str, value: str | None) -> None:
    assert extract(extractor, {"x-shop": "acme"}, PAYLOAD) == value


def policies() -> Policies:
    policy = {"version": 1, "upstream": "u", "path": "/o/{object_id}",
              "rate": {"per_second": 1}}
    rule = {"tenant": "header:X-Shopify-Shop-Domain", "object_id": "body:id"}
    return policies_from({
        "upstreams": {"u": {"base_url": "http://127.0.0.1:9"}},
        "policies": {"a": policy, "b": policy},
        "webhooks": {"s": {"scheme": "shopify", "secret_env": "S", "rules": [
            {**rule, "topic": "orders/cancelled", "policy": "a"},
            {**rule, "topic": "orders/cancelled", "policy": "b", "due": "P2D"}]}},
    }, {"S": SECRET})


def signed(topic: str, payload: object) -> tuple[dict[str, str], bytes]:
    body = json.dumps(payload).encode()
    sig = base64.b64encode(hmac.new(SECRET.encode(), body, hashlib.sha256).digest()).decode()
    return {"x-shopify-hmac-sha256": sig, "x-shopify-topic": topic,
            "x-shopify-shop-domain": "acme.myshopify.com", "x-shopify-webhook-id": "w-1"}, body


def test_every_matching_rule_gives_a_hint() -> None:
    pol = policies()
    headers, body = signed("orders/cancelled", {"id": 5})
    delivery = read_delivery(pol.webhooks["s"], pol, headers, body, now_s=0)
    assert (delivery.source, delivery.webhook_id, delivery.event_type) == (
        "s", "w-1", "orders/cancelled")
    assert [(h.policy.name, h.tenant_id, h.object_id, h.delay_seconds)
            for h in delivery.hints] == [("a", "acme.myshopify.com", "5", None),
                                          ("b", "acme.myshopify.com", "5", 172800.0)]


def test_no_rule_means_no_hints_and_the_signature_comes_first() -> None:
    pol = policies()
    headers, body = signed("products/update", {"id": 5})
    assert read_delivery(pol.webhooks["s"], pol, headers, body, now_s=0).hints == ()
    # a body that is not JSON but not signed either: the signature answers first
    headers["x-shopify-hmac-sha256"] = "AAAA"
    with pytest.raises(DeliveryRejected) as info:
        read_delivery(pol.webhooks["s"], pol, headers, b"{not json", now_s=0)
    assert info.value.reason == "signature"
