"""A TCP proxy on loopback that a drill puts between Sweeper's processes and PostgreSQL or the
upstream, to fail the network the way networks fail: a link blackholed (nothing arrives and
nothing is refused: no RST, no FIN), in one direction or both, then healed; or slow, each
chunk held for a latency with jitter. Blackholed
bytes are not lost, they wait (the proxy stops reading, so the sender's buffers fill as they
would while TCP retransmits into the void) and flow again when the link heals, as TCP's
retransmissions deliver them: a connection that outlives the cut carries on intact."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Sequence
from typing import Final

CHUNK: Final = 65_536


class FaultProxy:
    """Forwards every connection to `target`; `cut()` blackholes the link (`to_target`:
    the requests; `from_target`: the answers), `heal()` restores it."""

    def __init__(self, host: str, port: int, *,
                 fallbacks: Sequence[tuple[str, int]] = ()) -> None:
        """`host` a name or address, or a socket directory (`/...`: PostgreSQL's socket
        `.s.PGSQL.<port>` in it). With `fallbacks`, a new connection goes to the first of
        target and fallbacks that accepts it, as a cluster's Service in front of its nodes
        does (a connection to a node that dies ends with it)."""
        self.target = (host, port)
        self.fallbacks = list(fallbacks)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open = {"to_target": asyncio.Event(), "from_target": asyncio.Event()}
        for flowing in self._open.values():
            flowing.set()
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.delay: tuple[float, float] | None = None
        self.connections = 0

    async def start(self, host: str = "127.0.0.1") -> int:
        """Listen on `host` (loopback unless told), on a free port, which it returns."""
        self._server = await asyncio.start_server(self._accept, host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def cut(self, *, to_target: bool = True, from_target: bool = True) -> None:
        if to_target:
            self._open["to_target"].clear()
        if from_target:
            self._open["from_target"].clear()

    def slow(self, delay: tuple[float, float] | None) -> None:
        """Hold each chunk, in each direction, for a time drawn from `delay` (seconds, low
        and high: latency and its jitter) before passing it on, in order; None: at once."""
        self.delay = delay

    def heal(self, *, reset: bool = False) -> None:
        """The link works again. `reset`: the connections across the cut are reset (a
        firewall or NAT that forgot them), so only new connections work."""
        if reset:
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()
        for flowing in self._open.values():
            flowing.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        self.connections += 1
        for host, port in (self.target, *self.fallbacks):
            try:
                if host.startswith("/"):
                    target_reader, target_writer = await asyncio.open_unix_connection(
                        f"{host}/.s.PGSQL.{port}")
                else:
                    target_reader, target_writer = await asyncio.open_connection(host, port)
                break
            except OSError:
                continue
        else:
            writer.close()
            return
        self._writers.update((writer, target_writer))
        for pump in (self._pump(reader, target_writer, "to_target"),
                     self._pump(target_reader, writer, "from_target")):
            task = asyncio.create_task(pump)
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: str) -> None:
        flowing = self._open[direction]
        try:
            while True:
                await flowing.wait()  # cut: nothing is read, so nothing is acknowledged
                data = await reader.read(CHUNK)
                if not data:
                    break
                if self.delay is not None:
                    await asyncio.sleep(random.uniform(*self.delay))
                await flowing.wait()  # cut mid-read: the bytes wait for the link
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
