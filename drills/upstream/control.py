"""Controlling the fake: configuring faults and limits, reading back recorded calls.

In process through `Controls` (the test API of `FakeUpstream`); from other processes through
the JSON control API, which is never recorded and never rate limited:
``GET /_control/calls?since=N``, ``GET /_control/stats``, ``POST|DELETE /_control/faults``,
``POST /_control/limits``, ``POST /_control/reset``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from drills.upstream.calls import Call, CallLog
from drills.upstream.faults import Fault, FaultQueue, Queued
from drills.upstream.limits import RateLimits
from drills.upstream.wire import Request


def is_control(path: str) -> bool:
    return path == "/_control" or path.startswith("/_control/")


def _json(status: int, obj: Any) -> tuple[int, bytes]:
    return status, json.dumps(obj).encode()


# Answers a call under a route's path prefix (after limits and faults): status, headers, body
Responder = Callable[[Call], tuple[int, dict[str, str], bytes]]
# Answers one control request from its JSON object: status and JSON body
ControlRoute = Callable[[Request, dict[str, Any]], tuple[int, bytes]]


class Controls:
    """The fake's state (recorded calls, queued faults, limits) and what tests do with it;
    `FakeUpstream` adds the server. ``_lock`` guards all of it: the server touches it from
    its event loop, tests from their own thread."""

    def __init__(self, *, default_limit: float | None, default_burst: int,
                 default_window: bool, keep_calls: bool = True) -> None:
        self._lock = threading.RLock()
        self._log = CallLog(keep_calls)
        self._faults = FaultQueue()
        self._limits = RateLimits(default_limit, default_burst, default_window)
        self._routes: list[tuple[str, Responder]] = []

    def calls(self) -> list[Call]:
        with self._lock:
            return list(self._log.calls)

    def calls_for_key(self, key: str) -> list[Call]:
        return [c for c in self.calls() if c.idempotency_key == key]

    def limit(self, scope: str, per_second: float | None, burst: int | None = None) -> None:
        """Limit `scope` to `per_second` (token bucket of `burst`); None makes it unlimited."""
        with self._lock:
            self._limits.set(scope, per_second, burst)

    def inject(self, fault: Fault | str, *, times: int | None = 1,
               match: Callable[[Call], bool] | str | None = None, **params: Any) -> None:
        queued = Queued.of(fault, times, match, params)
        with self._lock:
            self._faults.add(queued)

    def route(self, prefix: str, responder: Responder) -> None:
        """Answer calls whose path starts with `prefix` with `responder(call)` instead of
        the success status (a list endpoint's pages, say); rate limits and queued faults
        still come first. Routes stay through `reset`."""
        with self._lock:
            self._routes.append((prefix, responder))

    def _responder(self, path: str) -> Responder | None:
        with self._lock:
            return next((r for prefix, r in self._routes if path.startswith(prefix)), None)

    def fail_next(self, n: int, status: int = 503) -> None:
        self.inject(Fault.STATUS, times=n, status=status)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def reset(self) -> None:
        """Forget calls, faults, explicit limits and counters (live connections stay open)."""
        with self._lock:
            self._log.reset()
            self._faults.clear()
            self._limits.clear()

    def throttled_count(self, scope: str | None = None) -> int:
        with self._lock:
            throttled = self._log.throttled
            return sum(throttled.values()) if scope is None else throttled.get(scope, 0)

    def max_in_flight(self, key: str | None = None) -> int:
        with self._lock:
            return self._log.max_in_flight(key)

    def _control(self, req: Request) -> tuple[int, bytes]:
        """Answer one ``/_control`` request: (status, JSON body)."""
        routes: dict[tuple[str, str], ControlRoute] = {
            ("GET", "/_control/calls"): self._read_calls,
            ("GET", "/_control/stats"): self._read_stats,
            ("POST", "/_control/faults"): self._queue_fault,
            ("DELETE", "/_control/faults"): self._clear_faults,
            ("POST", "/_control/limits"): self._set_limit,
            ("POST", "/_control/reset"): self._reset,
        }
        route = routes.get((req.method, req.path.rstrip("/")))
        try:
            data: Any = json.loads(req.body) if req.body.strip() else {}
            if not isinstance(data, dict):
                raise ValueError("JSON body must be an object")
            if route is not None:
                return route(req, data)
        except (KeyError, TypeError, ValueError) as exc:
            return _json(400, {"error": f"{type(exc).__name__}: {exc}"})
        return _json(404, {"error": f"no control route {req.method} {req.path}"})

    def _read_calls(self, req: Request, _data: dict[str, Any]) -> tuple[int, bytes]:
        since = int(parse_qs(req.query).get("since", ["0"])[0])
        return _json(200, [dataclasses.asdict(c) for c in self.calls()[since:]])

    def _read_stats(self, _req: Request, _data: dict[str, Any]) -> tuple[int, bytes]:
        with self._lock:
            return _json(200, self._log.stats())

    def _queue_fault(self, _req: Request, data: dict[str, Any]) -> tuple[int, bytes]:
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

    def _clear_faults(self, _req: Request, _data: dict[str, Any]) -> tuple[int, bytes]:
        self.clear_faults()
        return _json(200, {"cleared": True})

    def _set_limit(self, _req: Request, data: dict[str, Any]) -> tuple[int, bytes]:
        self.limit(str(data["scope"]), data.get("per_second"), data.get("burst"))
        return _json(200, {"scope": data["scope"], "per_second": data.get("per_second")})

    def _reset(self, _req: Request, _data: dict[str, Any]) -> tuple[int, bytes]:
        self.reset()
        return _json(200, {"reset": True})
