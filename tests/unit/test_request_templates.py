"""service.config.request_templates: request templates compiled at start-up and filled per item. A
host made from an id is a host name the upstream's host_pattern allows, or nothing is sent; ids
stay one path segment, one query value, one JSON string; the call on the wire is the one
the template describes, with the same Idempotency-Key as ever."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.config.body_templates import compile_body
from service.config.hosts import HOSTILE_HOST_VALUES, host_name_problem
from service.config.origins import compile_origin
from service.config.placeholders import TemplateProblems
from service.config.policies import Policies, resolve_policies
from service.config.request_templates import compile_request
from service.outcomes import Answer, Failure
from service.upstreams.deletion_api import USER_AGENT, Upstreams
from service.upstreams.request_urls import UrlMaker
from tests.unit.test_upstream import streamed

KEY = "cd" * 32
SHOPIFY_PATTERN = r"[a-z0-9][a-z0-9-]*\.myshopify\.com"
QUERY = ("mutation customerDelete($input: CustomerDeleteInput!) { customerDelete(input: "
         "$input) { deletedCustomerId userErrors { field message } } }")
BODY = {"query": QUERY, "variables": {"input": {"id": "gid://shopify/Customer/{object_id}"},
                                      "version": "{policy_version}",
                                      "raw": "{object_id}", "shop": "{tenant_id}",
                                      "tags": ["{policy}", "{upstream}", 1, 2.5, True]}}

HOSTILE_IDS = [
    '1"}, "admin": {"', '{object_id}', "{}", '"', "\\", "\\u0000", "a\"b'c", "</script>",
    "evil.com/", "a@b", "..", ".", "a/../b", "?x=1&y=2#f", "%2F%2e", "ünï", "顧客", "😀",
    "\u202e", "a" * 512, "1; DROP TABLE items; --",
]


def shopify_doc(**policy: Any) -> dict[str, Any]:
    return {
        "upstreams": {"shopify": {
            "base_url": "https://{tenant_id}/admin/api/2025-01",
            "host_pattern": SHOPIFY_PATTERN, "timeout_seconds": 2,
            "headers_from_env": {"X-Shopify-Access-Token": "TOKEN"}}},
        "policies": {"erase": {"version": 3, "upstream": "shopify", "method": "POST",
                               "path": "/graphql.json", "body": BODY,
                               "rate": {"per_second": 2}, "lease_seconds": 5, **policy}}}


def shopify(**policy: Any) -> Policies:
    return resolve_policies(shopify_doc(**policy), {"TOKEN": "shpat-secret"}, source="t")


async def send(policies: Policies, tenant_id: str, object_id: str, policy: str = "erase"
               ) -> tuple[Answer, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return streamed(200)

    ups = Upstreams(policies.upstreams, transport=httpx.MockTransport(handler))
    try:
        pol = policies.policies[policy]
        result = await ups.for_policy(pol).delete(pol, tenant_id=tenant_id,
                                                  object_id=object_id, operation_key=KEY)
    finally:
        await ups.aclose()
    return result.answer, seen


# -- hosts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["acme.myshopify.com", "a", "127.0.0.1", "xn--bcher-kva.ch",
                                  "a-b.c-d.e", "ACME.MyShopify.COM", "1a.example",
                                  "a" * 63 + ".b"])
def test_host_names(host: str) -> None:
    assert host_name_problem(host) is None


@pytest.mark.parametrize("host", [
    "", ".", "a..b", ".a", "a.", "-a.com", "a-.com", "a_b.com", "a b", "a/b", "a@b", "a:1",
    "a?b", "a#b", "a%2fb", "[::1]", "bücher.ch", "\u212aevil.example",  # Kelvin sign: 'k'
    "a" * 64 + ".com", ("a" * 60 + ".") * 5, "2130706433", "0x7f.0.0.1", "1.2.3",
    "127.0.0.256", "127.000.0.1", "evil.example\n", "a\x00b",
    # numeric forms resolvers read as addresses (tests/unit/test_internal_hosts.py has more)
    "0x7f000003", "0177.0.0.1", "127.1",
])
def test_not_host_names(host: str) -> None:
    assert host_name_problem(host) is not None


@pytest.mark.parametrize("tenant_id", [
    "evil.example", "evil.com/", "evil.com/.myshopify.com", "a@b.myshopify.com",
    "evil.com:443", "evil.com#.myshopify.com", "evil.com?.myshopify.com", "acme.myshopify.com.",
    "acme.myshopify.com.evil.example", "..", ".", "acme..myshopify.com", "bücher.myshopify.com",
    "\u212acme.myshopify.com", "acme.myshopify.com\u0000", " acme.myshopify.com",
    "acme.myshopify.com:80", "user:pw@acme.myshopify.com", "x" * 300 + ".myshopify.com",
    '"}.myshopify.com', "{tenant_id}.myshopify.com", "%61cme.myshopify.com",
])
async def test_a_tenant_id_never_points_a_call_elsewhere(tenant_id: str) -> None:
    policies = shopify()
    request = policies.policies["erase"].request
    problem = request.host_problem(tenant_id, "1")
    assert problem is not None and "upstream 'shopify'" in problem
    assert tenant_id not in problem  # answers never echo input
    answer, seen = await send(policies, tenant_id, "1")
    assert answer == Answer(failure=Failure.INVALID_REQUEST)
    assert seen == []


async def test_a_per_tenant_host_call_on_the_wire() -> None:
    policies = shopify()
    object_id = '1"}, "admin": {"x": "{tenant_id}'
    answer, [sent] = await send(policies, "acme-eu.myshopify.com", object_id)
    assert answer == Answer(status=200)
    # another spelling of the host is refused at the call (the entries store the canonical)
    problem = policies.policies["erase"].request.host_problem("Acme-EU.myshopify.com", "1")
    assert problem is not None and "canonical form 'acme-eu.myshopify.com'" in problem
    assert policies.policies["erase"].tenant("Acme-EU.myshopify.com.") == "acme-eu.myshopify.com"
    assert str(sent.url) == "https://acme-eu.myshopify.com/admin/api/2025-01/graphql.json"
    assert sent.method == "POST"
    assert sent.headers.raw[0] == (b"Host", b"acme-eu.myshopify.com")
    assert sent.headers["X-Shopify-Access-Token"] == "shpat-secret"
    assert sent.headers["Content-Type"] == "application/json"
    assert sent.headers["User-Agent"] == USER_AGENT
    assert sent.headers["Idempotency-Key"] == KEY
    body = await sent.aread()
    assert sent.headers["Content-Length"] == str(len(body))
    assert json.loads(body) == {"query": QUERY, "variables": {
        "input": {"id": f"gid://shopify/Customer/{object_id}"}, "version": 3,
        "raw": object_id, "shop": "acme-eu.myshopify.com", "tags": ["erase", "shopify", 1,
                                                                   2.5, True]}}
    # what httpx builds itself from the same parts
    plain = httpx.Request("POST", "https://acme-eu.myshopify.com/admin/api/2025-01/graphql.json",
                          headers={"User-Agent": USER_AGENT,
                                   "X-Shopify-Access-Token": "shpat-secret",
                                   "Content-Type": "application/json",
                                   "Idempotency-Key": KEY}, content=body)
    assert sorted(sent.headers.raw) == sorted(plain.headers.raw)


async def test_a_host_from_the_tenant_with_a_fixed_port_and_path_placeholders() -> None:
    doc = {"upstreams": {"shop": {
        "base_url": "http://{tenant_id}.shops.example:8443/v1/{tenant_id}/{policy}",
        "host_pattern": r"[a-z0-9-]+\.shops\.example"}},
        "policies": {"p": {"version": 1, "upstream": "shop", "rate": {"per_second": 1},
                           "path": "/customers/{object_id}"
                                   "?version={policy_version}&t={tenant_id}"}}}
    policies = resolve_policies(doc, {}, source="t")
    answer, [sent] = await send(policies, "acme", "a/b c&d=e#f", policy="p")
    assert answer == Answer(status=200)
    assert sent.url.host == "acme.shops.example" and sent.url.port == 8443
    assert sent.headers["Host"] == "acme.shops.example:8443"
    assert sent.url.raw_path == b"/v1/acme/p/customers/a%2Fb%20c%26d%3De%23f?version=1&t=acme"
    assert sent.method == "DELETE" and await sent.aread() == b""
    assert "Content-Type" not in sent.headers
    answer, seen = await send(policies, "evil.example", "1", policy="p")
    assert answer.failure is Failure.INVALID_REQUEST and seen == []


# -- paths and queries -----------------------------------------------------------------------

_ident = st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=64
                 ).filter(lambda s: s not in (".", ".."))


@given(tenant_id=_ident, object_id=_ident)
def test_each_id_is_one_segment_and_one_query_value(tenant_id: str, object_id: str) -> None:
    origin = compile_origin("u", "https://api.example.com/stores/{tenant_id}/v3", None)
    request = compile_request(origin, policy="p", version=7,
                              path="/customers/{object_id}?id:in={object_id}&v={policy_version}")
    path, query = request.target(tenant_id, object_id)
    segments = path.split("/")
    assert len(segments) == 6
    assert unquote(segments[2]) == tenant_id and unquote(segments[5]) == object_id
    assert query is not None
    params = query.split("&")
    assert len(params) == 2 and params[1] == "v=7"
    assert unquote(params[0].removeprefix("id:in=")) == object_id
    # httpx sends both exactly as rendered
    url, _ = UrlMaker("https://api.example.com").url(path, query=query)
    assert url.raw_path == (path + "?" + query).encode("ascii")
    origin, target = UrlMaker("https://api.example.com", target=True).url(path, query=query)
    assert (target if target is not None else origin.raw_path) == url.raw_path
    assert url == httpx.URL("https://api.example.com" + path + "?" + query)


@pytest.mark.parametrize(("tenant_id", "object_id"), [(".", "1"), ("t", ".."), ("..", ".")])
def test_dot_ids_make_no_path(tenant_id: str, object_id: str) -> None:
    origin = compile_origin("u", "https://api.example.com", None)
    request = compile_request(origin, policy="p", version=1, path="/c/{object_id}")
    with pytest.raises(ValueError, match="dot segments"):
        request.target(tenant_id, object_id)


@given(path=st.lists(st.text(max_size=10), min_size=1, max_size=3),
       query=st.none() | st.text(max_size=20),
       host=st.none() | st.sampled_from(["acme.myshopify.com", "127.0.0.1", "a-b.c"]))
def test_url_maker_with_queries_and_hosts_builds_what_httpx_parses(
        path: list[str], query: str | None, host: str | None) -> None:
    from service.config.placeholders import segment
    from service.upstreams.request_urls import PROBE_HOST

    rendered = "/" + "/".join(segment(p) if p not in (".", "..", "") else "x" for p in path)
    query = None if query is None else segment(query) + "=" + segment(query[::-1])
    text = f"https://{host or PROBE_HOST}:8443{rendered}" + ("" if query is None else
                                                              "?" + query)
    parsed = httpx.URL(text)
    made, target = UrlMaker(f"https://{PROBE_HOST}:8443").url(rendered, query=query,
                                                              host=host)
    assert target is None
    assert made == parsed and str(made) == str(parsed) and made.netloc == parsed.netloc
    assert made.raw_path == parsed.raw_path
    origin, target = UrlMaker(f"https://{PROBE_HOST}:8443", target=True).url(
        rendered, query=query, host=host)
    assert origin.netloc == parsed.netloc
    assert (target if target is not None else origin.raw_path) == parsed.raw_path


def test_a_fixed_host_url_maker_refuses_a_host() -> None:
    with pytest.raises(ValueError, match="fixed host"):
        UrlMaker("https://api.example.com").url("/x", host="evil.example")
    with pytest.raises(ValueError, match="fixed host"):
        UrlMaker("https://api.example.com", target=True).url("/x", host="evil.example")


# -- JSON bodies -----------------------------------------------------------------------------

def _expected(template: Any, values: dict[str, Any]) -> Any:
    """The body as a walk of the template would build it (keys never filled in)."""
    import re

    if isinstance(template, dict):
        return {k: _expected(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [_expected(v, values) for v in template]
    if isinstance(template, str):
        whole = re.fullmatch(r"\{([a-z_]+)\}", template)
        if whole:
            return values[whole[1]]
        return re.sub(r"\{([a-z_]+)\}", lambda m: str(values[m[1]]), template)
    return template


@pytest.mark.parametrize("object_id", HOSTILE_IDS)
def test_a_hostile_object_id_stays_one_json_string(object_id: str) -> None:
    request = shopify().policies["erase"].request
    body = request.body("acme.myshopify.com", object_id)
    assert body is not None and body.isascii()
    values = {"tenant_id": "acme.myshopify.com", "object_id": object_id, "policy": "erase",
              "policy_version": 3, "upstream": "shopify"}
    assert json.loads(body) == _expected(BODY, values)
    assert json.loads(body)["variables"]["raw"] == object_id


@given(tenant_id=st.text(), object_id=st.text(), version=st.integers(1, 10**9),
       text=st.text())
def test_body_property(tenant_id: str, object_id: str, version: int, text: str) -> None:
    template = {"a": [text, "{object_id}", f"{text}{{tenant_id}}{text}"],
                "v": "{policy_version}", "v2": "v{policy_version}", text: {"k": "{tenant_id}"}}
    if "{" in text or text in ("a", "v", "v2"):
        return  # a text holding a placeholder is a template of its own; a key replaces one
    pieces = compile_body(template, {"policy": "p", "policy_version": version,
                                     "upstream": "u"})
    origin = compile_origin("u", "https://x.example", None)
    request = compile_request(origin, policy="p", version=version, path="/c",
                              body=template)
    assert request.body_pieces == pieces
    body = request.body(tenant_id, object_id)
    assert body is not None
    assert json.loads(body) == _expected(template, {
        "tenant_id": tenant_id, "object_id": object_id, "policy_version": version})


def test_a_policy_without_a_body_sends_none() -> None:
    origin = compile_origin("u", "https://x.example", None)
    request = compile_request(origin, policy="p", version=1, path="/c/{object_id}", body=None)
    assert request.body("t", "o") is None


@pytest.mark.parametrize(("body", "key", "words"), [
    ({"id": "{id}"}, "body.id", "unknown placeholder(s) ['id']"),
    ({"q": "query { x {id} }"}, "body.q", "GraphQL selection '{ id }'"),
    ({"a": [{"b": "{shop}"}]}, "body.a[0].b", "unknown placeholder"),
    ({"{object_id}": 1}, 'body."{object_id}"', "a key is sent as written"),
    ({"x": float("inf")}, "body.x", "no JSON form"),
    ({"x": float("nan")}, "body.x", "no JSON form"),
    ({"x": object()}, "body.x", "no JSON form"),
])
def test_body_refusals_name_the_key(body: Any, key: str, words: str) -> None:
    with pytest.raises(TemplateProblems) as info:
        compile_body(body, {})
    [(named, message)] = info.value.problems
    assert named == key and words in message, info.value.problems


# -- start-up refusals of base_url and host_pattern --------------------------------------------

@pytest.mark.parametrize(("base_url", "pattern", "key", "words"), [
    ("https://{tenant_id}", None, "host_pattern", "required"),
    ("https://api.example.com", r"api\.example\.com", "host_pattern", "only for a base_url"),
    ("https://{tenant_id}@api.example.com", None, "base_url", "user info"),
    ("https://api.example.com:{tenant_id}", None, "base_url", "port"),
    ("https://api.example.com:http", None, "base_url", "port must be a number"),
    ("https://{tenant_id}_x.example", "x", "base_url", "letters, digits, '-' and '.'"),
    ("https://[{tenant_id}]", "x", "base_url", "letters, digits, '-' and '.'"),
    ("https://{shop}.example", "x", "base_url", "unknown placeholder(s) ['shop']"),
    ("https://x.example/{}", None, "base_url", "plain name"),
    ("https://x.example/{tenant_id!r}", None, "base_url", "plain name"),
    ("https://{tenant_id}", "([", "host_pattern", "not a regular expression"),
    ("https://{tenant_id}", ".*", "host_pattern", "no host name"),
    ("https://{tenant_id}", ".+", "host_pattern", "no host name"),
    ("https://{tenant_id}", r".*\.myshopify\.com", "host_pattern", "no host name"),
    ("https://{tenant_id}", r"[^.]+\.myshopify\.com", "host_pattern", "no host name"),
    ("https://{tenant_id}", r"shop-.*", "host_pattern", "no host name"),
    ("https://{tenant_id}.myshopify.com", r".*\.myshopify\.com", "host_pattern",
     "no host name"),
    ("https://{tenant_id}", r"[a-z0-9.-]+", "host_pattern", "accepts any host"),
    ("https://{tenant_id}", r"[0-9.]+", "host_pattern", "accepts any host"),
    ("https://{tenant_id}", r".*\.example|[a-z]+\.myshopify\.com", "host_pattern",
     "accepts any host"),
])
def test_base_url_refusals_name_the_key(base_url: str, pattern: str | None, key: str,
                                        words: str) -> None:
    with pytest.raises(TemplateProblems) as info:
        compile_origin("u", base_url, pattern)
    assert any(named == key and words in message for named, message in info.value.problems), \
        info.value.problems


@pytest.mark.parametrize(("base_url", "pattern"), [
    ("https://{tenant_id}", SHOPIFY_PATTERN),
    ("https://{tenant_id}.myshopify.com", "[a-z0-9-]+\\.myshopify\\.com"),
    ("https://{tenant_id}.myshopify.com", r"[a-z0-9][a-z0-9.-]*\.myshopify\.com"),
    ("https://shop-{tenant_id}.eu.example.com:8443/api/{tenant_id}",
     r"shop-[a-z0-9]+\.eu\.example\.com"),
    ("https://{tenant_id}.{policy}.example", r"[a-z0-9-]+\.[a-z0-9-]+\.example"),
])
def test_patterns_that_pin_the_domain_are_accepted(base_url: str, pattern: str) -> None:
    origin = compile_origin("u", base_url, pattern)
    assert origin.host is None and origin.pattern is not None
    for value in HOSTILE_HOST_VALUES:
        made = base_url.split("//")[1].split(":")[0].split("/")[0]
        assert not origin.pattern.fullmatch(made.replace("{tenant_id}", value).lower())


def test_object_id_must_be_somewhere() -> None:
    origin = compile_origin("u", "https://x.example", None)
    with pytest.raises(TemplateProblems, match=r"path: must contain \{object_id\}"):
        compile_request(origin, policy="p", version=1, path="/c/{tenant_id}", body=None)
    with pytest.raises(TemplateProblems, match=r"must contain \{object_id\}"):
        compile_request(origin, policy="p", version=1, path="/c", body={"a": "{tenant_id}"})
    for path, body in (("/c?id={object_id}", None), ("/graphql", {"id": "x{object_id}"})):
        compile_request(origin, policy="p", version=1, path=path, body=body)
    in_base = compile_origin("u", "https://x.example/c/{object_id}", None)
    compile_request(in_base, policy="p", version=1, path="/delete", body=None)


def test_the_fixed_host_call_keeps_its_prepared_path() -> None:
    """A fixed host without a body is the call the drain benchmark measures: no host check,
    no body, headers prepared once per method."""
    origin = compile_origin("u", "https://api.example.com/v2", None)
    request = compile_request(origin, policy="p", version=1, path="/c/{object_id}", body=None)
    assert request.host_format is None and request.body_pieces is None
    assert request.path_format == "/v2/c/{object_id}" and request.query_format is None
    assert request.host_problem("anything at all", "x") is None
