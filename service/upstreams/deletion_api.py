"""The HTTP client of an upstream deletion API: one connection pool per upstream, driven
through httpx's transport interface (service/protocols/transport.py).

Each call is one exchange (service/upstreams/exchange.py: the overall deadline, the answer
read, every transport error mapped once to a Failure). Its URL comes from `UrlMaker`
(service/upstreams/request_urls.py).

What a call sends is the policy's compiled request template (service/config/request_templates.py):
ids are percent-encoded into their own path segment or query value, so `/`, `..`, `?`, `#` or
unicode in an id can never reach another path; a templated host is checked against the
upstream's host_pattern on every call; a JSON body carries ids as JSON strings. Response
bodies are read up to a small cap and dropped, except where the policy's answer rules read
them (service/config/answer_rules.py): then whole, up to the policy's answer_max_bytes.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import Final

import httpx

from service.config.policies import Policy, Upstream
from service.config.request_templates import RequestTemplate
from service.observability import tracing
from service.observability.metrics import UPSTREAM_DISTRUSTED
from service.outcomes import Answer, Classified, Failure
from service.protocols.transport import SEND_BY, SEND_GATE, TARGET, Http1Transport, SendGate
from service.upstreams.exchange import SUCCESS_STATUSES, send
from service.upstreams.request_urls import PROBE_HOST, UrlMaker
from service.values import value

USER_AGENT: Final = "sweeper/0.1"
JSON_CONTENT_TYPE: Final = "application/json"


@value
class CallResult:
    """What happened on the wire, and how long it took. A store target's statement
    (service/sweeps/store_targets.py) reads its own result: `verdict` is its outcome when the
    statement ran, `skipped` the objects whose row no longer matched its predicate, and `rows` the
    rows it spent from a budget in rows; `verdicts` the objects whose outcome is their own."""

    answer: Answer
    latency_ms: float
    verdict: Classified | None = None
    skipped: frozenset[str] = frozenset()
    rows: int | None = None
    # objects whose own outcome differs from the call's (a store statement split to let
    # one bad row fail alone: service/sweeps/store_targets.py)
    verdicts: Mapping[str, Classified] = field(default_factory=dict)


class UpstreamClient:
    """Calls one upstream with an overall deadline per call (httpx's read timeout is per
    chunk: a dripping upstream must not hold a lease forever)."""

    def __init__(self, upstream: Upstream, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        cfg = upstream.config
        self.deadline_seconds = cfg.timeout_seconds
        # The transport is driven directly: a deletion call needs neither httpx.AsyncClient's
        # per-request URL merging nor its cookies, which cost CPU on every call
        # (bench/reports/design-notes.md, "The wire").
        self._transport: httpx.AsyncBaseTransport = transport or Http1Transport(
            cfg.max_connections, upstream.tls, keep_alive=cfg.keep_alive,
            distrusted=lambda reason: UPSTREAM_DISTRUSTED.labels(upstream.name, reason).inc(),
            proxy=upstream.proxy, public_only=upstream.public_only,
            max_per_host=cfg.max_connections_per_host)
        self._echo = cfg.echo_header
        # the policies' paths hold the base path: the URL maker has the origin alone
        origin = upstream.origin
        base = origin.base(origin.host or PROBE_HOST)
        self._urls = UrlMaker(base, target=isinstance(self._transport, Http1Transport))
        self._headers = httpx.Headers({"User-Agent": USER_AGENT, **upstream.headers})
        url = httpx.URL(base)
        if url.userinfo and "Authorization" not in self._headers:
            # a base_url's user:password@ is Basic credentials, as HTTP clients take it
            pair = f"{url.username}:{url.password}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
        self._credential_headers = dict(upstream.credential_headers)
        self._host = url.netloc
        self._headers_for: dict[str, httpx.Headers] = {}
        self._templated_for: dict[tuple[str, bool], list[tuple[bytes, bytes]]] = {}
        connect = min(5.0, cfg.timeout_seconds)
        self._timeouts = {"connect": connect, "read": cfg.timeout_seconds,
                          "write": cfg.timeout_seconds, "pool": cfg.timeout_seconds}

    async def delete(self, policy: Policy, *, tenant_id: str, object_id: str,
                     operation_key: str, object_version: str | None = None,
                     credential: str | None = None, object_ids: Sequence[str] = (),
                     send_by: float | None = None, gate: SendGate | None = None
                     ) -> CallResult:
        """One deletion call carrying the operation key as Idempotency-Key; the object's
        version is the one a conflict named, else the policy's initial one; `credential` is
        the tenant's, for an upstream whose headers use one; `object_ids` a batch's
        objects, for a policy sending many per call. Not written at all past `send_by`
        (time.monotonic()) or when `gate()` says no at the write (SENT_TOO_LATE, WITHHELD)."""
        started = time.perf_counter()
        version = policy.config.initial_object_version if object_version is None \
            else object_version
        if self._credential_headers and credential is None:
            answer = Answer(failure=Failure.NO_CREDENTIAL)
        else:
            answer = await self._call(policy, tenant_id, object_id, operation_key, version,
                                      credential, object_ids,
                                      self._extensions(send_by, gate))
        return CallResult(answer, (time.perf_counter() - started) * 1000)

    async def _call(self, policy: Policy, tenant_id: str, object_id: str,
                    operation_key: str, object_version: str, credential: str | None,
                    object_ids: Sequence[str], extensions: dict[str, object]) -> Answer:
        template = policy.request
        method = policy.config.method
        if template is None:  # a store target's policy: no HTTP call to make
            return Answer(failure=Failure.INVALID_REQUEST)
        try:
            path, query = template.target(tenant_id, object_id, object_version, object_ids)
            if template.host_format is None and template.body_pieces is None:
                # the common call: fixed host, no body (headers prepared once per method)
                headers = httpx.Headers(self._headers_for.get(method) or self._prepare(method))
                headers["Idempotency-Key"] = operation_key
                if credential is not None:
                    self._with_credential(headers, credential)
                url, target = self._urls.url(path, query=query)
                request = httpx.Request(method, url, headers=headers, stream=_NO_BODY,
                                        extensions=_targeted(extensions, target))
            else:
                request = self._request(template, method, tenant_id, object_id, path, query,
                                        operation_key, object_version, object_ids, extensions)
                if credential is not None:
                    self._with_credential(request.headers, credential)
        except (ValueError, KeyError, httpx.InvalidURL):
            return Answer(failure=Failure.INVALID_REQUEST)
        echo = self._echoed(request)
        if policy.config.tracing.send_traceparent:
            tracing.inject(request.headers)
        rules = policy.answers
        return await send(self._transport, request, self.deadline_seconds, rules.wants_body,
                          rules.max_bytes, echo=echo)

    async def confirm(self, policy: Policy, *, tenant_id: str, object_id: str,
                      object_version: str | None = None, credential: str | None = None,
                      send_by: float | None = None, gate: SendGate | None = None
                      ) -> CallResult:
        """The policy's confirmation read of one object (its `confirm`): a GET of its path
        with the upstream's headers and the tenant's credential, no Idempotency-Key (it
        changes nothing), the body drained unread. With the upstream's echo_header, an
        answer that could confirm or refute (an `absent` status, a 2xx) counts only with
        this request's value echoed. `send_by` and `gate` as for `delete`."""
        started = time.perf_counter()
        template, confirm = policy.confirm_request, policy.config.confirm
        if template is None or confirm is None:
            answer = Answer(failure=Failure.INVALID_REQUEST)
        elif self._credential_headers and credential is None:
            answer = Answer(failure=Failure.NO_CREDENTIAL)
        else:
            answer = await self._read(template, confirm.method, tenant_id, object_id,
                                      object_version or policy.config.initial_object_version,
                                      credential, frozenset(confirm.absent),
                                      self._extensions(send_by, gate),
                                      traced=policy.config.tracing.send_traceparent)
        return CallResult(answer, (time.perf_counter() - started) * 1000)

    async def _read(self, template: RequestTemplate, method: str, tenant_id: str,
                    object_id: str, object_version: str, credential: str | None,
                    absent: frozenset[int], extensions: dict[str, object], *,
                    traced: bool = False) -> Answer:
        try:
            path, query = template.target(tenant_id, object_id, object_version)
            host = None if template.host_format is None else template.host(tenant_id,
                                                                            object_id)
            url, target = self._urls.url(path, query=query, host=host)
            if host is None:
                headers = httpx.Headers(self._headers_for.get(method) or self._prepare(method))
            else:
                raw = [*(self._templated_for.get((method, False))
                         or self._prepare_templated(method, False))]
                if "Host" not in self._headers:
                    raw.insert(0, (b"Host", url.netloc))
                headers = httpx.Headers(raw)
            if credential is not None:
                self._with_credential(headers, credential)
            request = httpx.Request(method, url, headers=headers, stream=_NO_BODY,
                                    extensions=_targeted(extensions, target))
        except (ValueError, KeyError, httpx.InvalidURL):
            return Answer(failure=Failure.INVALID_REQUEST)
        echo = self._echoed(request)
        if traced:
            tracing.inject(request.headers)
        return await send(self._transport, request, self.deadline_seconds, _no_body, 0,
                          echo=echo, echoed=absent | SUCCESS_STATUSES)

    async def read_page(self, method: str, url: str, body: bytes | None, *,
                    credential: str | None, wants_body: Callable[[int], bool], cap: int
                    ) -> Answer:
        """A call that deletes nothing (a list source's page, service/sweeps/list_pages.py): the
        upstream's headers and the tenant's credential, no Idempotency-Key, a JSON body if
        any; its body read where `wants_body(status)`, up to `cap` bytes. ValueError (not
        sent) for a URL or credential httpx refuses."""
        if self._credential_headers and credential is None:
            return Answer(failure=Failure.NO_CREDENTIAL)
        headers = httpx.Headers({**self._headers, "Accept": JSON_CONTENT_TYPE})
        if body is not None and "Content-Type" not in headers:
            headers["Content-Type"] = JSON_CONTENT_TYPE
        if credential is not None:
            self._with_credential(headers, credential)
        try:
            request = httpx.Request(method, url, headers=headers, content=body,
                                    extensions={"timeout": self._timeouts})
        except (ValueError, httpx.InvalidURL):
            return Answer(failure=Failure.INVALID_REQUEST)
        return await send(self._transport, request, self.deadline_seconds, wants_body, cap)

    def _request(self, template: RequestTemplate, method: str, tenant_id: str, object_id: str,
                 path: str,
                 query: str | None, operation_key: str, object_version: str,
                 object_ids: Sequence[str], extensions: dict[str, object]) -> httpx.Request:
        """A call with a templated host or a JSON body: the headers httpx.Request would build
        (Host, the body's Content-Type and Content-Length), prepared once per method as for
        the common call. ValueError for a host the upstream refuses: checked here again, on
        every call, whatever registration checked."""
        host = None if template.host_format is None else template.host(tenant_id, object_id)
        body = template.body(tenant_id, object_id, object_version, object_ids)
        url, target = self._urls.url(path, query=query, host=host)
        prepared = (self._templated_for.get((method, body is not None))
                    or self._prepare_templated(method, body is not None))
        raw = [*prepared]
        if host is not None and "Host" not in self._headers:
            raw.insert(0, (b"Host", url.netloc))
        if body is not None:
            raw.append((b"Content-Length", str(len(body)).encode("ascii")))
        headers = httpx.Headers(raw)
        headers["Idempotency-Key"] = operation_key
        return httpx.Request(method, url, headers=headers,
                             stream=_NO_BODY if body is None else httpx.ByteStream(body),
                             extensions=_targeted(extensions, target))

    def _echoed(self, request: httpx.Request) -> tuple[str, str] | None:
        """For an upstream with an echo_header: a fresh value in it, and (header, value) for
        `send` to check the answer against; else None."""
        if self._echo is None:
            return None
        value = uuid.uuid4().hex
        request.headers[self._echo] = value
        return self._echo, value

    def _extensions(self, send_by: float | None, gate: SendGate | None) -> dict[str, object]:
        """A call's request extensions (what the transport reads of it besides the request
        itself): its timeouts, and the moment and the gate its write must pass."""
        extensions: dict[str, object] = {"timeout": self._timeouts}
        if send_by is not None:
            extensions[SEND_BY] = send_by
        if gate is not None:
            extensions[SEND_GATE] = gate
        return extensions

    def _with_credential(self, headers: httpx.Headers, credential: str) -> None:
        """The tenant's credential in its headers. httpx refuses a value it cannot send
        (ValueError, UnicodeEncodeError): the sources only hand out ones it can."""
        for name, (before, after) in self._credential_headers.items():
            headers[name] = before + credential + after

    def _base_headers(self, method: str, body: bool) -> list[tuple[bytes, bytes]]:
        """The headers httpx.Request adds, in its order, before ours: the Host of a fixed
        host (a templated one is each call's) and Content-Length: 0 where the method expects
        a body and there is none; then ours, and a JSON body's Content-Type (unless
        headers_from_env sets one)."""
        auto: list[tuple[bytes, bytes]] = []
        if "Host" not in self._headers and self._urls.fixed_host:
            auto.append((b"Host", self._host))
        if not body and method.upper() in _LENGTH_REQUIRED and not (
                "Content-Length" in self._headers or "Transfer-Encoding" in self._headers):
            auto.append((b"Content-Length", b"0"))
        ours = list(self._headers.raw)
        if body and "Content-Type" not in self._headers:
            ours.append((b"Content-Type", JSON_CONTENT_TYPE.encode("ascii")))
        return [*auto, *ours]

    def _prepare_templated(self, method: str, body: bool) -> list[tuple[bytes, bytes]]:
        """`_base_headers` for `_request`, built once per method and body."""
        prepared = self._templated_for[method, body] = self._base_headers(method, body)
        return prepared

    def _prepare(self, method: str) -> httpx.Headers:
        """The headers of a bodiless call to the fixed host: built once per method, each call
        copies them (a list copy) and adds its key, and the request carries an explicit
        empty body, which skips httpx's per-request preparation of the same headers
        (bench/reports/design-notes.md, "The wire")."""
        headers = self._headers_for[method] = httpx.Headers(self._base_headers(method, False))
        return headers

    async def aclose(self) -> None:
        await self._transport.aclose()


_NO_BODY: Final = httpx.ByteStream(b"")  # immutable: one instance serves every call
_LENGTH_REQUIRED: Final = frozenset({"POST", "PUT", "PATCH"})


def _targeted(extensions: dict[str, object], target: bytes | None) -> dict[str, object]:
    """A call's extensions with its request-target, where its URL is its origin's
    (UrlMaker); the dict is the call's own."""
    if target is not None:
        extensions[TARGET] = target
    return extensions


def _no_body(status: int) -> bool:
    """A read's `wants_body`: no body is read, whatever the status."""
    return False


class Upstreams:
    """One client per upstream, built from the policies file, closed together."""

    def __init__(self, upstreams: Mapping[str, Upstream],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._clients = {name: UpstreamClient(up, transport) for name, up in upstreams.items()}

    def for_policy(self, policy: Policy) -> UpstreamClient:
        return self._clients[policy.target_name]

    def client(self, upstream: str) -> UpstreamClient:
        """The client of the upstream named `upstream`."""
        return self._clients[upstream]

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
