"""The wire under an upstream's client: HTTP/1.1 keep-alive connections on asyncio's Protocol,
parsed by httptools (llhttp, in C), under httpx's transport interface.

UpstreamClient (service/upstreams/deletion_api.py) builds httpx.Requests and reads httpx.Responses,
so tests and the demo plug in httpx.MockTransport; real calls go through this transport. A deletion
call is one small request and one short answer on a kept-alive connection: written as one
buffer and parsed as its bytes arrive, with no reader, task or timer in between. aiohttp's
client layers around the same C parser were about 40% of a worker's CPU per loopback call
(bench/reports/2026-12-04-transport).

Failures are raised as httpx's exceptions, so service/upstreams/deletion_api.py classifies them
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
an upstream that echoes a request id closes that gap (service/upstreams/deletion_api.py).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final, cast

import httptools
import httpx

from service.protocols.egress import Proxy, ProxyChoice, environment_proxy, open_connection

__all__ = ["SEND_BY", "SEND_GATE", "TARGET", "Http1Transport", "SendGate", "SentTooLate",
           "Withheld"]

# The request extensions this transport reads besides httpx's "timeout". httpx carries a
# request's extensions with it down to the transport (`request.extensions`), the way it
# carries its timeouts: settings of one request, set by whoever builds it.
#
# TARGET: its request-target as bytes (path and query), when its URL is its origin's alone
# (service/upstreams/deletion_api.py's UrlMaker spares a parse of every call's URL).
TARGET: Final = "sweeper.target"
# SEND_BY: the time.monotonic() moment after which the request must not be written at all.
# A worker spends a rate-limit token only until a tolerance after its moment
# (service/worker/pool.py); taking a connection, or opening one, can outlast that.
SEND_BY: Final = "sweeper.send_by"
# SEND_GATE: a SendGate asked in the same step that writes the request, with nothing run
# between: False withholds it (a legal hold took the call back: service/worker/hold_gate.py).
SEND_GATE: Final = "sweeper.send_gate"
SendGate = Callable[[], bool]

# Under the 5 s idle timeout of uvicorn's and Node's servers: a connection is not reused in
# the instant its upstream closes it.
KEEPALIVE_SECONDS: Final = 4.0
# An answer's body buffered past this pauses reading until the caller takes it: a huge body
# is read as the caller reads (service/upstreams/deletion_api.py stops at its cap), never held
# whole.
HIGH_WATER_BYTES: Final = 65_536
# The bytes read while an answer's final status and headers are still incomplete (interim
# 1xx answers included): httptools gathers each header whole and has no limit of its own.
# Counted per read, so a head ending within one read (at most 256 KiB) may exceed it.
MAX_HEAD_BYTES: Final = 65_536
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_NO_TIMEOUTS: Final[Mapping[str, float | None]] = {}

_Key = tuple[str, str, int]  # scheme, host, port: the connections one request may reuse
_UNROUTED: Final = Proxy("", 0)  # no proxy chosen yet for a host
# A new connection waits about a round trip before its first request, within these bounds.
FRESH_WAIT_MIN_S: Final = 0.001
FRESH_WAIT_MAX_S: Final = 0.01
# How long a host that said something out of turn gets a new connection per request.
DISTRUST_SECONDS: Final = 60.0
# Why a connection was distrusted (the reasons counted by the `distrusted` callback).
Distrust = str


class SentTooLate(httpx.TransportError):
    """Not sent: the request's SEND_BY moment passed before it could be written."""


class Withheld(httpx.TransportError):
    """Not sent: the request's SEND_GATE said no just before it would have been written."""


class _Surplus(Exception):
    """Bytes after the answer to the one request sent."""


class _Connection(asyncio.Protocol):
    """One connection and the answer it is reading: at most one exchange at a time."""

    def __init__(self, key: _Key, misbehaved: Callable[[_Connection], None] | None = None
                 ) -> None:
        self.key = key
        self._told = misbehaved  # the pool, told at once when it says something out of turn
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.usable = True  # false once closed, or once it says anything out of turn
        self.misbehaved: Distrust | None = None  # what it said out of turn, if it did
        self.noted = False  # the pool has distrusted its host for it
        self.used = False  # it has carried a request
        self.paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._begin(exchanging=False)

    def _begin(self, *, exchanging: bool) -> None:
        self.exchanging = exchanging
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.framed = False  # Content-Length or Transfer-Encoding: the body's end is known
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.head_bytes = 0  # read while the head was incomplete: at most MAX_HEAD_BYTES
        self.error: httpx.TransportError | None = None

    # ------------------------------------------------------------------ the exchange
    @property
    def alive(self) -> bool:
        return self.usable and self.transport is not None and not self.transport.is_closing()

    def reusable_at(self, now: float) -> bool:
        """Alive, and idle for less than KEEPALIVE_SECONDS at loop time `now`."""
        return self.alive and now - self.idle_since < KEEPALIVE_SECONDS

    def send(self, data: bytes) -> None:
        """Write one request; its answer is read from here on. ConnectError (not sent) if
        the connection closed before it could be written: a new one the upstream shut."""
        if not self.alive:
            raise httpx.ConnectError("closed before the request was written")
        assert self.transport is not None
        self._begin(exchanging=True)
        self.used = True
        self.transport.write(data)

    async def next_event(self, read_timeout: float | None) -> None:
        """Wait until the parser reports more of the answer, or the connection fails."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(read_timeout):
                await waiter
        except TimeoutError:
            raise httpx.ReadTimeout("no answer within the read timeout") from None
        finally:
            self._waiter = None

    def take(self) -> bytes | None:
        """The next chunk of the body read so far, if any."""
        if not self.chunks:
            return None
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered < HIGH_WATER_BYTES // 4 and self.transport:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def end(self) -> bool:
        """The exchange is over; whether the connection may carry another: only after a
        complete 2xx answer (after any other, an unrequested answer could follow it and be
        taken for the next request's)."""
        reusable = (self.alive and self.complete and self.keep_alive and not self.chunks
                    and 200 <= self.status < 300)
        self.exchanging = False
        return reusable

    def close(self) -> None:
        self.usable = False
        if self.transport is not None:
            self.transport.close()

    def _misbehaving(self, reason: Distrust) -> None:
        self.misbehaved = reason
        if self._told is not None:
            self._told(self)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: httpx.TransportError) -> None:
        if self.exchanging and not self.complete and self.error is None:
            self.error = error
        self.close()
        self._wake()

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport, though not always asyncio's class (uvloop's under `serve`)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.exchanging:  # bytes nobody asked for: nothing after them can be trusted
            self._misbehaving("out_of_turn")
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(httpx.RemoteProtocolError(f"not an HTTP/1.1 answer ({type(exc).__name__})"))
            return
        if not self.headers_done:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(httpx.RemoteProtocolError("an answer's head over MAX_HEAD_BYTES"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.usable = False
        if self.exchanging and not self.complete:
            if self.headers_done and not self.framed:  # a body that ends where the bytes do
                self.complete = True
            elif exc is None:
                self.error = httpx.RemoteProtocolError("closed before the answer's end")
            else:
                self.error = httpx.ReadError(type(exc).__name__)
        self._wake()

    # ------------------------------------------------------------------ httptools' callbacks
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: stop the parser (it raises
            self._misbehaving("surplus")  # HttpParserCallbackError) and close; the answer
            raise _Surplus  # still being read fails (_Body), one already read stands

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.headers_done:  # a chunked body's trailer: never read as the answer's header
            return
        self.headers.append((name, value))
        if not self.framed and name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 100:  # no HTTP status: not an interim answer to wait past
            self._misbehaving("bad_status")
            self._fail(httpx.RemoteProtocolError("an answer's status is below 100"))
            return
        if self.status >= 200:
            self.headers_done = True
            self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER_BYTES and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.headers_done:  # an interim 1xx answer: the final one follows
            self.headers = []
            self.framed = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()


class _Body(httpx.AsyncByteStream):
    """An answer's body as httpx reads it. Closing it hands the connection back to the pool
    when the answer was read to its end, and closes the connection otherwise."""

    def __init__(self, pool: Http1Transport, conn: _Connection, read_timeout: float | None
                 ) -> None:
        self._pool = pool
        self._conn = conn
        self._read_timeout = read_timeout
        self._open = True

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            chunk = conn.take()
            if chunk is not None:
                yield chunk
            elif conn.complete:
                if conn.misbehaved is not None:  # another answer came with this one
                    raise httpx.RemoteProtocolError("bytes after the answer: it cannot be "
                                                    "told from an unrequested one")
                return
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.next_event(self._read_timeout)

    async def aclose(self) -> None:
        if self._open:
            self._open = False
            self._pool.release(self._conn)


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
        self._per_host: collections.Counter[_Key] = collections.Counter()
        self._proxy = proxy  # how connections leave (service/protocols/egress.py), chosen per host
        self._routes: dict[_Key, Proxy | None] = {}
        self._public_only = public_only  # a templated host: global addresses only
        self._keep_alive = keep_alive
        self._distrusted = distrusted
        self._distrust_until: dict[_Key, float] = {}
        # httpx's context (certifi's roots): the same certificates verify as through httpx
        self._ssl = ssl_context or httpx.create_ssl_context()
        self._idle: dict[_Key, list[_Connection]] = {}
        self._open = 0  # connections open or opening; never above _max
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._swept_at = 0.0
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        extensions = request.extensions
        timeouts = extensions.get("timeout", _NO_TIMEOUTS)
        send_by: float | None = extensions.get(SEND_BY)
        data = await _serialized(request)  # refused before any connection is taken
        url = request.url
        scheme = url.scheme
        if scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"{scheme!r} is not http or https")
        key = (scheme, url.raw_host.decode("ascii"), url.port or _DEFAULT_PORTS[scheme])
        proxy = self._routes.get(key, _UNROUTED)
        if proxy is _UNROUTED:  # chosen when a host is first reached (the environment is
            proxy = self._routes[key] = self._proxy(scheme, key[1])  # read then, not per call)
        if proxy is not None and scheme == "http":  # the proxy takes it in absolute form
            data = _absolute(data, url, _target(request), proxy)
        reuse = self._keep_alive and not self._distrusting(key)
        if not reuse:  # one request per connection, and the upstream is told so
            data = _closing(data)
        conn = (self._pooled(key) if reuse else None) or await self._opened(
            key, timeouts, proxy, send_by)
        read_timeout = timeouts.get("read")
        if send_by is not None and time.monotonic() > send_by:
            self._unused(conn)
            raise SentTooLate("the request's moment passed before it could be written")
        gate: SendGate | None = extensions.get(SEND_GATE)
        if gate is not None and not gate():
            self._unused(conn)
            raise Withheld("the request was withheld just before it was written")
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
                              stream=_Body(self, conn, read_timeout),
                              extensions={"http_version": b"HTTP/1.1"})

    def release(self, conn: _Connection) -> None:
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

    def _unused(self, conn: _Connection) -> None:
        """A connection taken for a request that was then not written: idle again as it
        was (its keep-alive clock not restarted), or closed."""
        if conn.alive and not self._closed and not conn.exchanging and self._keep_alive \
                and not self._distrusting(conn.key):
            self._idle.setdefault(conn.key, []).insert(0, conn)
            self._wake()
        else:
            self._discard(conn)

    def _distrusting(self, key: _Key) -> bool:
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

    def _note(self, conn: _Connection) -> None:
        """A closed connection: if it said something out of turn, distrust its host."""
        if conn.misbehaved is not None and not conn.noted:
            conn.noted = True  # once, however many times the pool meets it
            self._distrust(conn.key, conn.misbehaved)

    def _distrust(self, key: _Key, reason: Distrust) -> None:
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
    def _pooled(self, key: _Key) -> _Connection | None:
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

    async def _opened(self, key: _Key, timeouts: Mapping[str, float | None],
                      proxy: Proxy | None, send_by: float | None) -> _Connection:
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

    def _may_open(self, key: _Key) -> bool:
        """Whether a new connection to `key` fits both limits (closing another host's idle
        connection to make room, if that is all it takes)."""
        if self._per_host[key] >= self._max_per_host:
            return False
        return self._open < self._max or self._evict_idle()

    def _closed_one(self, key: _Key) -> None:
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

    async def _connect(self, key: _Key, within: float | None, proxy: Proxy | None,
                       send_by: float | None) -> _Connection:
        scheme, host, port = key
        tls = self._ssl if scheme == "https" else None
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(within):
                conn = cast(_Connection, await open_connection(
                    lambda: _Connection(key, self._note), scheme, host, port, tls=tls,
                    proxy=proxy, public_only=self._public_only))
        except TimeoutError:
            raise httpx.ConnectTimeout("not connected within the connect timeout") from None
        except OSError as exc:  # refused, unreachable, DNS, and ssl.SSLError: never sent
            raise httpx.ConnectError(type(exc).__name__) from exc
        conn.idle_since = now = loop.time()
        # An answer an upstream writes on accept arrives about one round trip (what the
        # connect took) after the connection is made, with the request if it went at once:
        # wait that long (bounded) before writing, then two turns of the loop so what
        # arrived is read (the first queues its callback). Only new connections pay it.
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

    def _discard(self, conn: _Connection) -> None:
        conn.close()
        self._note(conn)
        self._open -= 1
        self._closed_one(conn.key)

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection of any host, freeing its place for a new one."""
        oldest: list[_Connection] | None = None
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


def _target(request: httpx.Request) -> bytes:
    """The request-target: the TARGET extension's, or the URL's path and query."""
    target = request.extensions.get(TARGET)
    return target if isinstance(target, bytes) else request.url.raw_path


def _absolute(data: bytes, url: httpx.URL, path: bytes, proxy: Proxy) -> bytes:
    """A serialized request as an HTTP proxy takes it: the absolute URL as its target, and
    the proxy's credentials."""
    line, _, rest = data.partition(b"\r\n")
    method, _, _ = line.partition(b" ")
    target = url.scheme.encode("ascii") + b"://" + url.netloc + path
    auth = b"" if proxy.authorization is None else (
        b"Proxy-Authorization: " + proxy.authorization + b"\r\n")
    return method + b" " + target + b" HTTP/1.1\r\n" + auth + rest


def _closing(data: bytes) -> bytes:
    """A serialized request that also says `Connection: close` (its own Connection header,
    if it had one, is replaced)."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n")
             if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body


async def _serialized(request: httpx.Request) -> bytes:
    """The request as bytes on the wire: its request line, its headers as given (Host added
    if missing), and its body, framed by Content-Length unless it says Transfer-Encoding."""
    url = request.url
    headers = request.headers
    stream = request.stream
    body = b"".join(stream) if isinstance(stream, httpx.ByteStream) else await request.aread()
    raw = headers.raw
    if "host" not in headers:
        raw = [(b"Host", url.netloc), *raw]
    chunked = "transfer-encoding" in headers
    if body and not chunked and "content-length" not in headers:
        raw.append((b"Content-Length", str(len(body)).encode("ascii")))
    head = [request.method.encode("ascii"), b" ", _target(request), b" HTTP/1.1\r\n"]
    for name, value in raw:
        head += (name, b": ", value, b"\r\n")
    head.append(b"\r\n")
    data = b"".join(head)
    # a CR, LF or NUL inside a name, value or the path would end a line early: another
    # header, or another request, smuggled in
    lines = len(raw) + 2
    if data.count(b"\n") != lines or data.count(b"\r") != lines or b"\0" in data:
        raise httpx.LocalProtocolError("a header or the path holds a line break")
    if chunked:
        body = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    return data + body
