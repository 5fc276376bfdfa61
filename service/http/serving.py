"""The HTTP server around the app: one uvicorn configuration for `sweeper serve` and the
tests, bounding what a connection may hold (connections, idle time, time to send headers)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.config.settings import Settings
from service.errors import ListenError

KEEP_ALIVE_TIMEOUT_S = 5  # an idle keep-alive connection is closed after this long


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection that has not sent a request's full
    headers within `header_timeout_s` of opening or of the request's first byte: uvicorn
    itself waits forever for headers, so slow senders could hold connections open."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def server_config(app: Any, settings: Settings, *, host: str, port: int,
                  **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration `serve` runs with: no access log (the app logs requests),
    TLS when configured, and the connection bounds from settings. `limit_concurrency`
    answers 503 to a request beyond `max_connections` connections and requests in progress."""
    protocol = type("HeaderDeadline", (HeaderDeadlineProtocol,),
                    {"header_timeout_s": settings.header_read_timeout_seconds})
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                          proxy_headers=True, server_header=False, http=protocol,
                          limit_concurrency=settings.max_connections,
                          timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
                          timeout_graceful_shutdown=int(settings.shutdown_grace_seconds),
                          ssl_certfile=settings.tls_cert_file,
                          ssl_keyfile=settings.tls_key_file, **overrides)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, ready for uvicorn's `sockets=`. Bound here rather than
    by uvicorn, which logs a failure and exits 1: a port in use is a ListenError (exit 4),
    told apart from an unreachable database, and is found before the database starts. The
    family is chosen as uvicorn chooses it (IPv6 only for an address with a colon), so a
    name like `localhost` binds its IPv4 address, as before."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY on an accepted connection only
    # when its socket says so, and without it a keep-alive client waits out a delayed ACK on
    # every request under `sweeper local`, which serves on the plain asyncio loop
    # (bench/reports/design-notes.md, HTTP and statements)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:  # socket.gaierror too: a name that does not resolve
        sock.close()
        raise ListenError(f"cannot listen on {where}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown, which would kill the process
    before the embedded database is stopped; a requested shutdown is a clean exit here."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return _signals_to(self.handle_exit)


class CompanionServer(uvicorn.Server):
    """A second server in the same loop (the local simulated store): it leaves signals to
    the main server, whose shutdown stops it."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


@contextlib.contextmanager
def _signals_to(handler: Any) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
