"""A simulated storefront deletion API, an ASGI application that `sweeper local` and
`sweeper demo` serve over HTTP on loopback. It behaves like the stores Sweeper deletes from: a
token bucket per tenant answering 429 with Retry-After beyond it, a few milliseconds per call,
404 for an object already deleted, and, when asked for bad weather, some 503s and some objects
that were gone before the first call.

    DELETE /tenants/{tenant}/carts/{object_id}  → 204, or 404 when already deleted
    GET /                                        → what it did so far, as JSON
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Answer = tuple[int, dict[str, str], bytes]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass
class Weather:
    """Shares of calls answered 503 (try later) or 404 before any deletion (already gone)."""

    unavailable: float = 0.0
    absent: float = 0.0


@dataclass
class SimulatedStore:
    """Per-tenant token buckets (`rate_per_s`, `burst`) and the set of deleted objects."""

    rate_per_s: float
    burst: int
    latency_s: tuple[float, float] = (0.005, 0.03)
    weather: Weather = field(default_factory=Weather)
    rng: random.Random = field(default_factory=random.Random)
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)
    calls: int = 0
    throttled: int = 0

    async def answer(self, method: str, path: str) -> Answer:
        """The status, headers and body this store answers `method path` with."""
        if method == "GET" and path == "/":
            return 200, {"content-type": "application/json"}, json.dumps({
                "calls": self.calls, "deleted": len(self.deleted),
                "throttled": self.throttled, "rate_per_tenant": self.rate_per_s,
                "burst": self.burst}).encode()
        parts = path.strip("/").split("/")
        if method != "DELETE" or len(parts) != 4 or parts[0] != "tenants":
            return 404, {}, b""
        self.calls += 1
        tenant = parts[1]
        now = time.monotonic()
        tokens, at = self.buckets.get(tenant, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
        if tokens < 1.0:
            self.buckets[tenant] = (tokens, now)
            self.throttled += 1
            wait = (1.0 - tokens) / self.rate_per_s
            return 429, {"retry-after": str(max(1, round(wait)))}, b""
        self.buckets[tenant] = (tokens - 1.0, now)
        await asyncio.sleep(self.rng.uniform(*self.latency_s))
        roll = self.rng.random()
        if roll < self.weather.unavailable:
            return 503, {}, b""
        if path in self.deleted or roll < self.weather.unavailable + self.weather.absent:
            return 404, {}, b""
        self.deleted.add(path)
        return 204, {}, b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """As an ASGI application: each HTTP request answered by `answer`."""
        if scope["type"] != "http":
            return
        status, headers, body = await self.answer(scope["method"], scope["path"])
        await send({"type": "http.response.start", "status": status, "headers": [
            (k.encode(), v.encode()) for k, v in headers.items()]})
        await send({"type": "http.response.body", "body": body})
