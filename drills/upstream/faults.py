"""Fault kinds (`Fault`), their queue, and how each one answers a deletion call.

Faults are queued with `FakeUpstream.inject` or ``POST /_control/faults``; a call that is
not throttled takes the first queued fault whose ``match`` accepts it (FIFO), and a fault
queued ``times=N`` is used up after N calls (``times=None``: never).

- ``status``:  answer ``status`` with optional ``headers`` (dict) and ``body`` (bytes), after
               ``delay`` seconds (default 0: at once).
- ``hang``:    read the request, send nothing for ``seconds`` (default 3600), then close.
               Ends early if the client goes away, the server closes, or the test ends it
               (`FakeUpstream.end_hangs`).
- ``drip``:    send a status line and headers with a large Content-Length, then one body byte
               every ``interval`` seconds (default 0.5) for ``seconds`` (default 60), then close.
- ``reset``:   abort with a TCP RST (SO_LINGER 0) after the request was read; no response.
- ``garbage``: answer ``status`` (default 200) with ``size`` (default 64 KiB) random bytes that
               are not valid UTF-8, with a correct Content-Length.
- ``close``:   close the connection cleanly (FIN) without answering.
"""

from __future__ import annotations

import asyncio
import enum
import random
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drills.upstream.calls import Call
from drills.upstream.wire import Request, response, wait_eof


class Fault(enum.StrEnum):
    STATUS = "status"
    HANG = "hang"
    DRIP = "drip"
    RESET = "reset"
    GARBAGE = "garbage"
    CLOSE = "close"


_PARAMS: dict[Fault, frozenset[str]] = {
    Fault.STATUS: frozenset({"status", "headers", "body", "delay"}),
    Fault.HANG: frozenset({"seconds"}),
    Fault.DRIP: frozenset({"seconds", "interval", "status"}),
    Fault.RESET: frozenset(),
    Fault.GARBAGE: frozenset({"status", "size"}),
    Fault.CLOSE: frozenset(),
}


@dataclass
class Queued:
    kind: Fault
    remaining: int | None
    match: Callable[[Call], bool] | None
    params: dict[str, Any]

    @classmethod
    def of(cls, fault: Fault | str, times: int | None,
           match: Callable[[Call], bool] | str | None, params: dict[str, Any]) -> Queued:
        """A checked fault; a `match` string matches calls whose path contains it."""
        kind = Fault(fault)
        unknown = set(params) - _PARAMS[kind]
        if unknown or (kind is Fault.STATUS and "status" not in params):
            raise ValueError(f"bad parameters for fault {kind.value!r}: {sorted(params)}")
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 or None")
        if isinstance(match, str):
            needle = match
            match = lambda call: needle in call.path  # noqa: E731
        return cls(kind, times, match, dict(params))


class FaultQueue:
    """The queued faults, first queued first. Not locked itself: its owner holds a lock."""

    def __init__(self) -> None:
        self._queued: list[Queued] = []

    def add(self, fault: Queued) -> None:
        self._queued.append(fault)

    def clear(self) -> None:
        self._queued.clear()

    def pop(self, call: Call) -> Queued | None:
        """The first fault matching `call`, used up once its `remaining` reaches 0."""
        for i, q in enumerate(self._queued):
            if q.match is None or q.match(call):
                if q.remaining is not None:
                    q.remaining -= 1
                    if q.remaining <= 0:
                        del self._queued[i]
                return q
        return None


async def apply(fault: Queued, req: Request, reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter) -> bool:
    """Answer `req` with `fault`; returns whether to keep the connection."""
    p, keep = fault.params, req.keep_alive
    if fault.kind is Fault.STATUS:
        if float(p.get("delay", 0)) > 0:
            await asyncio.sleep(float(p["delay"]))
        hdrs = {str(k): str(v) for k, v in dict(p.get("headers") or {}).items()}
        writer.write(response(int(p["status"]), hdrs, bytes(p.get("body", b"")), keep=keep))
    elif fault.kind is Fault.GARBAGE:
        size = int(p.get("size", 64 * 1024))
        body = b"\xff" + random.randbytes(size - 1) if size > 0 else b""
        hdrs = {"Content-Type": "application/octet-stream"}
        writer.write(response(int(p.get("status", 200)), hdrs, body, keep=keep))
    elif fault.kind is Fault.HANG:
        await wait_eof(reader, float(p.get("seconds", 3600.0)))
        return False
    elif fault.kind is Fault.DRIP:
        hdrs = {"Content-Type": "application/octet-stream"}
        writer.write(response(int(p.get("status", 200)), hdrs, b"", keep=False,
                              length=100_000_000))
        interval, deadline = float(p.get("interval", 0.5)), time.monotonic() + float(
            p.get("seconds", 60.0))
        while time.monotonic() < deadline:
            writer.write(b"x")
            await writer.drain()
            # a client that gave up has ended the call: stop when it hangs up, rather
            # than counting the call in flight until a write fails
            await wait_eof(reader, interval)
            if reader.at_eof():
                break
        return False
    elif fault.kind is Fault.RESET:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return False
    else:  # Fault.CLOSE: the caller closes with a FIN
        return False
    await writer.drain()
    return keep
