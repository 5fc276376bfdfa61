"""The server: listening on loopback, the connection loop, and the deletion call path.

Every request whose path is not under ``/_control`` is a *deletion call*: it is recorded as
a `Call`, rate limited per scope (token bucket, or with ``--default-window`` at most N calls
in any trailing second; ``429`` with an integer ``Retry-After``), then answered with the
next queued fault matching it, a route's responder (`Controls.route`: a list endpoint's
pages), or with ``success_status`` (default ``204``).

With `latency` (seconds, a (low, high) pair) every deletion call's answer waits a time drawn
uniformly from that range, as a real upstream's does (other calls go on meanwhile); with
`tls` the fake listens for HTTPS with that server context (drills/upstream/tls.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import socket
import ssl
import threading
import time
from types import TracebackType

from drills.upstream.arrivals import ArrivalSocket
from drills.upstream.calls import Call
from drills.upstream.control import Controls, is_control
from drills.upstream.faults import Fault, apply
from drills.upstream.limits import ScopeFn, default_scope
from drills.upstream.wire import BadRequest, Request, read_request, response

log = logging.getLogger(__name__)


class FakeUpstream(Controls):
    """The fake deletion API; see the `drills.upstream` docstring."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0,
                 default_limit: float | None = None, default_burst: int = 1,
                 default_window: bool = False, success_status: int = 204,
                 scope_fn: ScopeFn | None = None, tls: ssl.SSLContext | None = None,
                 latency: tuple[float, float] | None = None, keep_calls: bool = True
                 ) -> None:
        super().__init__(default_limit=default_limit, default_burst=default_burst,
                         default_window=default_window, keep_calls=keep_calls)
        if latency is not None and not 0 <= latency[0] <= latency[1]:
            raise ValueError("latency is a range (low, high) with 0 <= low <= high")
        self._host, self._port = host, port
        self._tls = tls
        self._latency = latency
        self._success_status = success_status
        self._scope_fn = scope_fn or default_scope
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._hanging: set[asyncio.StreamWriter] = set()  # calls in a `hang` fault now
        self._accepted = 0  # connections ever accepted: keep-alive reuse shows here
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def set_latency(self, latency: tuple[float, float] | None) -> None:
        """Answer each deletion call after a time drawn from `latency` (None: at once),
        from the next call on: an upstream slowing down or recovering."""
        if latency is not None and not 0 <= latency[0] <= latency[1]:
            raise ValueError("latency is a range (low, high) with 0 <= low <= high")
        self._latency = latency

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        listener = socket.create_server((self._host, self._port), backlog=1024)
        listener.setblocking(False)
        self._listener, self._port = listener, listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept(listener))

    async def _accept(self, listener: socket.socket) -> None:
        """Accept connections on our own loop rather than `asyncio.start_server`'s, so
        each is read through an `ArrivalSocket` (a call's time is when it arrived)."""
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            task = asyncio.create_task(self._connect(ArrivalSocket.adopt(conn)))
            task.add_done_callback(_quiet)  # a failed TLS handshake ends only that peer

    async def _connect(self, sock: ArrivalSocket) -> None:
        """Serve one accepted connection (after its TLS handshake, with `tls`)."""
        reader = asyncio.StreamReader(limit=64 * 1024)
        protocol = asyncio.StreamReaderProtocol(
            reader, lambda r, w: self._handle(r, w, sock))
        await asyncio.get_running_loop().connect_accepted_socket(
            lambda: protocol, sock, ssl=self._tls)

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        listener.close()
        tasks = list(self._conns)
        for task, writer in list(self._conns.items()):
            writer.transport.abort()
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    def start_in_thread(self) -> None:
        ready = threading.Event()
        errors: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def run() -> None:
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:  # reported to the caller below
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="fake-upstream", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]

    def stop_thread(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self.close(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        self._loop = self._thread = None

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def __enter__(self) -> FakeUpstream:
        self.start_in_thread()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop_thread()

    def end_hangs(self) -> int:
        """End the calls hanging now (`hang` faults) as their `seconds` running out would:
        the connection closed, no answer. For a test that holds a call in flight until it
        has done what it must meanwhile. Call it on the loop serving the fake (the `async
        with` form); returns how many calls it ended."""
        hanging, self._hanging = self._hanging, set()
        for writer in hanging:
            writer.close()
        return len(hanging)

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{self._host}:{self._port}"

    def connections_accepted(self) -> int:
        return self._accepted

    # ----------------------------------------------------------------- connections
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      sock: ArrivalSocket) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = writer
        self._accepted += 1
        try:
            keep = True
            while keep:
                try:
                    req = await read_request(reader)
                except BadRequest as exc:
                    writer.write(response(exc.status, {}, str(exc).encode(), keep=False))
                    await writer.drain()
                    break
                if req is None:
                    break
                if is_control(req.path):
                    status, body = self._control(req)
                    ctype = {"Content-Type": "application/json"}
                    keep = req.keep_alive
                    writer.write(response(status, ctype, body, keep=keep))
                    await writer.drain()
                else:
                    keep = await self._deletion(req, reader, writer, sock.last_arrival)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # close(): end quietly (3.11's stream callback logs cancelled handler tasks)
        except Exception:
            log.debug("fake upstream: connection failed", exc_info=True)
        finally:
            self._conns.pop(task, None)
            writer.close()

    async def _deletion(self, req: Request, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, arrived: float) -> bool:
        """Record, limit and answer one deletion call (`arrived`: when its last bytes reached
        the kernel, epoch seconds); returns whether to keep the connection. The call is
        timed by its arrival, limited by when the fake takes it, as a real upstream would."""
        now = time.monotonic()
        arrived = min(arrived, time.time())
        scope = self._scope_fn(req.method, req.path, req.headers)
        key = req.headers.get("idempotency-key")
        call = Call(req.method, req.path, req.query, key, scope, dict(req.headers),
                    now - (time.time() - arrived), arrived, "",
                    req.body.decode("utf-8", "replace") if req.body else "")
        with self._lock:
            retry_after = self._limits.take(scope, now)
            fault = None if retry_after is not None else self._faults.pop(call)
            outcome = "throttled" if retry_after is not None else fault.kind if fault else "ok"
            self._log.record(dataclasses.replace(call, outcome=str(outcome)))
            self._log.enter(key, +1)
        keep = req.keep_alive
        try:
            if self._latency is not None:
                await asyncio.sleep(random.uniform(*self._latency))
            if retry_after is not None:
                hdrs = {"Retry-After": str(retry_after), "Content-Type": "application/json"}
                writer.write(response(429, hdrs, b'{"error":"rate limited"}', keep=keep))
            elif fault is None and (responder := self._responder(call.path)) is not None:
                status, headers, body = responder(call)
                writer.write(response(status, headers, body, keep=keep))
            elif fault is None:
                writer.write(response(self._success_status, {}, b"", keep=keep))
            elif fault.kind is Fault.HANG:
                self._hanging.add(writer)
                try:
                    return await apply(fault, req, reader, writer)
                finally:
                    self._hanging.discard(writer)
            else:
                return await apply(fault, req, reader, writer)
            await writer.drain()
            return keep
        finally:
            with self._lock:
                self._log.enter(key, -1)


def _quiet(task: asyncio.Task[object]) -> None:
    """Retrieve a connection setup's failure (a peer gone, a bad TLS handshake)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("fake upstream: connection setup failed", exc_info=task.exception())
