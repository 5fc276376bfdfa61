"""The wire under an upstream's client: httpx's transport interface over aiohttp's client.

UpstreamClient (service/upstream.py) builds httpx.Requests and reads httpx.Responses, so
tests and the demo plug in httpx.MockTransport; real calls go through this transport.
aiohttp's connection pool takes an idle connection in O(1) and its response parser is C
(llhttp), where httpcore's pool walks every connection on each request and parses in
Python: on loopback that was most of a worker's CPU per call (bench/reports/2026-12-01-http).

aiohttp's exceptions are mapped to httpx's so service/upstream.py classifies them once, by
what the upstream may have seen:

    not sent                  ConnectionTimeoutError (pool wait or connect) -> ConnectTimeout
                              ClientConnectorError (refused, DNS, TLS)       -> ConnectError
    sent, answer incomplete   SocketTimeoutError, other ServerTimeoutError   -> ReadTimeout
                              ClientConnectionResetError (while writing)     -> WriteError
                              ServerDisconnectedError, malformed answer      -> RemoteProtocolError
                              ClientPayloadError, other ClientOSError        -> ReadError
    anything else aiohttp raises                                             -> TransportError
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from typing import Final

import aiohttp
import httpx
from yarl import URL

__all__ = ["AiohttpTransport"]

KEEPALIVE_SECONDS: Final = 5.0  # as httpx's default: upstreams often close idle ones soon after
READ_CHUNK_BYTES: Final = 16_384
# aiohttp adds these unless told not to; a call sends only the headers UpstreamClient built
# (no Accept-Encoding above all: bodies are read as sent, service/upstream.py `_identity`)
_SKIP_AUTO_HEADERS: Final = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


class _Body(httpx.AsyncByteStream):
    """An aiohttp answer's body as httpx reads it; closing it hands the connection back to
    the pool when the body was read to its end, and closes it otherwise."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_chunked(READ_CHUNK_BYTES):
                yield chunk
        except aiohttp.ClientError as exc:
            raise _mapped(exc) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp connection pool of at most `max_connections`, created on the first call
    (aiohttp's session belongs to the running event loop)."""

    def __init__(self, max_connections: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self._max_connections = max_connections
        # httpx's context (certifi's roots): the same certificates verify as before
        self._ssl = ssl_context or httpx.create_ssl_context()
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple[float | None, float | None, float | None],
                             aiohttp.ClientTimeout] = {}

    def open(self) -> aiohttp.ClientSession:
        """The pool, opened on the first call unless opened before (in the running loop)."""
        if self._session is not None:
            return self._session
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                         keepalive_timeout=KEEPALIVE_SECONDS, ssl=self._ssl)
        self._session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
            skip_auto_headers=_SKIP_AUTO_HEADERS, raise_for_status=False)
        # aiohttp sends an idempotent request (DELETE) again, once, when the connection
        # fails under it: a second call without a token, and an attempt the ledger never
        # sees. There is no public switch (aio-libs/aiohttp#10790); this is the one its own
        # tests use; tests/integration/test_transport.py fails if it stops working.
        self._session._retry_connection = False
        return self._session

    def _timeout(self, request: httpx.Request) -> aiohttp.ClientTimeout:
        """httpx's per-phase timeouts as aiohttp's: `pool` bounds waiting for a connection
        and connecting, `connect` the connect alone, `read` each read. The overall deadline
        is UpstreamClient's."""
        given = request.extensions.get("timeout", {})
        key = (given.get("pool"), given.get("connect"), given.get("read"))
        timeout = self._timeouts.get(key)
        if timeout is None:
            timeout = self._timeouts[key] = aiohttp.ClientTimeout(
                total=None, connect=key[0], sock_connect=key[1], sock_read=key[2])
        return timeout

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session or self.open()
        body = await request.aread()
        try:
            # the URL is percent-encoded already (service/templates.py): yarl must not
            # re-quote it, or an id's %2F would become a path separator
            response = await session.request(
                request.method, URL(str(request.url), encoded=True),
                headers=request.headers.multi_items(), data=body or None,
                allow_redirects=False, compress=None, timeout=self._timeout(request))
        except aiohttp.ClientError as exc:
            raise _mapped(exc) from exc
        return httpx.Response(response.status, headers=response.raw_headers,
                              stream=_Body(response), request=request,
                              extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _mapped(exc: aiohttp.ClientError) -> httpx.TransportError:
    """The httpx exception that says what the upstream may have seen (module docstring).
    The message is aiohttp's class name: its text may quote the URL, which holds ids."""
    kind: type[httpx.TransportError]
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        kind = httpx.ConnectTimeout
    elif isinstance(exc, aiohttp.ServerTimeoutError):
        kind = httpx.ReadTimeout
    elif isinstance(exc, aiohttp.ClientConnectorError):
        kind = httpx.ConnectError
    elif isinstance(exc, aiohttp.ClientConnectionResetError):
        kind = httpx.WriteError
    elif isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientResponseError):
        kind = httpx.RemoteProtocolError
    elif isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientOSError):
        kind = httpx.ReadError
    else:
        kind = httpx.TransportError
    return kind(type(exc).__name__)
