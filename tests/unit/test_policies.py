"""The policies file: what it accepts and exactly how it refuses."""

from __future__ import annotations

import json
import re
import tomllib
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from service.config.policies import load_policies, resolve_checked, resolve_policies
from service.config.policy_file import parse_duration
from service.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "policies.example.toml"
ENV = {"STOREFRONT_API_AUTH": "Bearer s3cr3t-upstream", "SHOPIFY_WEBHOOK_SECRET": "whsec-x",
       "SHOPIFY_ADMIN_TOKEN": "shpat-s3cr3t"}


def templates_example() -> str:
    """The per-shop GraphQL example of docs/configuration.md (Request templates)."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = text[text.index("### Request templates"):]
    return re.findall(r"^```toml\n(.*?)^```", section, re.MULTILINE | re.DOTALL)[0]


def example() -> dict[str, object]:
    """The example file and the documentation's request-template example together."""
    return tomllib.loads(EXAMPLE.read_text() + "\n" + templates_example())


def refused(doc: dict[str, object], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_policies(doc, ENV if env is None else env, source="p.toml")
    return str(info.value)


def test_example_file_loads_with_secrets_resolved() -> None:
    assert set(load_policies(EXAMPLE, ENV).policies) == {
        "cart-retention", "customer-redact", "shop-redact"}
    policies = resolve_policies(example(), ENV, source="example")
    cart = policies.policies["cart-retention"]
    assert cart.version == 1
    assert cart.scope_for("acme") == "tenant:acme"
    assert policies.policies["customer-redact"].scope_for("acme") == "credential:storefront"
    assert policies.upstreams["storefront"].headers == {"Authorization": "Bearer s3cr3t-upstream"}
    assert policies.webhooks["shopify"].secrets == ("whsec-x",)
    assert "s3cr3t" not in repr(policies)
    erasure = policies.policies["customer-erasure"].request
    assert erasure.host("acme.myshopify.com", "6901") == "acme.myshopify.com"
    assert erasure.host_problem("evil.example", "6901") is not None
    assert erasure.target("acme.myshopify.com", "6901") == (
        "/admin/api/2025-01/graphql.json", None)
    body = erasure.body("acme.myshopify.com", '6901"}')
    assert body is not None
    assert json.loads(body)["variables"] == {"input": {"id": 'gid://shopify/Customer/6901"}'}}
    assert json.loads(body)["query"].startswith("mutation customerDelete($input:")
    assert policies.policies["customer-erasure"].scope_for("acme.myshopify.com") == (
        "shopify-admin:acme.myshopify.com")


def test_no_file_means_no_policies() -> None:
    assert load_policies(None).policies == {}


def test_unknown_key_names_file_and_key() -> None:
    doc = example()
    doc["policies"]["cart-retention"]["max_attempt"] = 3  # type: ignore[index]
    message = refused(doc)
    assert message.startswith("policies file p.toml: policies.cart-retention.max_attempt:")
    assert "unknown key" in message


def test_missing_secret_env_var_is_named() -> None:
    message = refused(example(), {"SHOPIFY_WEBHOOK_SECRET": "x"})
    assert "upstreams.storefront.headers_from_env.Authorization" in message
    assert "environment variable STOREFRONT_API_AUTH is not set" in message


def test_a_secret_loses_one_trailing_line_break_as_a_mounted_file_has() -> None:
    """A secret mounted from a file usually ends in a line break: with it the header could
    not be sent (every item would go dead as an invalid request) and no signature would
    match. One is dropped, as from a credential file."""
    env = {name: value + ("\r\n" if name.startswith("SHOPIFY") else "\n")
           for name, value in ENV.items()}
    policies = resolve_policies(example(), env, source="p.toml")
    assert policies.upstreams["storefront"].headers["Authorization"] == ENV["STOREFRONT_API_AUTH"]
    assert policies.webhooks["shopify"].secrets == (ENV["SHOPIFY_WEBHOOK_SECRET"],)


@pytest.mark.parametrize(("value", "why"), [
    ("Bearer a\nX-Admin: yes", "holds a line break or a character a header value cannot carry"),
    ("Bearer caf\u00e9", "holds a line break or a character a header value cannot carry"),
    ("Bearer x\n\n", "holds a line break or a character a header value cannot carry"),
    ("\n", "holds only a line break"),
])
def test_a_header_secret_that_cannot_be_sent_is_refused_unquoted(value: str, why: str) -> None:
    message = refused(example(), {**ENV, "STOREFRONT_API_AUTH": value})
    assert message.startswith("policies file p.toml: upstreams.storefront.headers_from_env."
                              f"Authorization: environment variable STOREFRONT_API_AUTH {why}")
    assert "Bearer" not in message


def test_missing_webhook_secret_is_named() -> None:
    message = refused(example(), {"STOREFRONT_API_AUTH": "x"})
    assert "webhooks.shopify.secret_env" in message and "SHOPIFY_WEBHOOK_SECRET" in message


@pytest.mark.parametrize(
    ("mutate", "key", "words"),
    [
        (lambda d: d["policies"]["cart-retention"].update(upstream="nope"),
         "policies.cart-retention.upstream", "unknown upstream 'nope'"),
        (lambda d: d["policies"]["cart-retention"].update(lease_seconds=10),
         "policies.cart-retention.lease_seconds", "longer than upstream"),
        (lambda d: d["policies"]["cart-retention"].update(path="/carts/{id}"),
         "policies.cart-retention.path", "unknown placeholder"),
        (lambda d: d["policies"]["cart-retention"].update(path="carts/{object_id}"),
         "policies.cart-retention.path", "must start with '/'"),
        (lambda d: d["policies"]["cart-retention"].update(scope="tenant:{shop}"),
         "policies.cart-retention.scope", "unknown placeholder"),
        # the ledger's CHECK on a scope's name: each was a 500 on every registration
        (lambda d: d["policies"]["cart-retention"].update(scope=""),
         "policies.cart-retention.scope", "must name the token bucket"),
        (lambda d: d["policies"]["cart-retention"].update(scope="tenant:\n{tenant_id}"),
         "policies.cart-retention.scope", "control characters"),
        (lambda d: d["policies"]["cart-retention"].update(scope="é" * 256 + "{tenant_id}"),
         "policies.cart-retention.scope", "over the 512 bytes"),
        (lambda d: d["policies"]["cart-retention"]["rate"].update(per_second=0),
         "policies.cart-retention.rate.per_second", "greater than or equal to 0.001"),
        (lambda d: d["policies"]["cart-retention"].pop("version"),
         "policies.cart-retention.version", "required key is missing"),
        (lambda d: d["policies"]["cart-retention"].update(method="GET"),
         "policies.cart-retention.method", "DELETE"),
        (lambda d: d["webhooks"]["shopify"]["rules"][0].update(due="P1M"),
         "webhooks.shopify.rules[0].due", "ISO 8601 duration"),
        (lambda d: d["webhooks"]["shopify"]["rules"][0].update(policy="ghost"),
         "webhooks.shopify.rules[0].policy", "unknown policy 'ghost'"),
        (lambda d: d["webhooks"]["shopify"].update(scheme="md5"),
         "webhooks.shopify.scheme", "standard"),
        (lambda d: d["upstreams"]["storefront"].update(base_url="ftp://x"),
         "upstreams.storefront.base_url", "pattern"),
        (lambda d: d["policies"].update({"Bad Name": d["policies"]["cart-retention"]}),
         "policies.Bad Name", "lower-case"),
        # request templates: the URL, the host and its allow-list, the body
        (lambda d: d["policies"]["cart-retention"].update(path="/carts/{tenant_id}"),
         "policies.cart-retention.path", "must contain {object_id}"),
        (lambda d: d["policies"]["cart-retention"].update(path="/carts/{object_id}#x"),
         "policies.cart-retention.path", "'#'"),
        (lambda d: d["policies"]["cart-retention"].update(path="/carts/{object_id}?v={ver}"),
         "policies.cart-retention.path", "unknown placeholder(s) ['ver']"),
        (lambda d: d["upstreams"]["shopify-admin"].pop("host_pattern"),
         "upstreams.shopify-admin.host_pattern", "required when the base_url's host has"),
        (lambda d: d["upstreams"]["shopify-admin"].update(host_pattern=r".*\.myshopify\.com"),
         "upstreams.shopify-admin.host_pattern", "'evil.example/x.myshopify.com', which is no "
                                                 "host name"),
        (lambda d: d["upstreams"]["shopify-admin"].update(host_pattern="[a-z0-9.-]+"),
         "upstreams.shopify-admin.host_pattern", "accepts any host (e.g. 'evil.example')"),
        (lambda d: d["upstreams"]["shopify-admin"].update(host_pattern="(["),
         "upstreams.shopify-admin.host_pattern", "not a regular expression"),
        (lambda d: d["upstreams"]["storefront"].update(host_pattern="shop\\.example\\.com"),
         "upstreams.storefront.host_pattern", "only for a base_url whose host has"),
        (lambda d: d["upstreams"]["shopify-admin"].update(base_url="https://{shop}/admin"),
         "upstreams.shopify-admin.base_url", "unknown placeholder(s) ['shop']; allowed: "
                                             "['object_id', 'policy', 'policy_version', "
                                             "'tenant_id', 'upstream']"),
        (lambda d: d["upstreams"]["shopify-admin"].update(
            base_url="https://{tenant_id}@x.myshopify.com"),
         "upstreams.shopify-admin.base_url", "a placeholder cannot be in the user info"),
        (lambda d: d["upstreams"]["shopify-admin"].update(
            base_url="https://x.myshopify.com:{tenant_id}"),
         "upstreams.shopify-admin.base_url", "a placeholder cannot be in the port"),
        (lambda d: d["upstreams"]["shopify-admin"].update(base_url="{tenant_id}://x"),
         "upstreams.shopify-admin.base_url", "pattern"),
        (lambda d: d["upstreams"]["shopify-admin"].update(base_url="https://{tenant_id}%2f.x"),
         "upstreams.shopify-admin.base_url", "letters, digits, '-' and '.'"),
        (lambda d: d["policies"]["customer-erasure"]["body"]["variables"]["input"].update(
            id="gid://shopify/Customer/{customer_id}"),
         "policies.customer-erasure.body.variables.input.id",
         "unknown placeholder(s) ['customer_id']"),
        (lambda d: d["policies"]["customer-erasure"]["body"].update(at=datetime(2026, 1, 1)),
         "policies.customer-erasure.body.at", "a TOML date or time has no JSON form"),
        (lambda d: d["policies"]["customer-erasure"]["body"].update(n=float("inf")),
         "policies.customer-erasure.body.n", "no JSON form"),
        (lambda d: d["policies"]["customer-erasure"]["body"].update({"{tenant_id}": "x"}),
         'policies.customer-erasure.body."{tenant_id}"', "a key is sent as written"),
        (lambda d: d["policies"]["customer-erasure"].update(body='{"query": "x", '),
         "policies.customer-erasure.body", "not JSON"),
        (lambda d: d["policies"]["customer-erasure"].update(body='{"id": NaN}'),
         "policies.customer-erasure.body", "NaN is not JSON"),
        (lambda d: d["policies"]["customer-erasure"].update(body='{"a": 1, "a": 2}'),
         "policies.customer-erasure.body", "the key 'a' appears twice"),
        (lambda d: d["policies"]["customer-erasure"].update(body='"{object_id}"'),
         "policies.customer-erasure.body", "must be a JSON object or array"),
        (lambda d: d["policies"]["customer-erasure"].update(body=3),
         "policies.customer-erasure.body", "must be a table or an array"),
        (lambda d: d["policies"]["customer-erasure"].update(body={"q": "{ x }"}),
         "policies.customer-erasure.path", "must contain {object_id}"),
    ],
)
def test_each_fault_is_refused_with_its_key(mutate, key, words) -> None:  # type: ignore[no-untyped-def]
    doc = example()
    mutate(doc)
    message = refused(doc)
    assert message.startswith(f"policies file p.toml: {key}"), message
    assert words in message, message


def test_a_refused_upstream_is_not_also_unknown_to_its_policies() -> None:
    doc = example()
    doc["upstreams"]["shopify-admin"].pop("host_pattern")  # type: ignore[index]
    message = refused(doc)
    assert "upstreams.shopify-admin.host_pattern" in message
    assert "unknown upstream" not in message


def test_a_body_may_be_json_text() -> None:
    doc: Any = example()
    body = doc["policies"]["customer-erasure"]["body"]
    doc["policies"]["customer-erasure"]["body"] = json.dumps(body, indent=2)
    as_text = resolve_policies(doc, ENV, source="p.toml").policies["customer-erasure"]
    as_toml = resolve_policies(example(), ENV, source="p.toml").policies["customer-erasure"]
    assert as_text.request.body("t", "1") == as_toml.request.body("t", "1")


def test_every_template_problem_is_listed_at_once() -> None:
    doc: Any = example()
    doc["upstreams"]["shopify-admin"]["host_pattern"] = ".*"
    doc["policies"]["cart-retention"]["path"] = "/carts/{cart}"
    doc["policies"]["customer-erasure"]["body"]["x"] = "{customer}"
    doc["policies"]["customer-redact"]["path"] = "/customers"
    with pytest.raises(ConfigError) as info:
        resolve_policies(doc, ENV, source="p.toml")
    keys = sorted(p.split(": ")[1] for p in info.value.problems)
    # the schema's problem (cart-retention.path) hides no other entry's; only the body
    # of customer-erasure waits for its upstream's host, which it is compiled against
    assert keys == ["policies.cart-retention.path", "policies.customer-redact.path",
                    "upstreams.shopify-admin.host_pattern"], keys
    doc["policies"]["cart-retention"]["path"] = "/carts/{object_id}"
    doc["upstreams"]["shopify-admin"]["host_pattern"] = r"[a-z0-9-]+\.myshopify\.com"
    with pytest.raises(ConfigError) as info:
        resolve_policies(doc, ENV, source="p.toml")
    keys = sorted(p.split(": ")[1] for p in info.value.problems)
    assert keys == ["policies.customer-erasure.body.x", "policies.customer-redact.path"]


def test_every_entry_is_checked_whatever_the_others_hold() -> None:
    """Seven mistakes in five entries, of the schema and of resolution, all listed in one
    pass: a schema problem used to hide every other one. What resolved leaves out every
    entry with a problem and the policies naming one (`returns`); the rest is kept, for
    check-config to check further."""
    doc = {
        "upstreams": {
            "shop": {"base_url": "http://127.0.0.1:9", "timeout_seconds": "ten"},
            "warehouse": {"base_url": "http://127.0.0.1:9",
                          "headers_from_env": {"Authorization": "WAREHOUSE_AUTH"}},
            "depot": {"base_url": "http://127.0.0.1:9"}},
        "policies": {
            "carts": {"version": 1, "upstream": "shopp", "path": "/c/{object_id}",
                      "rate": {"per_second": 5}, "max_attempt": 3},
            "orders": {"version": 1, "upstream": "warehouse", "path": "/o/{object_id}",
                       "rate": {"per_second": 5}, "lease_seconds": 5},
            "returns": {"version": 1, "upstream": "warehouse", "path": "/r/{object_id}",
                        "rate": {"per_second": 5}},
            "refunds": {"version": 1, "upstream": "depot", "path": "/r/{object_id}",
                        "rate": {"per_second": 5}}},
        "webhooks": {"shopify": {"scheme": "shopify", "secret_env": "SHOPIFY_SECRET_UNSET",
                                 "rules": [{"topic": "carts/update", "policy": "cart",
                                            "tenant": "header:X-Shopify-Shop-Domain",
                                            "object_id": "body:id"}]}},
    }
    resolved, problems = resolve_checked(doc, {}, source="p.toml")
    assert [p.removeprefix("policies file p.toml: ") for p in problems] == [
        "upstreams.shop.timeout_seconds: Input should be a valid number, unable to parse "
        "string as a number",
        "policies.carts.max_attempt: unknown key (check the spelling; see "
        "docs/configuration.md)",
        "upstreams.warehouse.headers_from_env.Authorization: environment variable "
        "WAREHOUSE_AUTH is not set",
        "policies.carts.upstream: unknown upstream 'shopp'; declared: ['depot', 'shop', "
        "'warehouse']",
        "policies.orders.lease_seconds: must be longer than upstream 'warehouse' "
        "timeout_seconds (10.0)",
        "webhooks.shopify.rules[0].policy: unknown policy 'cart'",
        "webhooks.shopify.secret_env: environment variable SHOPIFY_SECRET_UNSET is not set",
    ]
    assert (set(resolved.upstreams), set(resolved.policies), set(resolved.webhooks)) == (
        {"depot"}, {"refunds"}, set())
    with pytest.raises(ConfigError) as info:
        resolve_policies(doc, {}, source="p.toml")
    assert list(info.value.problems) == problems


def test_a_policy_names_nothing_undeclared_even_with_other_mistakes() -> None:
    """Names are checked on the entry as written: a policy that does not fit the schema
    still has its upstream and stores checked, and naming an entry that does not fit the
    schema is no unknown name."""
    doc = {"upstreams": {"shop": {"base_url": "ftp://x"}},
           "policies": {"carts": {"version": 0, "upstream": "shop", "rate": {},
                                  "source": {"store": "db", "query": "SELECT 1"},
                                  "target": {"store": "db", "statement": "DELETE"}},
                        "lists": {"version": 1, "rate": {"per_second": 1},
                                  "source": {"upstream": "lister"}}}}
    problems = refused(doc, {})
    assert "policies.carts.version" in problems and "upstreams.shop.base_url" in problems
    assert "unknown upstream 'shop'" not in problems
    assert "policies.carts.source.store: unknown store 'db'; declared: none" in problems
    assert "policies.carts.target.store: unknown store 'db'" in problems
    assert "policies.lists.source.upstream: unknown upstream 'lister'" in problems


def test_toml_syntax_error_names_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[policies.x\nversion = 1\n")
    with pytest.raises(ConfigError, match=r"policies file .*bad\.toml: not valid TOML"):
        load_policies(bad, {})


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"policies file .*nope\.toml: not found"):
        load_policies(tmp_path / "nope.toml", {})


def test_rotation_resolves_every_secret() -> None:
    doc = example()
    doc["webhooks"]["shopify"]["secrets_env"] = ["SHOPIFY_OLD"]  # type: ignore[index]
    policies = resolve_policies(doc, {**ENV, "SHOPIFY_OLD": "old"}, source="p.toml")
    assert policies.webhooks["shopify"].secrets == ("whsec-x", "old")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("PT15M", timedelta(minutes=15)), ("P1D", timedelta(days=1)),
     ("P1W", timedelta(weeks=1)), ("P1DT2H3M4.5S", timedelta(days=1, hours=2, minutes=3,
                                                            seconds=4.5)),
     ("PT0S", timedelta(0))],
)
def test_durations(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["P", "PT", "P1Y", "P1M", "1D", "P1DT", "PT-1S", "", "now"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["P36501D", "P5215W", "PT99999999999999999999999999S",
                                  "P99999999999999999999D"])
def test_durations_are_bounded_so_due_times_stay_in_range(text: str) -> None:
    with pytest.raises(ValueError, match="longer than 36500 days"):
        parse_duration(text)
    assert parse_duration("P36500D").days == 36_500


def _with_source(source: dict[str, object]) -> dict[str, object]:
    doc = example()
    rule = {"topic": "store/cart/abandoned", "policy": "cart-retention",
            "tenant": "body:producer", "object_id": "body:data.id"}
    doc["webhooks"] = {"bc": {"secret_env": "BC_SECRET", "rules": [rule], **source}}
    return doc


@pytest.mark.parametrize(("source", "secret", "problem"), [
    ({"scheme": "header"}, "s" * 16, "webhooks.bc.signature_header: required for scheme "
                                     "'header'"),
    ({"scheme": "header", "signature_header": "X-Secret"}, "s" * 15,
     "webhooks.bc.secret_env: environment variable BC_SECRET: a header secret needs at least "
     "16 characters"),
    ({"scheme": "header", "signature_header": "X-Secret", "topic_header": "X-Event",
      "topic_path": "scope"}, "s" * 16,
     "webhooks.bc.topic_path: set topic_header or topic_path, not both"),
    ({"scheme": "shopify", "topic_path": "scope"}, "s" * 16,
     "webhooks.bc.topic_path: only for schemes 'hmac-sha256' and 'header' (scheme 'shopify' "
     "names its own)"),
    ({"scheme": "header", "signature_header": "X-Secret", "topic_path": "a..b"}, "s" * 16,
     "webhooks.bc.topic_path: 'a..b' is not a body path"),
])
def test_a_header_source_names_its_header_and_a_long_secret(
        source: dict[str, object], secret: str, problem: str) -> None:
    message = refused(_with_source(source), {**ENV, "BC_SECRET": secret})
    assert problem in message, message
    assert secret not in message


def test_a_header_source_resolves() -> None:
    source = {"scheme": "header", "signature_header": "X-Secret", "topic_path": "scope"}
    policies = resolve_policies(_with_source(source), {**ENV, "BC_SECRET": "s" * 16},
                                source="p.toml")
    assert policies.webhooks["bc"].secrets == ("s" * 16,)


def test_the_documented_bigcommerce_source_loads() -> None:
    text = (REPO / "docs" / "webhooks.md").read_text(encoding="utf-8")
    section = text.split("\n## Example: BigCommerce\n", 1)[1]
    [block] = re.findall(r"^```toml\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    doc = example()
    doc["webhooks"] = tomllib.loads(block)["webhooks"]
    policies = resolve_policies(doc, {**ENV, "BIGCOMMERCE_WEBHOOK_SECRET": "b" * 32},
                                source="p.toml")
    source = policies.webhooks["bigcommerce"].config
    assert (source.scheme, source.signature_header, source.topic_path) == (
        "header", "X-Sweeper-Secret", "scope")
