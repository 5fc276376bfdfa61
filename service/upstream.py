"""The HTTP client of an upstream deletion API: one pooled httpx.AsyncClient per upstream.

Transport errors are mapped here, once, to :class:`service.outcomes.Failure`:

    httpx.TransportError
    ├── ConnectError, ConnectTimeout, PoolTimeout  -> CONNECT / TIMEOUT_BEFORE_SEND (not sent)
    ├── WriteTimeout, WriteError                   -> TIMEOUT_AFTER_SEND (may have been read)
    ├── ReadTimeout, overall deadline              -> TIMEOUT_AFTER_SEND
    ├── ReadError, RemoteProtocolError             -> RESET_AFTER_SEND
    └── other protocol errors                      -> PROTOCOL

Ids are percent-encoded into their own path segment, so `/`, `..`, `?`, `#` or unicode in
an id can never reach another path. Response bodies are read up to a small cap and dropped.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote, urlsplit

import anyio
import anyio.lowlevel
import httpx

from service.outcomes import Answer, Failure
from service.policies import Policy, Upstream

BODY_CAP_BYTES: Final = 4096
CONNECTIONS_PER_POOL: Final = 16  # connections per httpcore pool (see UpstreamClient)
USER_AGENT: Final = "sweeper/0.1"


_UNRESERVED: Final = re.compile(r"[A-Za-z0-9_.~-]*", re.ASCII)  # what quote() keeps as is


def _segment(value: str) -> str:
    # most ids need no escaping; quote() costs ten times the check
    return value if _UNRESERVED.fullmatch(value) else quote(value, safe="")


def render_path(template: str, *, tenant_id: str, object_id: str) -> str:
    """Fill a path template; every value becomes exactly one percent-encoded segment."""
    if object_id in (".", "..") or tenant_id in (".", ".."):
        raise ValueError("dot segments cannot be an id")
    return template.format(object_id=_segment(object_id), tenant_id=_segment(tenant_id))


# A path httpx would take exactly as it is: ASCII path characters and valid percent escapes
# (no `?`, `#`, spaces or unicode to encode), and no dot segment to normalise away.
_PLAIN_PATH: Final = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*")
_PROBE_PATH: Final = "/probe/a%2Fb/c-d_e~f"


class UrlMaker:
    """Request URLs under one base URL, without parsing each one.

    Parsing a URL string (httpx validates and normalises every character) was the largest
    single cost per call in the drain benchmark. A rendered path is already percent-encoded,
    so for plain paths the parsed base URL is reused with only its path replaced. That uses
    httpx's parsed form (`URL._uri_reference`), which is not public API: the shortcut is
    checked against a real parse once, at construction, and any other path, or an httpx
    whose internals differ, takes the ordinary parse."""

    def __init__(self, base_url: str) -> None:
        self._base_url = base_url
        self._base_path = urlsplit(base_url).path
        self._fast = False
        try:
            self._reference = httpx.URL(base_url)._uri_reference
            made = self.url(_PROBE_PATH, fast=True)
            parsed = httpx.URL(base_url + _PROBE_PATH)
            self._fast = (made == parsed and made.raw_path == parsed.raw_path
                          and str(made) == str(parsed))
        except Exception:  # httpx changed shape: parse every URL, as httpx intends
            self._fast = False

    def url(self, path: str, *, fast: bool | None = None) -> httpx.URL:
        """The URL of `path` (already rendered and percent-encoded) under the base URL."""
        if (self._fast if fast is None else fast) and _PLAIN_PATH.fullmatch(path) and (
                "/." not in path):
            url = httpx.URL.__new__(httpx.URL)
            url._uri_reference = self._reference._replace(path=self._base_path + path)
            return url
        return httpx.URL(self._base_url + path)


@dataclass(frozen=True)
class CallResult:
    """What happened on the wire, and how long it took."""

    answer: Answer
    latency_ms: float


class UpstreamClient:
    """Calls one upstream with an overall deadline per call (httpx's read timeout is per
    chunk: a dripping upstream must not hold a lease forever)."""

    def __init__(self, upstream: Upstream, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        cfg = upstream.config
        self.deadline_seconds = cfg.timeout_seconds
        # The pooled transport is driven directly: httpx.AsyncClient's per-request URL
        # merging and cookie handling were 44% of a worker's CPU per call (profiled in
        # bench/drain.py), and a deletion call needs neither cookies nor redirects.
        if transport is not None:
            self._transports: list[httpx.AsyncBaseTransport] = [transport]
        else:
            # httpcore's pool walks every connection of the pool (a readability syscall
            # each) whenever a request arrives or an answer ends: with 100-256 connections
            # that was 1.5 ms of CPU per call on loopback. Several small pools, each call
            # on the least busy, keep that walk short; together they hold at most
            # max_connections.
            shards = math.ceil(cfg.max_connections / CONNECTIONS_PER_POOL)
            sizes = [cfg.max_connections // shards + (1 if i < cfg.max_connections % shards
                                                      else 0) for i in range(shards)]
            self._transports = [httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                retries=0) for n in sizes]
        self._busy = [0] * len(self._transports)
        self._urls = UrlMaker(cfg.base_url)
        self._headers = httpx.Headers({"User-Agent": USER_AGENT, **upstream.headers})
        self._host = httpx.URL(cfg.base_url).netloc
        self._headers_for: dict[str, httpx.Headers] = {}
        connect = min(5.0, cfg.timeout_seconds)
        self._timeouts = {"connect": connect, "read": cfg.timeout_seconds,
                          "write": cfg.timeout_seconds, "pool": cfg.timeout_seconds}

    async def delete(self, policy: Policy, *, tenant_id: str, object_id: str,
                     operation_key: str) -> CallResult:
        """One deletion call carrying the operation key as Idempotency-Key."""
        started = time.perf_counter()
        answer = await self._call(policy, tenant_id, object_id, operation_key)
        return CallResult(answer, (time.perf_counter() - started) * 1000)

    async def _call(self, policy: Policy, tenant_id: str, object_id: str,
                    operation_key: str) -> Answer:
        try:
            path = render_path(policy.config.path, tenant_id=tenant_id, object_id=object_id)
        except (ValueError, KeyError):
            return Answer(failure=Failure.INVALID_REQUEST)
        method = policy.config.method
        headers = httpx.Headers(self._headers_for.get(method) or self._prepare(method))
        headers["Idempotency-Key"] = operation_key
        request = httpx.Request(method, self._urls.url(path), headers=headers,
                                stream=_NO_BODY, extensions={"timeout": self._timeouts})
        busy = self._busy
        shard = busy.index(min(busy)) if len(busy) > 1 else 0
        busy[shard] += 1
        try:
            async with asyncio.timeout(self.deadline_seconds):
                response = await self._transports[shard].handle_async_request(request)
                try:
                    await _drain_capped(response)
                finally:
                    await response.aclose()
        except TimeoutError:
            return Answer(failure=Failure.TIMEOUT_AFTER_SEND)
        except httpx.ConnectError:
            return Answer(failure=Failure.CONNECT)
        except (httpx.ConnectTimeout, httpx.PoolTimeout):
            return Answer(failure=Failure.TIMEOUT_BEFORE_SEND)
        except (httpx.WriteTimeout, httpx.WriteError, httpx.ReadTimeout):
            return Answer(failure=Failure.TIMEOUT_AFTER_SEND)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            return Answer(failure=Failure.RESET_AFTER_SEND)
        except httpx.TransportError:
            return Answer(failure=Failure.PROTOCOL)
        finally:
            busy[shard] -= 1
        limits = {k: v for k, v in response.headers.items() if "ratelimit" in k}
        return Answer(status=response.status_code,
                      retry_after=response.headers.get("retry-after"),
                      rate_limits=limits or None)

    def _prepare(self, method: str) -> httpx.Headers:
        """The headers httpx.Request adds to a bodiless request of `method` (Host, and
        Content-Length: 0 where the method expects a body), in its order, before ours:
        built once per method, each call copies them (a list copy) and adds its key, and
        the request carries an explicit empty body, which skips httpx's per-request
        preparation of the same headers."""
        auto: list[tuple[bytes, bytes]] = []
        if "Host" not in self._headers:
            auto.append((b"Host", self._host))
        if method.upper() in _LENGTH_REQUIRED and not (
                "Content-Length" in self._headers or "Transfer-Encoding" in self._headers):
            auto.append((b"Content-Length", b"0"))
        headers = self._headers_for[method] = httpx.Headers([*auto, *self._headers.raw])
        return headers

    async def aclose(self) -> None:
        for transport in self._transports:
            await transport.aclose()


_NO_BODY: Final = httpx.ByteStream(b"")  # immutable: one instance serves every call
_LENGTH_REQUIRED: Final = frozenset({"POST", "PUT", "PATCH"})


async def _drain_capped(response: httpx.Response) -> None:
    """Read at most BODY_CAP_BYTES of the body so the connection can be reused, no more.
    The transport's stream is read directly (aiter_raw's chunker and byte counting cost
    more than the reading); closing the response afterwards releases the connection."""
    if response.is_stream_consumed:  # an in-memory response (tests, the demo store)
        return
    stream = response.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise RuntimeError("an async transport answered with a sync stream")
    seen = 0
    async for chunk in stream:
        seen += len(chunk)
        if seen >= BODY_CAP_BYTES:
            break


class Upstreams:
    """One client per upstream, built from the policies file, closed together."""

    def __init__(self, upstreams: Mapping[str, Upstream],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._clients = {name: UpstreamClient(up, transport) for name, up in upstreams.items()}

    def for_policy(self, policy: Policy) -> UpstreamClient:
        return self._clients[policy.config.upstream]

    async def warm_up(self) -> None:
        """Load what the first call would otherwise load lazily: httpcore picks its async
        backend (anyio's asyncio backend, an import) on its first request, 15-100 ms on a
        busy machine, so each new replica's first calls left late and bunched with the next
        tokens at the upstream (measured in drill 12). No request is sent."""
        await anyio.lowlevel.checkpoint()
        anyio.Event()
        anyio.Lock()

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
