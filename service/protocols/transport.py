"""The wire under an upstream's client: a pool of HTTP/1.1 keep-alive connections
(`Http1Transport`) under httpx's transport interface. Each connection is one
http1_connection.Connection (asyncio's Protocol, answers parsed by httptools); a request is
taken as http1_requests.py says (the extensions it carries, its bytes on the wire).

UpstreamClient (service/upstreams/deletion_api.py) builds httpx.Requests and reads
httpx.Responses, so its unit tests plug in httpx.MockTransport; real calls go through this
transport. A deletion call is one small request and one short answer on a kept-alive
connection: written as one buffer and parsed as its bytes arrive, with no reader, task or
timer in between (why: bench/reports/design-notes.md, "The wire").

Failures are raised as httpx's exceptions, so service/upstreams/exchange.py classifies them
once, by what the upstream may have seen:

    not sent                  no connection free within `pool`            -> PoolTimeout
                              not connected within `connect`              -> ConnectTimeout
                              refused, unreachable, DNS, TLS handshake    -> ConnectError
                              a header that would split the request       -> LocalProtocolError
                              its SEND_BY moment passed before the write  -> SentTooLate
                              its SEND_GATE said no at the write          -> Withheld
                              (a wait for a free connection ends there)
    sent, answer incomplete   no byte of it for `read` seconds            -> ReadTimeout
                              closed before its end, or not HTTP          -> RemoteProtocolError
                              its head still incomplete after 64 KiB      -> RemoteProtocolError
                              reset, or another socket error              -> ReadError

A request is never sent twice. A pooled connection that the upstream closes just as it is
reused fails its call as sent (the request may have been read); the ledger decides the rest.

An answer is pinned on a request only where it cannot belong to another: a connection is
reused only after a complete 2xx answer with nothing after it. One that says anything out
of turn (bytes while idle, or before the request on a new connection, a second answer, a
status below 100) is closed, and its host is distrusted for DISTRUST_SECONDS: each request
goes on a new connection with `Connection: close`, as with `keep_alive=False`. Bytes after
an answer that is still being read make that answer a RemoteProtocolError: which of the two
belonged to the request cannot be known. What no client can tell is an unrequested answer
that arrives after a request was written on a new connection (the upstream's own fault);
an upstream that echoes a request id closes that gap (service/upstreams/exchange.py).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

import httpx

from service.protocols.egress import (
    Proxy,
    ProxyChoice,
    environment_proxy,
    open_connection,
    public_roots,
)
from service.protocols.http1_connection import (
    KEEPALIVE_SECONDS,
    AnswerBody,
    Connection,
    Distrust,
    Key,
)
from service.protocols.http1_requests import (
    SEND_BY,
    SEND_GATE,
    TARGET,
    SendGate,
    absolute_form,
    closing,
    request_target,
    serialized,
)

__all__ = ["SEND_BY", "SEND_GATE", "TARGET", "Http1Transport", "SendGate", "SentTooLate",
           "Withheld", "refuse_unsendable"]

_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_NO_TIMEOUTS: Final[Mapping[str, float | None]] = {}
_UNROUTED: Final = Proxy("", 0)  # no proxy chosen yet for a host
# A new connection waits about a round trip before its first request, within these bounds.
FRESH_WAIT_MIN_S: Final = 0.001
FRESH_WAIT_MAX_S: Final = 0.01
# How long a host that said something out of turn gets a new connection per request.
DISTRUST_SECONDS: Final = 60.0


class SentTooLate(httpx.TransportError):
    """Not sent: the request's SEND_BY moment passed before it could be written."""


class Withheld(httpx.TransportError):
    """Not sent: the request's SEND_GATE said no just before it would have been written."""


def refuse_unsendable(extensions: Mapping[str, Any]) -> None:
    """The last step before a request is written: SentTooLate once its SEND_BY moment has
    passed, Withheld when its SEND_GATE says no (the gate marks it started otherwise)."""
    send_by: float | None = extensions.get(SEND_BY)
    if send_by is not None and time.monotonic() > send_by:
        raise SentTooLate("the request's moment passed before it could be written")
    gate: SendGate | None = extensions.get(SEND_GATE)
    if gate is not None and not gate():
        raise Withheld("the request was withheld just before it was written")


class Http1Transport(httpx.AsyncBaseTransport):
    """A pool of at most `max_connections` open connections over every host, reused for
    `KEEPALIVE_SECONDS` after their last answer (never, with `keep_alive=False`). Requests
    beyond it wait for one (httpx's `pool` timeout); a host with none idle may close another
    host's idle one to open its own. `distrusted(reason)` is told of each connection closed
    for saying something out of turn."""

    def __init__(self, max_connections: int, ssl_context: ssl.SSLContext | None = None, *,
                 keep_alive: bool = True,
                 distrusted: Callable[[Distrust], None] | None = None,
                 proxy: ProxyChoice = environment_proxy, public_only: bool = False,
                 max_per_host: int | None = None) -> None:
        if max_connections < 1 or (max_per_host is not None and max_per_host < 1):
            raise ValueError("max_connections and max_per_host must be at least 1")
        self._max = max_connections
        self._max_per_host = max_connections if max_per_host is None else max_per_host
        self._per_host: collections.Counter[Key] = collections.Counter()
        self._proxy = proxy  # how connections leave (service/protocols/egress.py), chosen per host
        self._routes: dict[Key, Proxy | None] = {}
        self._public_only = public_only  # a templated host: global addresses only
        self._keep_alive = keep_alive
        self._distrusted = distrusted
        self._distrust_until: dict[Key, float] = {}
        # httpx's roots: the same certificates verify as through httpx
        self._ssl = ssl_context or public_roots()
        self._idle: dict[Key, list[Connection]] = {}
        self._open = 0  # connections open or opening; never above _max
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._swept_at = 0.0
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        extensions = request.extensions
        timeouts = extensions.get("timeout", _NO_TIMEOUTS)
        send_by: float | None = extensions.get(SEND_BY)
        data = await serialized(request)  # refused before any connection is taken
        url = request.url
        scheme = url.scheme
        if scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"{scheme!r} is not http or https")
        key = (scheme, url.raw_host.decode("ascii"), url.port or _DEFAULT_PORTS[scheme])
        proxy = self._routes.get(key, _UNROUTED)
        if proxy is _UNROUTED:  # chosen when a host is first reached (the environment is
            proxy = self._routes[key] = self._proxy(scheme, key[1])  # read then, not per call)
        if proxy is not None and scheme == "http":  # the proxy takes it in absolute form
            data = absolute_form(data, url, request_target(request), proxy)
        reuse = self._keep_alive and not self._distrusting(key)
        if not reuse:  # one request per connection, and the upstream is told so
            data = closing(data)
        conn = (self._pooled(key) if reuse else None) or await self._opened(
            key, timeouts, proxy, send_by)
        read_timeout = timeouts.get("read")
        try:
            refuse_unsendable(extensions)
        except (SentTooLate, Withheld):
            self._unused(conn)
            raise
        try:
            conn.send(data)
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.next_event(read_timeout)
        except BaseException:  # failed or cancelled mid-answer: never pooled
            self._discard(conn)
            raise
        return httpx.Response(conn.status, headers=conn.headers, request=request,
                              stream=AnswerBody(self.release, conn, read_timeout),
                              extensions={"http_version": b"HTTP/1.1"})

    def release(self, conn: Connection) -> None:
        """A finished exchange's connection: idle for the next request, or closed."""
        if conn.end() and self._keep_alive and not self._closed \
                and not self._distrusting(conn.key):
            conn.idle_since = now = asyncio.get_running_loop().time()
            self._idle.setdefault(conn.key, []).append(conn)
            if now - self._swept_at > KEEPALIVE_SECONDS:
                self._sweep(now)
            self._wake()
        else:
            self._discard(conn)

    def _unused(self, conn: Connection) -> None:
        """A connection taken for a request that was then not written: idle again as it
        was (its keep-alive clock not restarted), or closed."""
        if conn.alive and not self._closed and not conn.exchanging and self._keep_alive \
                and not self._distrusting(conn.key):
            self._idle.setdefault(conn.key, []).insert(0, conn)
            self._wake()
        else:
            self._discard(conn)

    def _distrusting(self, key: Key) -> bool:
        until = self._distrust_until.get(key)
        if until is None:
            return False
        if asyncio.get_running_loop().time() < until:
            return True
        del self._distrust_until[key]
        return False

    def distrust(self, url: httpx.URL, reason: Distrust) -> None:
        """Distrust `url`'s host as if a connection to it had said something out of turn
        (the caller found an answer that may not be its request's)."""
        scheme = url.scheme
        self._distrust((scheme, url.raw_host.decode("ascii"),
                        url.port or _DEFAULT_PORTS[scheme]), reason)

    def _note(self, conn: Connection) -> None:
        """A closed connection: if it said something out of turn, distrust its host."""
        if conn.misbehaved is not None and not conn.noted:
            conn.noted = True  # once, however many times the pool meets it
            self._distrust(conn.key, conn.misbehaved)

    def _distrust(self, key: Key, reason: Distrust) -> None:
        self._distrust_until[key] = asyncio.get_running_loop().time() + DISTRUST_SECONDS
        siblings = self._idle.pop(key, [])  # they share the fault: closed too
        closing, siblings[:] = list(siblings), []  # (a caller may be walking the list)
        for idle in closing:
            self._discard(idle)
        if self._distrusted is not None:
            self._distrusted(reason)

    async def aclose(self) -> None:
        """Close every idle connection; ones in use close when their answer is done."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                self._discard(conn)
        self._idle.clear()

    # ------------------------------------------------------------------ the pool
    def _pooled(self, key: Key) -> Connection | None:
        """The most recently used live idle connection to `key`; dead ones are closed."""
        idle = self._idle.get(key)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if conn.reusable_at(now):
                return conn
            self._discard(conn)
        return None

    async def _opened(self, key: Key, timeouts: Mapping[str, float | None],
                      proxy: Proxy | None, send_by: float | None) -> Connection:
        """A new connection to `key` once the limit allows one, or an idle one freed while
        waiting for it."""
        if not self._may_open(key):
            # a request that must be written by `send_by` waits no longer than that: past it,
            # a connection would only be taken to refuse the write
            wait, late = timeouts.get("pool"), False
            if send_by is not None:
                left = max(0.0, send_by - time.monotonic())
                if wait is None or left < wait:
                    wait, late = left, True
            try:
                async with asyncio.timeout(wait):
                    while True:
                        await self._released()
                        conn = self._pooled(key)
                        if conn is not None:
                            return conn
                        if self._may_open(key):
                            break
            except TimeoutError:
                if late:
                    raise SentTooLate("no connection free before the request's moment") from None
                raise httpx.PoolTimeout("no connection free within the pool timeout") from None
        self._open += 1
        self._per_host[key] += 1
        try:
            return await self._connect(key, timeouts.get("connect"), proxy, send_by)
        except BaseException:
            self._open -= 1
            self._closed_one(key)
            raise

    def _may_open(self, key: Key) -> bool:
        """Whether a new connection to `key` fits both limits (closing another host's idle
        connection to make room, if that is all it takes)."""
        if self._per_host[key] >= self._max_per_host:
            return False
        return self._open < self._max or self._evict_idle()

    def _closed_one(self, key: Key) -> None:
        """A connection to `key` (open or opening) is gone: its places are free."""
        self._per_host[key] -= 1
        if not self._per_host[key]:
            del self._per_host[key]
        self._wake()

    def _wake(self) -> None:
        """A place or an idle connection is free: the next waiter looks again, or, with a
        limit per host, all of them (what is free may be for another host than the next's)."""
        if self._max_per_host < self._max:
            self._wake_all()
        else:
            self._wake_one()

    async def _connect(self, key: Key, within: float | None, proxy: Proxy | None,
                       send_by: float | None) -> Connection:
        scheme, host, port = key
        tls = self._ssl if scheme == "https" else None
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(within):
                conn = cast(Connection, await open_connection(
                    lambda: Connection(key, self._note), scheme, host, port, tls=tls,
                    proxy=proxy, public_only=self._public_only))
        except TimeoutError:
            raise httpx.ConnectTimeout("not connected within the connect timeout") from None
        except OSError as exc:  # refused, unreachable, DNS, and ssl.SSLError: never sent
            raise httpx.ConnectError(type(exc).__name__) from exc
        conn.idle_since = now = loop.time()
        # An answer an upstream writes on accept arrives about one round trip (what the
        # connect took) after the connection is made, with the request if it went at once:
        # wait that long (bounded) before writing, then two turns of the loop so what
        # arrived is read (the first queues its callback). Only new connections pay it
        # (its cost: bench/reports/design-notes.md, "The wire").
        wait = min(max(now - started, FRESH_WAIT_MIN_S), FRESH_WAIT_MAX_S)
        if send_by is not None:  # never at the cost of the request's own moment
            wait = min(wait, max(0.0, send_by - time.monotonic() - FRESH_WAIT_MIN_S))
        await asyncio.sleep(wait)
        for _ in range(2):
            await asyncio.sleep(0)
        if not conn.alive:
            self._note(conn)
            raise httpx.ConnectError("the upstream spoke before the request, or closed")
        return conn

    async def _released(self) -> None:
        """Wait until a connection is handed back or closed."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken but leaving: the wake belongs to the next in line
            else:
                self._waiters.remove(waiter)
            raise

    def _wake_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _discard(self, conn: Connection) -> None:
        conn.close()
        self._note(conn)
        self._open -= 1
        self._closed_one(conn.key)

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection of any host, freeing its place for a new one."""
        oldest: list[Connection] | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest[0].idle_since):
                oldest = idle
        if oldest is None:
            return False
        conn = oldest.pop(0)
        conn.close()
        self._open -= 1
        self._per_host[conn.key] -= 1
        if not self._per_host[conn.key]:
            del self._per_host[conn.key]
        self._note(conn)
        return True

    def _sweep(self, now: float) -> None:
        """Close the connections idle longer than KEEPALIVE_SECONDS, of every host."""
        self._swept_at = now
        for key, idle in list(self._idle.items()):
            live = []
            for conn in idle:
                if conn.reusable_at(now):
                    live.append(conn)
                else:
                    self._discard(conn)
            if live:
                self._idle[key] = live
            else:
                del self._idle[key]
