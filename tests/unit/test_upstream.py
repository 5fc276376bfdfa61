"""service.upstreams (the client and its exchange): ids stay in their own percent-encoded
path segment, each call carries the operation key as Idempotency-Key with the policy's method
and path and the env-provided headers, transport failures map to the Failure exchange.py's
docstring promises, bodies are read only up to the cap, and an overall deadline bounds every
call."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.config.origins import compile_origin
from service.config.policies import Policies, resolve_policies
from service.config.request_templates import compile_request
from service.outcomes import Answer, Failure, Outcome, classify
from service.protocols.egress import AddressRefused
from service.protocols.transport import SentTooLate, Withheld
from service.upstreams.deletion_api import USER_AGENT, Upstreams
from service.upstreams.exchange import BODY_CAP_BYTES, failure_of, send

TEMPLATE = "/tenants/{tenant_id}/carts/{object_id}"
KEY = "ab" * 32
ENV = {"SHOP_AUTH": "Bearer s3cret-token", "SHOP_TENANT_HEADER": "acme-header"}


def make_policies(*, method: str = "DELETE", path: str = TEMPLATE, timeout: float = 2.0,
                  base_url: str = "https://shop.example.com/api",
                  headers: dict[str, str] | None = None) -> Policies:
    doc: dict[str, Any] = {
        "upstreams": {
            "shop": {"base_url": base_url, "timeout_seconds": timeout,
                     "headers_from_env": headers if headers is not None else
                     {"Authorization": "SHOP_AUTH", "X-Shop": "SHOP_TENANT_HEADER"}},
            "other": {"base_url": "http://other.example:8080", "timeout_seconds": 2.0,
                      "headers_from_env": {"X-Other": "SHOP_AUTH"}},
        },
        "policies": {
            "carts": {"version": 1, "upstream": "shop", "method": method, "path": path,
                      "rate": {"per_second": 10}, "lease_seconds": 5},
            "exports": {"version": 3, "upstream": "other", "method": "POST",
                        "path": "/exports/{object_id}/delete", "rate": {"per_second": 10},
                        "lease_seconds": 5},
        },
    }
    return resolve_policies(doc, ENV, source="t")


Handler = Callable[[httpx.Request], Any]


def _now() -> datetime:
    return datetime.now(UTC)


def streamed(status: int, *, headers: Any = None, body: bytes = b"") -> httpx.Response:
    """A response whose body is a stream, as from a real transport."""
    async def chunks() -> AsyncIterator[bytes]:
        if body:
            yield body

    return httpx.Response(status, headers=headers, content=chunks())


async def call(handler: Handler, *, tenant_id: str = "acme", object_id: str = "cart-1",
               policy: str = "carts", **kw: Any) -> tuple[Answer, float]:
    policies = make_policies(**kw)
    ups = Upstreams(policies.upstreams, transport=httpx.MockTransport(handler))
    try:
        pol = policies.policies[policy]
        result = await ups.for_policy(pol).delete(pol, tenant_id=tenant_id,
                                                  object_id=object_id, operation_key=KEY)
    finally:
        await ups.aclose()
    return result.answer, result.latency_ms


# -- the path a call sends ----------------------------------------------------------------

_ORIGIN = compile_origin("shop", "https://shop.example.com", None)


def render_path(template: str, *, tenant_id: str, object_id: str) -> str:
    """The path a policy with `template` as its path sends (its compiled request template,
    as the worker calls it)."""
    request = compile_request(_ORIGIN, policy="carts", version=1,
                              path=template if template.startswith("/") else "/" + template)
    path, query = request.target(tenant_id, object_id)
    assert query is None
    return path if template.startswith("/") else path[1:]

@pytest.mark.parametrize(("object_id", "segment"), [
    ("cart-1", "cart-1"),
    ("a/b", "a%2Fb"),
    ("../../admin", "..%2F..%2Fadmin"),
    ("...", "..."),
    (".hidden", ".hidden"),
    ("./", ".%2F"),
    ("a?x=1", "a%3Fx%3D1"),
    ("a#frag", "a%23frag"),
    ("%2F", "%252F"),
    ("%2e%2e", "%252e%252e"),
    ("with space", "with%20space"),
    ("a+b", "a%2Bb"),
    ("a;b,c", "a%3Bb%2Cc"),
    ("{object_id}", "%7Bobject_id%7D"),
    ("éü€", "%C3%A9%C3%BC%E2%82%AC"),
    ("顧客", "%E9%A1%A7%E5%AE%A2"),
    ("😀", "%F0%9F%98%80"),
    ("1; DROP TABLE items; --", "1%3B%20DROP%20TABLE%20items%3B%20--"),
    ("' OR '1'='1", "%27%20OR%20%271%27%3D%271"),
    ("\\..\\x", "%5C..%5Cx"),
])
def test_render_path_keeps_each_id_in_one_segment(object_id: str, segment: str) -> None:
    path = render_path(TEMPLATE, tenant_id="acme", object_id=object_id)
    assert path == f"/tenants/acme/carts/{segment}"
    assert path.count("/") == TEMPLATE.count("/")
    assert unquote(path.rsplit("/", 1)[1]) == object_id
    # and the tenant is encoded the same way
    path = render_path(TEMPLATE, tenant_id=object_id, object_id="x")
    assert path == f"/tenants/{segment}/carts/x"


@pytest.mark.parametrize(("tenant_id", "object_id"), [
    ("acme", "."), ("acme", ".."), (".", "cart"), ("..", "cart"), (".", ".."),
])
def test_render_path_refuses_dot_segments(tenant_id: str, object_id: str) -> None:
    with pytest.raises(ValueError, match="dot segments"):
        render_path(TEMPLATE, tenant_id=tenant_id, object_id=object_id)


_ident = st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=64
                 ).filter(lambda s: s not in (".", ".."))
_SAFE_PATH = re.compile(r"^[A-Za-z0-9._~/-]*(%[0-9A-F]{2}[A-Za-z0-9._~/-]*)*$")


@given(tenant_id=_ident, object_id=_ident)
def test_render_path_property(tenant_id: str, object_id: str) -> None:
    path = render_path(TEMPLATE, tenant_id=tenant_id, object_id=object_id)
    assert path.count("/") == TEMPLATE.count("/")
    segments = path.split("/")
    assert unquote(segments[-1]) == object_id
    assert unquote(segments[2]) == tenant_id
    assert _SAFE_PATH.match(path), path
    # httpx sends it as is, without re-encoding or dot-segment normalisation
    url = httpx.URL("https://shop.example.com/api" + path)
    assert url.raw_path == b"/api" + path.encode("ascii")


@given(object_id=_ident)
def test_render_path_property_object_id_only_template(object_id: str) -> None:
    template = "/v2/customers/{object_id}"
    path = render_path(template, tenant_id="ignored", object_id=object_id)
    assert path.count("/") == template.count("/")
    assert unquote(path.rsplit("/", 1)[1]) == object_id


# -- the request on the wire ----------------------------------------------------------------

@pytest.mark.parametrize("method", ["DELETE", "POST", "PUT", "PATCH"])
async def test_request_carries_key_method_path_and_env_headers(method: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return streamed(204)

    answer, latency = await call(handler, method=method, tenant_id="acme eu",
                                 object_id="a/../b?c#d")
    assert answer == Answer(status=204, retry_after=None)
    assert latency >= 0
    [request] = seen
    assert request.method == method
    assert request.url.scheme == "https" and request.url.host == "shop.example.com"
    assert request.url.raw_path == b"/api/tenants/acme%20eu/carts/a%2F..%2Fb%3Fc%23d"
    assert request.url.query == b"" and request.url.fragment == ""
    assert request.headers["Idempotency-Key"] == KEY
    assert request.headers["Authorization"] == "Bearer s3cret-token"
    assert request.headers["X-Shop"] == "acme-header"
    assert request.headers["User-Agent"] == USER_AGENT
    assert "X-Other" not in request.headers


async def test_upstreams_route_each_policy_to_its_own_upstream() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return streamed(200)

    answer, _ = await call(handler, policy="exports", object_id="exp/1")
    assert answer.status == 200
    [request] = seen
    assert request.method == "POST"
    assert str(request.url) == "http://other.example:8080/exports/exp%2F1/delete"
    assert request.headers["X-Other"] == "Bearer s3cret-token"
    assert request.headers["Idempotency-Key"] == KEY
    assert "Authorization" not in request.headers


async def test_the_same_operation_key_on_every_attempt() -> None:
    keys: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        return streamed(503 if len(keys) < 3 else 204)

    policies = make_policies()
    ups = Upstreams(policies.upstreams, transport=httpx.MockTransport(handler))
    pol = policies.policies["carts"]
    statuses = [(await ups.for_policy(pol).delete(pol, tenant_id="t", object_id="o",
                                                  operation_key=KEY)).answer.status
                for _ in range(3)]
    await ups.aclose()
    assert statuses == [503, 503, 204]
    assert keys == [KEY] * 3


async def test_no_headers_from_env_means_only_ours() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return streamed(204)

    await call(handler, headers={})
    assert "Authorization" not in seen[0].headers
    assert seen[0].headers["Idempotency-Key"] == KEY


@pytest.mark.parametrize("object_id", [".", ".."])
async def test_a_dot_id_never_reaches_the_wire(object_id: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return streamed(204)

    answer, _ = await call(handler, object_id=object_id)
    assert answer == Answer(failure=Failure.INVALID_REQUEST)
    assert seen == []
    assert classify(answer, absent_means_deleted=True, now=_now()).outcome is Outcome.PERMANENT


async def test_status_and_retry_after_pass_through() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return streamed(429, headers={"Retry-After": "7"})

    answer, _ = await call(handler)
    assert answer == Answer(status=429, retry_after="7")


async def test_a_latin1_retry_after_byte_reaches_classify_as_text() -> None:
    """Evidence for the outcomes bug: a 0xB2 byte arrives as '²' (see test_outcomes)."""
    def handler(request: httpx.Request) -> httpx.Response:
        return streamed(200, headers=[(b"Retry-After", b"\xb2")])

    answer, _ = await call(handler)
    assert answer == Answer(status=200, retry_after="²")


async def test_redirects_are_not_followed() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return streamed(301, headers={"Location": "https://elsewhere.example/x"})

    answer, _ = await call(handler)
    assert answer.status == 301
    assert len(seen) == 1


# -- transport failures ------------------------------------------------------------------

@pytest.mark.parametrize(("exc", "failure"), [
    (AddressRefused("h resolves to 10.0.0.1, which is not a public address"),
     Failure.PRIVATE_ADDRESS),
    (httpx.ConnectError("refused"), Failure.CONNECT),
    (httpx.ConnectTimeout("slow connect"), Failure.TIMEOUT_BEFORE_SEND),
    (httpx.PoolTimeout("pool"), Failure.TIMEOUT_BEFORE_SEND),
    (httpx.WriteTimeout("w"), Failure.TIMEOUT_AFTER_SEND),
    (httpx.WriteError("w"), Failure.TIMEOUT_AFTER_SEND),
    (httpx.ReadTimeout("r"), Failure.TIMEOUT_AFTER_SEND),
    (httpx.ReadError("reset"), Failure.RESET_AFTER_SEND),
    (httpx.RemoteProtocolError("closed mid-answer"), Failure.RESET_AFTER_SEND),
    (httpx.LocalProtocolError("bad"), Failure.INVALID_REQUEST),
    (SentTooLate("late"), Failure.SENT_TOO_LATE),
    (Withheld("held"), Failure.WITHHELD),
    (httpx.UnsupportedProtocol("gopher"), Failure.PROTOCOL),
    (httpx.ProxyError("proxy"), Failure.PROTOCOL),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "")
def test_each_transport_error_is_exactly_one_failure(exc: httpx.TransportError,
                                                     failure: Failure) -> None:
    """exchange.py's docstring tree, row by row (the more specific class first)."""
    answer = failure_of(exc)
    assert answer.failure is failure and answer.status is None
    assert answer.detail == ("h resolves to 10.0.0.1" if failure is Failure.PRIVATE_ADDRESS
                             else None)


NOT_SENT = {Failure.CONNECT, Failure.TIMEOUT_BEFORE_SEND}


@pytest.mark.parametrize(("exc", "expected"), [
    # never sent: transient (the docstring: "CONNECT / TIMEOUT_BEFORE_SEND (not sent)")
    (httpx.ConnectError("refused"), NOT_SENT),
    (httpx.ConnectTimeout("slow connect"), NOT_SENT),
    (httpx.PoolTimeout("pool"), NOT_SENT),
    # may have been read: the duplicate window
    (httpx.WriteTimeout("w"), {Failure.TIMEOUT_AFTER_SEND}),
    (httpx.WriteError("w"), {Failure.TIMEOUT_AFTER_SEND}),
    (httpx.ReadTimeout("r"), {Failure.TIMEOUT_AFTER_SEND}),
    (httpx.ReadError("reset"), {Failure.RESET_AFTER_SEND}),
    (httpx.RemoteProtocolError("closed mid-answer"), {Failure.RESET_AFTER_SEND}),
    # refused before sending: a header holding a line break (service/protocols/transport.py)
    (httpx.LocalProtocolError("bad"), {Failure.INVALID_REQUEST}),
    # other protocol errors
    (httpx.UnsupportedProtocol("gopher"), {Failure.PROTOCOL}),
    (httpx.ProxyError("proxy"), {Failure.PROTOCOL}),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "")
async def test_transport_errors_map_to_failures(exc: httpx.TransportError,
                                                expected: set[Failure]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    answer, _ = await call(handler)
    assert answer.status is None
    assert answer.failure in expected
    outcome = classify(answer, absent_means_deleted=False, now=_now()).outcome
    assert outcome is (Outcome.TRANSIENT if expected == NOT_SENT else
                       Outcome.PERMANENT if expected == {Failure.INVALID_REQUEST} else
                       Outcome.UNKNOWN)


@pytest.mark.parametrize(("exc", "failure"), [
    (httpx.ReadError("reset mid-body"), Failure.RESET_AFTER_SEND),
    (httpx.RemoteProtocolError("peer closed"), Failure.RESET_AFTER_SEND),
    (httpx.ReadTimeout("stalled chunk"), Failure.TIMEOUT_AFTER_SEND),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "")
async def test_a_failure_mid_body_is_after_send(exc: httpx.TransportError,
                                                failure: Failure) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"partial"
        raise exc

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    answer, _ = await call(handler)
    assert answer == Answer(failure=failure)


# -- the body cap and the overall deadline -------------------------------------------------

@pytest.mark.parametrize(("wanted", "cap", "body"), [
    (True, 16, b'{"ok": true}'),  # read whole
    (True, 4, None),  # over its cap: never read in part
    (False, 16, None),  # drained unread
])
async def test_a_response_already_in_memory_is_read_as_a_streamed_one(
        wanted: bool, cap: int, body: bytes | None) -> None:
    """httpx.Response(content=bytes) is read when it is built; the client reads its stream
    again like any other (no path of its own for in-memory answers)."""
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=b'{"ok": true}'))
    request = httpx.Request("DELETE", "http://shop.example/carts/1")
    answer = await send(transport, request, 1.0, lambda status: wanted, cap)
    assert answer == Answer(status=200, body=body)


@pytest.mark.parametrize("chunk", [1, 512, 1024, 4095, 4096])
async def test_a_huge_body_is_not_read_past_the_cap(chunk: int) -> None:
    pulled = 0
    total = 10 * 1024 * 1024

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(total // chunk):
            pulled += chunk
            yield b"x" * chunk

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    answer, _ = await call(handler)
    assert answer == Answer(status=200)
    assert BODY_CAP_BYTES <= pulled <= BODY_CAP_BYTES + chunk


async def test_a_small_body_is_read_to_the_end() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return streamed(404, body=b'{"error": "not found"}')

    answer, _ = await call(handler)
    assert answer == Answer(status=404)


async def _forever() -> AsyncIterator[bytes]:
    yield b"{"
    await asyncio.sleep(3600)
    yield b"}"


async def _drip() -> AsyncIterator[bytes]:
    while True:
        yield b" "
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("body", [_forever, _drip], ids=["stalls", "drips"])
async def test_the_overall_deadline_ends_a_stalled_body(
        body: Callable[[], AsyncIterator[bytes]]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    started = time.monotonic()
    answer, latency_ms = await call(handler, timeout=0.3)
    elapsed = time.monotonic() - started
    assert answer == Answer(failure=Failure.TIMEOUT_AFTER_SEND)
    assert 0.25 <= elapsed < 1.5
    assert 250 <= latency_ms < 1500
    assert classify(answer, absent_means_deleted=True, now=_now()).outcome is Outcome.UNKNOWN


async def test_the_overall_deadline_ends_a_hung_response() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3600)
        return streamed(204)

    started = time.monotonic()
    answer, _ = await call(handler, timeout=0.3)
    assert answer == Answer(failure=Failure.TIMEOUT_AFTER_SEND)
    assert 0.25 <= time.monotonic() - started < 1.5


async def test_upstreams_aclose_closes_every_transport() -> None:
    closed: list[str] = []

    class Transport(httpx.MockTransport):
        async def aclose(self) -> None:
            closed.append("x")

    policies = make_policies()
    ups = Upstreams(policies.upstreams, transport=Transport(lambda r: streamed(204)))
    assert ups.for_policy(policies.policies["carts"]) is not ups.for_policy(
        policies.policies["exports"])
    await ups.aclose()
    assert len(closed) == 2  # one client per upstream, each closed


@given(st.lists(st.text(max_size=12), min_size=1, max_size=4),
       st.sampled_from(["https://shop.example.com/api", "http://127.0.0.1:8080",
                        "http://other.example:8080/v1/"]))
def test_url_maker_builds_what_httpx_parses(ids: list[str], base: str) -> None:
    """The URL maker yields exactly the URL httpx makes of the base and the path."""
    from service.upstreams.request_urls import UrlMaker

    path = "/x/" + "/".join(render_path("{object_id}", tenant_id="t", object_id=i)
                            if i not in (".", "..") else "dot" for i in ids)
    parsed = httpx.URL(base + path)
    made, target = UrlMaker(base).url(path)
    assert target is None
    assert made == parsed and str(made) == str(parsed) and made.raw_path == parsed.raw_path
    # for our transport: the origin's URL and the target, byte for byte what httpx parses
    origin, target = UrlMaker(base, target=True).url(path)
    assert (origin.scheme, origin.netloc) == (parsed.scheme, parsed.netloc)
    assert (target if target is not None else origin.raw_path) == parsed.raw_path


@pytest.mark.parametrize("method", ["DELETE", "POST", "PUT", "PATCH"])
async def test_requests_match_what_httpx_builds_itself(method: str) -> None:
    """The prebuilt headers and empty body give the request httpx.Request would build."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return streamed(204)

    policies = make_policies(method=method, headers={"Authorization": "SHOP_AUTH",
                                                     "User-Agent": "SHOP_TENANT_HEADER"})
    ups = Upstreams(policies.upstreams, transport=httpx.MockTransport(answer))
    await ups.for_policy(policies.policies["carts"]).delete(
        policies.policies["carts"], tenant_id="t 1", object_id="a/b", operation_key=KEY)
    [sent] = seen
    plain = httpx.Request(method, "https://shop.example.com/api/tenants/t%201/carts/a%2Fb",
                          headers={"User-Agent": "acme-header",
                                   "Authorization": "Bearer s3cret-token",
                                   "Idempotency-Key": KEY})
    assert sent.method == plain.method and sent.url == plain.url
    assert sent.headers.raw == plain.headers.raw
    assert await sent.aread() == plain.content == b""
