"""One HTTP/1.1 keep-alive connection to an upstream, on asyncio's Protocol, its answers
parsed by httptools (llhttp, in C) as their bytes arrive (`Connection`), and an answer's body
as httpx reads it (`AnswerBody`). The pool of them is service/protocols/transport.py's.

A connection carries one exchange at a time. Anything it says out of turn (bytes while idle,
a second answer to one request, a status below 100) marks it `misbehaved` and closes it; its
pool is told at once, to distrust its host. An answer's head is bounded (MAX_HEAD_BYTES), and
reading pauses while more than HIGH_WATER_BYTES of its body wait for the caller.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Final, cast

import httptools
import httpx

# Under the 5 s idle timeout of uvicorn's and Node's servers: a connection is not reused in
# the instant its upstream closes it.
KEEPALIVE_SECONDS: Final = 4.0
# An answer's body buffered past this pauses reading until the caller takes it: a huge body
# is read as the caller reads (service/upstreams/exchange.py stops at its cap), never held
# whole.
HIGH_WATER_BYTES: Final = 65_536
# The bytes read while an answer's final status and headers are still incomplete (interim
# 1xx answers included): httptools gathers each header whole and has no limit of its own.
# Counted per read, so a head ending within one read (at most 256 KiB) may exceed it.
MAX_HEAD_BYTES: Final = 65_536

Key = tuple[str, str, int]  # scheme, host, port: the connections one request may reuse
# Why a connection was distrusted (the reasons counted by the pool's `distrusted` callback).
Distrust = str


class _Surplus(Exception):
    """Bytes after the answer to the one request sent."""


class Connection(asyncio.Protocol):
    """One connection and the answer it is reading: at most one exchange at a time."""

    def __init__(self, key: Key, misbehaved: Callable[[Connection], None] | None = None
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
            raise _Surplus  # still being read fails (AnswerBody), one already read stands

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


class AnswerBody(httpx.AsyncByteStream):
    """An answer's body as httpx reads it. Closing it hands the connection back to the pool
    when the answer was read to its end, and closes the connection otherwise."""

    def __init__(self, release: Callable[[Connection], None], conn: Connection,
                 read_timeout: float | None) -> None:
        self._release = release
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
            self._release(self._conn)
