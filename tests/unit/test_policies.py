"""The policies file: what it accepts and exactly how it refuses."""

from __future__ import annotations

import tomllib
from datetime import timedelta
from pathlib import Path

import pytest

from service.errors import ConfigError
from service.policies import load_policies, parse_duration, resolve_policies

EXAMPLE = Path(__file__).resolve().parents[2] / "policies.example.toml"
ENV = {"STOREFRONT_API_AUTH": "Bearer s3cr3t-upstream", "SHOPIFY_WEBHOOK_SECRET": "whsec-x"}


def example() -> dict[str, object]:
    return tomllib.loads(EXAMPLE.read_text())


def refused(doc: dict[str, object], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_policies(doc, ENV if env is None else env, source="p.toml")
    return str(info.value)


def test_example_file_loads_with_secrets_resolved() -> None:
    policies = load_policies(EXAMPLE, ENV)
    cart = policies.policies["cart-retention"]
    assert cart.version == 1
    assert cart.scope_for("acme") == "tenant:acme"
    assert policies.policies["customer-redact"].scope_for("acme") == "credential:storefront"
    assert policies.upstreams["storefront"].headers == {"Authorization": "Bearer s3cr3t-upstream"}
    assert policies.webhooks["shopify"].secrets == ("whsec-x",)
    assert "s3cr3t" not in repr(policies)


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
    ],
)
def test_each_fault_is_refused_with_its_key(mutate, key, words) -> None:  # type: ignore[no-untyped-def]
    doc = example()
    mutate(doc)
    message = refused(doc)
    assert message.startswith(f"policies file p.toml: {key}"), message
    assert words in message, message


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
