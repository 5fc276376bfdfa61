"""Serving a fake over real HTTP on loopback, with uvicorn.

``async with serve(app, hosts=("127.0.0.2", "127.0.0.3")) as port:`` runs `app` in the current
event loop on sockets bound here, all on one port (all of 127/8 is loopback on Linux, so each
address can stand for a tenant, as Shopify's shops do), and stops it on exit.
``with serve_in_thread(app, hosts) as port:`` does the same in a thread of its own (uvloop when
installed), for a benchmark whose client must not share the fake's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import uvicorn

__all__ = ["serve", "serve_in_thread"]

_START_TIMEOUT_S = 10.0


class _FakeServer(uvicorn.Server):
    """uvicorn's server, leaving signals alone (a fake is not the process's server) and
    stopping as soon as it is told to, not on its next 0.1 s tick."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.exit_now = asyncio.Event()

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self.exit_now.wait()
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown or 2):
                # uvicorn's state has no event to wait on
                while self.server_state.connections or self.server_state.tasks:  # noqa: ASYNC110
                    await asyncio.sleep(0.002)
        except TimeoutError:  # a call still in a slow fault: end it
            for task in self.server_state.tasks:
                task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                for server in self.servers:
                    await server.wait_closed()


def _bind(hosts: Sequence[str], port: int) -> list[socket.socket]:
    """Listening-ready sockets on every host, on one port (port 0: one the kernel picks for
    the first host, which the others then take too; retried if another process holds it on
    one of them)."""
    if not hosts:
        raise ValueError("at least one host")
    for _ in range(20):
        socks: list[socket.socket] = []
        try:
            chosen = port
            for host in hosts:
                # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say
                # so, and without it a keep-alive connection waits out the peer's delayed ACK
                # on every request (bench/reports/design-notes.md, HTTP and statements)
                sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                     socket.SOCK_STREAM, socket.IPPROTO_TCP)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, chosen))
                chosen = sock.getsockname()[1]
            return socks
        except OSError:
            for sock in socks:
                sock.close()
            if port != 0:
                raise
    raise OSError(f"no port free on all of {list(hosts)}")


@contextlib.asynccontextmanager
async def serve(app: Any, hosts: Sequence[str] = ("127.0.0.1",), port: int = 0
                ) -> AsyncIterator[int]:
    """Run `app` (an ASGI app) in this event loop on `hosts`, all on one port; yields the
    port once the server accepts connections, and stops it (closing open connections) on
    exit."""
    socks = _bind(hosts, port)
    chosen = socks[0].getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)
    server = _FakeServer(config)
    task = asyncio.create_task(server.serve(sockets=socks))
    try:
        async with asyncio.timeout(_START_TIMEOUT_S):
            while not server.started:
                if task.done():
                    task.result()  # raises what stopped it
                    raise RuntimeError("the fake's server stopped before it started")
                await asyncio.sleep(0.002)
        yield chosen
    finally:
        server.should_exit = True
        server.exit_now.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), _START_TIMEOUT_S)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            for sock in socks:
                sock.close()


def _loop_factory() -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.new_event_loop
    return uvloop.new_event_loop


@contextlib.contextmanager
def serve_in_thread(app: Any, hosts: Sequence[str] = ("127.0.0.1",), port: int = 0
                    ) -> Iterator[int]:
    """`serve` in a daemon thread with its own event loop; yields the port once serving."""
    ready = threading.Event()
    outcome: dict[str, Any] = {}
    loop_box: list[asyncio.AbstractEventLoop] = []

    async def main() -> None:
        stop = asyncio.Event()
        outcome["stop"] = stop
        loop_box.append(asyncio.get_running_loop())
        async with serve(app, hosts, port) as chosen:
            outcome["port"] = chosen
            ready.set()
            await stop.wait()

    def run() -> None:
        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(main())
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="vendor-fake", daemon=True)
    thread.start()
    ready.wait(_START_TIMEOUT_S + 5)
    if "port" not in outcome:
        thread.join(timeout=5)
        raise RuntimeError("the fake did not start") from outcome.get("error")
    try:
        yield int(outcome["port"])
    finally:
        stop: asyncio.Event = outcome["stop"]
        loop_box[0].call_soon_threadsafe(stop.set)
        thread.join(timeout=_START_TIMEOUT_S + 5)
        if "error" in outcome:
            raise RuntimeError("the fake stopped with an error") from outcome["error"]
