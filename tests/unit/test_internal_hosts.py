"""No tenant id reaches an internal address by its form (issue 46, point 2): numeric host
forms are no host name whatever the host_pattern says; an IP literal or a single-label name
is a host only for an upstream with allow_private_addresses; and check-config refuses a
host_pattern that admits one, unless the upstream opts in."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from service.config.hosts import host_name_problem, internal_host_problem
from service.config.origins import compile_origin
from service.config.placeholders import TemplateProblems
from service.config.policies import Policies, resolve_policies
from service.config.request_templates import compile_request
from service.errors import ConfigError
from service.outcomes import Answer, Failure
from tests.unit.test_request_templates import send

# Every numeric form glibc's inet_aton and the WHATWG URL parser read as an IPv4 address:
# hex, octal, integer, short dotted, and any last label of digits or 0x-hex
NUMERIC_FORMS = [
    "0x7f000003", "0X7F000003", "0xa9fea9fe", "0x", "0177.0.0.1", "0177.1", "2130706433",
    "127.1", "127.0.1", "10.1", "0x7f.0.0.1", "0x7f.1", "127.0.0.0x1", "1.2.3.0x4",
    "127.0.0.01", "00.0.0.0", "a.0x10", "shop.123", "acme.myshopify.0x1f", "4294967296",
]
# A pattern that admits every one of NUMERIC_FORMS (and no arbitrary host): the refusal
# cannot be the pattern's
PERMISSIVE = (r"(0x[0-9a-f]*|0[0-7]*|1|10|127|2130706433|4294967296)"
              r"(\.(0x[0-9a-f]*|[0-9]+)){0,3}|[a-z0-9-]+"
              r"|(a|shop|acme\.myshopify)\.(0x[0-9a-f]*|[0-9]+)")


@pytest.mark.parametrize("host", NUMERIC_FORMS)
def test_numeric_host_forms_are_no_host_names(host: str) -> None:
    problem = host_name_problem(host)
    assert problem is not None and "IPv4" in problem


@pytest.mark.parametrize("host", ["127.0.0.3", "169.254.169.254", "10.0.0.1",
                                  "0.0.0.0"])  # noqa: S104 - a host to refuse
def test_dotted_decimal_is_a_host_name_and_an_ip_literal(host: str) -> None:
    assert host_name_problem(host) is None
    assert internal_host_problem(host) == "an IP address"


@pytest.mark.parametrize("host", ["localhost", "metadata", "a", "kubernetes"])
def test_single_label_names_are_internal(host: str) -> None:
    assert host_name_problem(host) is None
    assert internal_host_problem(host) is not None and "single-label" in \
        str(internal_host_problem(host))


@pytest.mark.parametrize("host", ["acme.myshopify.com", "cafe.example", "a.b", "1a.example",
                                  "shop.0xfeed-x", "x.1a"])
def test_names_with_a_domain_are_not_internal_by_form(host: str) -> None:
    assert host_name_problem(host) is None and internal_host_problem(host) is None


def _request(pattern: str, *, allow_private: bool) -> Any:
    origin = compile_origin("u", "http://{tenant_id}:8080/api", pattern,
                            allow_private=allow_private)
    return compile_request(origin, policy="p", version=1, path="/c/{object_id}")


@pytest.mark.parametrize("tenant_id", NUMERIC_FORMS)
def test_numeric_forms_are_refused_whatever_the_pattern_and_the_opt_in(tenant_id: str
                                                                      ) -> None:
    request = _request(PERMISSIVE, allow_private=True)
    assert request.origin.pattern.fullmatch(tenant_id.lower()), "the pattern admits it"
    problem = request.host_problem(tenant_id, "1")
    assert problem is not None and "IPv4" in problem and "upstream 'u'" in problem
    assert tenant_id not in problem  # the rule, never the value


@pytest.mark.parametrize("tenant_id", ["127.0.0.3", "localhost"])
def test_literals_and_single_labels_need_the_opt_in_at_the_call(tenant_id: str) -> None:
    """The call's own check, whatever the probes of check-config missed."""
    opted_in = _request(r"127\.0\.0\.[0-9]+|localhost", allow_private=True)
    assert opted_in.host_problem(tenant_id, "1") is None
    # an origin compiled without the opt-in, its pattern not probed (as if a probe missed it)
    closed = _request(r"127\.0\.0\.[0-9]+|localhost", allow_private=True)
    object.__setattr__(closed.origin, "allow_private", False)
    problem = closed.host_problem(tenant_id, "1")
    assert problem is not None and "allow_private_addresses" in problem


@pytest.mark.parametrize(("base_url", "pattern", "accepted"), [
    ("https://{tenant_id}", r"[a-z0-9][a-z0-9-]*", "localhost"),  # the pattern
    ("https://{tenant_id}", r"[a-z]+", "localhost"),
    ("https://{tenant_id}", r"a|b|c", "a"),
    ("https://{tenant_id}", r"metadata|shop[0-9]+\.example\.com", "metadata"),
    ("https://{tenant_id}", r"shop-[a-z0-9]+", "shop-localhost"),
    ("https://shop-{tenant_id}:8443", r"shop-[a-z0-9]+", "shop-localhost"),
    ("http://{tenant_id}:8080", r"127\.0\.0\.[0-9]+", "127.0.0.1"),
    ("http://{tenant_id}:8080", r"127\.0\.0\.1|localhost", "localhost"),
    ("http://{tenant_id}:8080", r"10\.[0-9]+\.[0-9]+\.[0-9]+", "10.0.0.1"),
    ("http://{tenant_id}", r"192\.168\.0\.[0-9]{1,3}", "192.168.0.1"),
    ("http://{tenant_id}", r"[0-9]+\.0\.0\.1", "127.0.0.1"),
    ("http://{tenant_id}", r"[0-9]+\.2\.3\.4", "1.2.3.4"),
    ("http://{tenant_id}", r"172\.20\.[0-9]+\.[0-9]+", "172.20.1.1"),  # completed affix
])
def test_check_config_refuses_patterns_admitting_internal_hosts(
        base_url: str, pattern: str, accepted: str) -> None:
    with pytest.raises(TemplateProblems) as info:
        compile_origin("u", base_url, pattern)
    [(key, message)] = info.value.problems
    assert key == "host_pattern" and f"accepts {accepted!r}" in message
    assert "allow_private_addresses = true" in message
    assert compile_origin("u", base_url, pattern, allow_private=True).allow_private


@pytest.mark.parametrize("pattern", [
    r"[a-z0-9][a-z0-9-]*\.myshopify\.com", r"[a-z0-9-]+\.svc\.cluster\.local",
    r"shop-[a-z0-9]+\.eu\.example\.com", r"[a-z0-9-]+\.internal\.example"])
def test_patterns_pinned_to_a_domain_need_no_opt_in(pattern: str) -> None:
    assert compile_origin("u", "https://{tenant_id}", pattern).pattern is not None


def _doc(upstream: dict[str, Any]) -> dict[str, Any]:
    return {"upstreams": {"shops": {"base_url": "http://{tenant_id}:8080", **upstream}},
            "policies": {"erase": {"version": 1, "upstream": "shops", "path": "/c/{object_id}",
                                   "scope": "{upstream}:{tenant_id}",
                                   "rate": {"per_second": 1}}}}


def test_the_policies_file_names_the_key_and_the_rule() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_policies(_doc({"host_pattern": "[a-z0-9][a-z0-9-]*"}), {}, source="p.toml")
    [problem] = info.value.problems
    assert problem.startswith("policies file p.toml: upstreams.shops.host_pattern: accepts "
                              "'localhost', a single-label name")
    assert "allow_private_addresses" in problem


def test_the_opt_in_is_on_the_resolved_upstream() -> None:
    closed = resolve_policies(_doc({"host_pattern": r"[a-z0-9-]+\.shops\.example"}), {},
                              source="p")
    assert closed.upstreams["shops"].allow_private_addresses is False
    opened = resolve_policies(_doc({"host_pattern": "[a-z0-9][a-z0-9-]*",
                                    "allow_private_addresses": True}), {}, source="p")
    assert opened.upstreams["shops"].allow_private_addresses is True
    with pytest.raises(ConfigError, match="allow_private_addresses: Input should be a valid "
                                          "boolean"):
        resolve_policies(_doc({"host_pattern": "x", "allow_private_addresses": "sometimes"}), {},
                         source="p")


async def test_a_hex_tenant_is_never_sent() -> None:
    """The issue's escape: tenant 0x7f000003 reached 127.0.0.3 through a single-label
    pattern. Even opted in, the numeric form is no host: nothing is sent."""
    policies: Policies = resolve_policies(_doc({"host_pattern": "[a-z0-9][a-z0-9-]*",
                                                "allow_private_addresses": True}), {},
                                          source="p")
    for tenant in ("0x7f000003", "0xa9fea9fe", "2130706433"):
        answer, seen = await send(policies, tenant, "1")
        assert answer == Answer(failure=Failure.INVALID_REQUEST) and seen == []
    answer, seen = await send(policies, "localhost", "1")
    assert answer.status == 200 and [str(r.url) for r in seen] == ["http://localhost:8080/c/1"]
    _ = httpx  # the wire is httpx's MockTransport, through send()
