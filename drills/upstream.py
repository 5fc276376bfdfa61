"""FakeUpstream: a real, misbehaving HTTP/1.1 "deletion API" on loopback, for Sweeper's tests.

Written on plain asyncio streams (stdlib only) because the faults need raw socket control. Every
request whose path is not under ``/_control`` is a *deletion call*: it is recorded as a `Call`,
rate limited per scope (token bucket, or with ``--default-window`` at most N calls in any
trailing second; ``429`` with an integer ``Retry-After``), then answered
with the next queued fault matching it, or with ``success_status`` (default ``204``).

Fault kinds (`Fault`), queued with `FakeUpstream.inject` or ``POST /_control/faults``:

- ``status``:  answer ``status`` with optional ``headers`` (dict) and ``body`` (bytes), after
               ``delay`` seconds (default 0: at once).
- ``hang``:    read the request, send nothing for ``seconds`` (default 3600), then close.
               Ends early if the client goes away or the server closes.
- ``drip``:    send a status line and headers with a large Content-Length, then one body byte
               every ``interval`` seconds (default 0.5) for ``seconds`` (default 60), then close.
- ``reset``:   abort with a TCP RST (SO_LINGER 0) after the request was read; no response.
- ``garbage``: answer ``status`` (default 200) with ``size`` (default 64 KiB) random bytes that
               are not valid UTF-8, with a correct Content-Length.
- ``close``:   close the connection cleanly (FIN) without answering.

Control API (JSON, never recorded, never rate limited) for drivers in other processes:
``GET /_control/calls?since=N``, ``GET /_control/stats``, ``POST|DELETE /_control/faults``,
``POST /_control/limits``, ``POST /_control/reset``.  Run standalone with
``python -m drills.upstream --port 0 --default-limit 20 --ready-file PATH`` (the old
``python -m tests.fakes.upstream`` still works). It ships in the package because
``sweeper drill`` starts it on an operator's machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import dataclasses
import enum
import json
import logging
import math
import os
import random
import re
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/1\.[01]")


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


@dataclass(frozen=True)
class Call:
    """One deletion call as the fake saw it; ``outcome`` is "ok", "throttled" or a fault name."""

    method: str
    path: str
    query: str
    idempotency_key: str | None
    scope: str
    headers: dict[str, str]
    received_at: float
    wall_time: float
    outcome: str


@dataclass
class _Queued:
    kind: Fault
    remaining: int | None
    match: Callable[[Call], bool] | None
    params: dict[str, Any]


@dataclass
class _Bucket:
    rate: float
    capacity: float
    tokens: float
    stamp: float


@dataclass
class _Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class _BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _default_scope(method: str, path: str, headers: Mapping[str, str]) -> str:
    return headers.get("x-scope", "default")


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    """Parse one request; None on a clean EOF between requests, `_BadRequest` if malformed."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError:
        raise _BadRequest(431, "request head too large") from None
    lines = raw.decode("latin-1").lstrip("\r\n").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _VERSION.fullmatch(parts[2]):
        raise _BadRequest(400, "malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise _BadRequest(400, "malformed header line")
        name, value = name.lower(), value.strip(" \t")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    if "transfer-encoding" in headers:
        raise _BadRequest(501, "transfer-encoding is not supported")
    length = headers.get("content-length", "0")
    if not re.fullmatch(r"[0-9]+", length):
        raise _BadRequest(400, "bad content-length")
    if int(length) > MAX_BODY:
        raise _BadRequest(413, "request body too large")
    body = await reader.readexactly(int(length))
    split = urlsplit(target)
    if not split.path.startswith("/"):
        raise _BadRequest(400, "bad request target")
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "close" not in tokens and (version == "HTTP/1.1" or "keep-alive" in tokens)
    return _Request(method, split.path, split.query, headers, body, keep)


def _response(status: int, headers: Mapping[str, str], body: bytes, *, keep: bool,
              length: int | None = None) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    out = [f"HTTP/1.1 {status} {reason}", "Server: sweeper-fake-upstream"]
    out += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "content-length"]
    if status in (204, 304) or 100 <= status < 200:
        body = b""
    else:
        out.append(f"Content-Length: {len(body) if length is None else length}")
    if not keep:
        out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body


def _json(status: int, obj: Any) -> tuple[int, bytes]:
    return status, json.dumps(obj).encode()


async def _wait_eof(reader: asyncio.StreamReader, seconds: float) -> None:
    """Sleep up to `seconds`, returning early when the peer closes its side."""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass


class FakeUpstream:
    """The fake deletion API; see the module docstring."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0,
                 default_limit: float | None = None, default_burst: int = 1,
                 default_window: bool = False, success_status: int = 204,
                 scope_fn: Callable[[str, str, Mapping[str, str]], str] | None = None) -> None:
        self._host, self._port = host, port
        self._default_limit, self._default_burst = default_limit, default_burst
        # the default limit as "at most N calls in any trailing second" instead of a bucket
        self._default_window = default_window
        self._windows: dict[str, collections.deque[float]] = {}
        self._success_status = success_status
        self._scope_fn = scope_fn or _default_scope
        self._lock = threading.RLock()
        self._calls: list[Call] = []
        self._faults: list[_Queued] = []
        self._limits: dict[str, tuple[float, int] | None] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._throttled: dict[str, int] = {}
        self._inflight, self._max_inflight = 0, 0
        self._inflight_key: dict[str, int] = {}
        self._max_key: dict[str, int] = {}
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port,
                                                  limit=64 * 1024)
        self._port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        tasks = list(self._conns)
        for task, writer in list(self._conns.items()):
            writer.transport.abort()
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 1.0)

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

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{self._host}:{self._port}"

    # ----------------------------------------------------------------- test API
    def calls(self) -> list[Call]:
        with self._lock:
            return list(self._calls)

    def calls_for_key(self, key: str) -> list[Call]:
        return [c for c in self.calls() if c.idempotency_key == key]

    def limit(self, scope: str, per_second: float | None, burst: int | None = None) -> None:
        """Limit `scope` to `per_second` (token bucket of `burst`); None makes it unlimited."""
        if per_second is not None and (per_second <= 0 or (burst is not None and burst < 1)):
            raise ValueError("per_second must be > 0 and burst >= 1")
        with self._lock:
            self._limits[scope] = None if per_second is None else (
                float(per_second), self._default_burst if burst is None else burst)
            self._buckets.pop(scope, None)

    def inject(self, fault: Fault | str, *, times: int | None = 1,
               match: Callable[[Call], bool] | str | None = None, **params: Any) -> None:
        kind = Fault(fault)
        unknown = set(params) - _PARAMS[kind]
        if unknown or (kind is Fault.STATUS and "status" not in params):
            raise ValueError(f"bad parameters for fault {kind.value!r}: {sorted(params)}")
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 or None")
        if isinstance(match, str):
            needle = match
            match = lambda call: needle in call.path  # noqa: E731
        with self._lock:
            self._faults.append(_Queued(kind, times, match, dict(params)))

    def fail_next(self, n: int, status: int = 503) -> None:
        self.inject(Fault.STATUS, times=n, status=status)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def reset(self) -> None:
        """Forget calls, faults, explicit limits and counters (live connections stay open)."""
        with self._lock:
            self._calls.clear()
            self._faults.clear()
            self._limits.clear()
            self._buckets.clear()
            self._windows.clear()
            self._throttled.clear()
            self._max_inflight = self._inflight
            self._max_key = dict(self._inflight_key)

    def throttled_count(self, scope: str | None = None) -> int:
        with self._lock:
            return sum(self._throttled.values()) if scope is None else self._throttled.get(scope, 0)

    def max_in_flight(self, key: str | None = None) -> int:
        with self._lock:
            return self._max_inflight if key is None else self._max_key.get(key, 0)

    # ----------------------------------------------------------------- internals
    def _take_token(self, scope: str, now: float) -> int | None:
        """Consume a token of `scope`; None if allowed, else the Retry-After seconds."""
        default = None if self._default_limit is None else (self._default_limit,
                                                            self._default_burst)
        cfg = self._limits.get(scope, default)  # an explicit None means unlimited
        if cfg is None:
            return None
        if self._default_window and scope not in self._limits:
            return self._window_slot(scope, now, int(cfg[0]))
        b = self._buckets.get(scope)
        if b is None:
            b = self._buckets[scope] = _Bucket(cfg[0], float(cfg[1]), float(cfg[1]), now)
        b.tokens = min(b.capacity, b.tokens + (now - b.stamp) * b.rate)
        b.stamp = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - b.tokens) / b.rate))

    def _window_slot(self, scope: str, now: float, limit: int) -> int | None:
        """At most `limit` accepted calls in any trailing second of `scope`."""
        accepted = self._windows.setdefault(scope, collections.deque())
        while accepted and accepted[0] <= now - 1.0:
            accepted.popleft()
        if len(accepted) < limit:
            accepted.append(now)
            return None
        return max(1, math.ceil(accepted[0] + 1.0 - now))

    def _pop_fault(self, call: Call) -> _Queued | None:
        for i, q in enumerate(self._faults):
            if q.match is None or q.match(call):
                if q.remaining is not None:
                    q.remaining -= 1
                    if q.remaining <= 0:
                        del self._faults[i]
                return q
        return None

    def _enter(self, key: str | None, delta: int) -> None:
        self._inflight += delta
        self._max_inflight = max(self._max_inflight, self._inflight)
        if key is not None:
            n = self._inflight_key[key] = self._inflight_key.get(key, 0) + delta
            self._max_key[key] = max(self._max_key.get(key, 0), n)
            if n <= 0:
                del self._inflight_key[key]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = writer
        try:
            keep = True
            while keep:
                try:
                    req = await _read_request(reader)
                except _BadRequest as exc:
                    writer.write(_response(exc.status, {}, str(exc).encode(), keep=False))
                    await writer.drain()
                    break
                if req is None:
                    break
                if req.path == "/_control" or req.path.startswith("/_control/"):
                    status, body = self._control(req)
                    ctype = {"Content-Type": "application/json"}
                    keep = req.keep_alive
                    writer.write(_response(status, ctype, body, keep=keep))
                    await writer.drain()
                else:
                    keep = await self._deletion(req, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # close(): end quietly (3.11's stream callback logs cancelled handler tasks)
        except Exception:
            log.debug("fake upstream: connection failed", exc_info=True)
        finally:
            self._conns.pop(task, None)
            writer.close()

    async def _deletion(self, req: _Request, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> bool:
        """Record, limit and answer one deletion call; returns whether to keep the connection."""
        now = time.monotonic()
        scope = self._scope_fn(req.method, req.path, req.headers)
        key = req.headers.get("idempotency-key")
        call = Call(req.method, req.path, req.query, key, scope, dict(req.headers), now,
                    time.time(), "")
        with self._lock:
            retry_after = self._take_token(scope, now)
            fault = None if retry_after is not None else self._pop_fault(call)
            outcome = "throttled" if retry_after is not None else fault.kind if fault else "ok"
            self._calls.append(dataclasses.replace(call, outcome=str(outcome)))
            if retry_after is not None:
                self._throttled[scope] = self._throttled.get(scope, 0) + 1
            self._enter(key, +1)
        keep = req.keep_alive
        try:
            if retry_after is not None:
                hdrs = {"Retry-After": str(retry_after), "Content-Type": "application/json"}
                writer.write(_response(429, hdrs, b'{"error":"rate limited"}', keep=keep))
            elif fault is None:
                writer.write(_response(self._success_status, {}, b"", keep=keep))
            else:
                return await self._apply(fault, req, reader, writer)
            await writer.drain()
            return keep
        finally:
            with self._lock:
                self._enter(key, -1)

    async def _apply(self, fault: _Queued, req: _Request, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        p, keep = fault.params, req.keep_alive
        if fault.kind is Fault.STATUS:
            if float(p.get("delay", 0)) > 0:
                await asyncio.sleep(float(p["delay"]))
            hdrs = {str(k): str(v) for k, v in dict(p.get("headers") or {}).items()}
            writer.write(_response(int(p["status"]), hdrs, bytes(p.get("body", b"")), keep=keep))
        elif fault.kind is Fault.GARBAGE:
            size = int(p.get("size", 64 * 1024))
            body = b"\xff" + random.randbytes(size - 1) if size > 0 else b""
            hdrs = {"Content-Type": "application/octet-stream"}
            writer.write(_response(int(p.get("status", 200)), hdrs, body, keep=keep))
        elif fault.kind is Fault.HANG:
            await _wait_eof(reader, float(p.get("seconds", 3600.0)))
            return False
        elif fault.kind is Fault.DRIP:
            hdrs = {"Content-Type": "application/octet-stream"}
            writer.write(_response(int(p.get("status", 200)), hdrs, b"", keep=False,
                                   length=100_000_000))
            interval, deadline = float(p.get("interval", 0.5)), time.monotonic() + float(
                p.get("seconds", 60.0))
            while time.monotonic() < deadline:
                writer.write(b"x")
                await writer.drain()
                # a client that gave up has ended the call: stop when it hangs up, rather
                # than counting the call in flight until a write fails
                await _wait_eof(reader, interval)
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

    def _control(self, req: _Request) -> tuple[int, bytes]:
        route = (req.method, req.path.rstrip("/"))
        try:
            data: Any = json.loads(req.body) if req.body.strip() else {}
            if not isinstance(data, dict):
                raise ValueError("JSON body must be an object")
            if route == ("GET", "/_control/calls"):
                since = int(parse_qs(req.query).get("since", ["0"])[0])
                return _json(200, [dataclasses.asdict(c) for c in self.calls()[since:]])
            if route == ("GET", "/_control/stats"):
                with self._lock:
                    return _json(200, {"calls": len(self._calls),
                                       "throttled": dict(self._throttled),
                                       "max_in_flight": self._max_inflight,
                                       "max_in_flight_by_key": dict(self._max_key)})
            if route == ("POST", "/_control/faults"):
                fault, times = data.pop("fault"), data.pop("times", 1)
                contains, scope = data.pop("path_contains", None), data.pop("scope", None)
                key = data.pop("idempotency_key", None)
                if "body_b64" in data:
                    data["body"] = base64.b64decode(data.pop("body_b64"))

                def match(c: Call) -> bool:
                    return ((contains is None or contains in c.path)
                            and (scope is None or c.scope == scope)
                            and (key is None or c.idempotency_key == key))

                self.inject(fault, times=times, match=match, **data)
                return _json(201, {"queued": fault})
            if route == ("DELETE", "/_control/faults"):
                self.clear_faults()
                return _json(200, {"cleared": True})
            if route == ("POST", "/_control/limits"):
                self.limit(str(data["scope"]), data.get("per_second"), data.get("burst"))
                return _json(200, {"scope": data["scope"], "per_second": data.get("per_second")})
            if route == ("POST", "/_control/reset"):
                self.reset()
                return _json(200, {"reset": True})
        except (KeyError, TypeError, ValueError) as exc:
            return _json(400, {"error": f"{type(exc).__name__}: {exc}"})
        return _json(404, {"error": f"no control route {req.method} {req.path}"})


def _write_ready_file(path: str, base_url: str) -> None:
    """Atomically: a reader never sees a half-written URL."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(base_url)
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace) -> None:
    up = FakeUpstream(host=args.host, port=args.port, default_limit=args.default_limit,
                      default_burst=args.default_burst, default_window=args.default_window,
                      success_status=args.success_status)
    await up.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if args.ready_file:
            _write_ready_file(args.ready_file, up.base_url)
        print(up.base_url, flush=True)
        await stop.wait()
    finally:
        await up.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drills.upstream", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--default-limit", type=float, default=None)
    ap.add_argument("--default-burst", type=int, default=1)
    ap.add_argument("--default-window", action="store_true",
                    help="enforce --default-limit as at most that many calls in any trailing "
                         "second (a sliding window) instead of a token bucket")
    ap.add_argument("--success-status", type=int, default=204)
    ap.add_argument("--ready-file", default=None)
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
