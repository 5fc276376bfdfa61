"""Fakes of four vendors' deletion APIs, each a plain Starlette ASGI app that follows the
vendor's published documentation (cited in each module), for tests and benchmarks:

- `shopify.FakeShopify`: GraphQL Admin API `customerDelete`, cost-based leaky bucket, the shop
  told by the Host header (one loopback address per shop).
- `bigcommerce.FakeBigCommerce`: `DELETE /stores/{hash}/v3/customers?id:in=...`, a request
  quota per window with the `X-Rate-Limit-*` headers.
- `stripe.FakeStripe`: `DELETE /v1/customers/{id}`, requests per second per account, Stripe's
  idempotency layer.
- `commercetools.FakeCommercetools`: `DELETE /{project}/customers/{id}?version=N`, optimistic
  concurrency.

Serve one with `serve.serve(fake, hosts=...)` (in the test's event loop) or
`serve.serve_in_thread(fake, hosts=...)` (its own thread and loop, for benchmarks).

This module holds what the four share (`VendorFake`): the recorded `Call`s (never the
credentials), counters by status and outcome, the times of throttled calls, and injected faults
(`fail_next`, `slow_next`). A fault is taken by an authenticated call, before the fake's rate
limiter (so it costs no quota) in all but the Stripe fake, where it comes after the limiter and
the idempotency lookup, so that a 500 is saved under an idempotency key as Stripe saves its
own. State is touched only from the serving event
loop; the test methods are plain synchronous methods for a test running in that same loop (with
`serve_in_thread`, configure before serving and read counters after, or accept racy reads).
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["Call", "Exchange", "Refused", "TokenBucket", "VendorFake", "example_block",
           "host_without_port", "json_response", "parse_json"]


def example_block(example: Path, vendor: str) -> str:
    """The commented `# >>> vendor: ...` ... `# <<<` block of policies.example.toml,
    uncommented: TOML text the tests and benchmarks run as written."""
    text = example.read_text(encoding="utf-8")
    found = re.search(rf"^# >>> {re.escape(vendor)}:.*?\n(.*?)^# <<<", text,
                      re.MULTILINE | re.DOTALL)
    if found is None:
        raise LookupError(f"{example} has no {vendor} block")
    return "\n".join(line.removeprefix("# ").removeprefix("#")
                     for line in found[1].splitlines())


@dataclass(frozen=True, slots=True)
class Call:
    """One request as a fake saw it. ``body`` is the parsed JSON (or form) body, the text when
    it did not parse, None when empty; ``tenant`` is the shop, store, account or project the
    request named or authenticated as (None when it could not be told); ``outcome`` is one of
    "ok", "not_found", "unauthorized", "throttled", "invalid", "conflict", "replayed", "fault"."""

    at: float  # time.monotonic() when the request arrived
    method: str
    path: str
    query: str
    body: Any
    tenant: str | None
    status: int
    outcome: str
    idempotency_key: str | None = None


class Exchange:
    """What a vendor handler learned about the request, filled in as it goes and recorded by
    `VendorFake` once the answer is known."""

    __slots__ = ("at", "body", "idempotency_key", "outcome", "tenant")

    def __init__(self, at: float) -> None:
        self.at = at
        self.body: Any = None
        self.tenant: str | None = None
        self.outcome = "ok"
        self.idempotency_key: str | None = None


@dataclass(slots=True)
class _Fault:
    remaining: int
    status: int | None  # None: answer normally, after the delay
    delay: float


def json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(payload, separators=(",", ":")).encode(), status,
                    headers=headers, media_type="application/json")


def parse_json(raw: bytes) -> Any:
    """The JSON value of a body, its text when it is not JSON, None when empty."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


class Refused(Exception):
    """A call the vendor answers without acting on it: `outcome` as the call is recorded
    (see `Call`), `response` what the vendor sends. A handler raises it at the first check
    the call fails; `VendorFake` answers it."""

    def __init__(self, outcome: str, response: Response) -> None:
        super().__init__(outcome)
        self.outcome = outcome
        self.response = response


Handler = Callable[[Request, bytes, Exchange], Awaitable[Response]]


class VendorFake:
    """The common part of the vendor fakes; each subclass builds its Starlette app with
    `_route` around its handler and says how a failure looks (`_fault_response`).

    The instance is itself an ASGI app (``serve(fake)``); ``fake.app`` is the Starlette app.
    """

    def __init__(self, *, record_calls: bool = True) -> None:
        # a benchmark of a million calls can turn the records off and keep the counters
        self.record_calls = record_calls
        self.calls: list[Call] = []
        self.statuses: collections.Counter[int] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.throttled_at: list[float] = []
        self.delaying = 0  # calls waiting out an injected fault's delay right now
        self._faults: collections.deque[_Fault] = collections.deque()
        self.app = self._build_app()

    # ----------------------------------------------------------------- test API
    def fail_next(self, n: int = 1, status: int = 503, *, delay: float = 0.0) -> None:
        """Answer the next `n` authenticated calls with `status` (in the vendor's error shape),
        each after `delay` seconds. Queued after any earlier faults."""
        if n < 1 or not 400 <= status <= 599 or delay < 0:
            raise ValueError("n must be >= 1, status an error status, delay >= 0")
        self._faults.append(_Fault(n, status, delay))

    def slow_next(self, n: int = 1, *, delay: float) -> None:
        """Answer the next `n` authenticated calls normally, each only after `delay` seconds."""
        if n < 1 or delay < 0:
            raise ValueError("n must be >= 1 and delay >= 0")
        self._faults.append(_Fault(n, None, delay))

    def clear_faults(self) -> None:
        self._faults.clear()

    @property
    def throttled(self) -> int:
        return len(self.throttled_at)

    def reset_calls(self) -> None:
        """Forget recorded calls and counters (not the vendor's state or limiters)."""
        self.calls.clear()
        self.statuses.clear()
        self.outcomes.clear()
        self.throttled_at.clear()

    # ----------------------------------------------------------------- for subclasses
    def _build_app(self) -> Any:
        raise NotImplementedError

    def _fault_response(self, status: int) -> Response:
        raise NotImplementedError

    def _route(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """A Starlette endpoint running `handler` (its answer, or the one it was Refused
        with), recording the call and counting it."""

        async def endpoint(request: Request) -> Response:
            ex = Exchange(time.monotonic())
            raw = await request.body()
            ex.body = parse_json(raw)
            ex.idempotency_key = request.headers.get("idempotency-key")  # only Stripe may honour it
            try:
                response = await handler(request, raw, ex)
            except Refused as refused:
                ex.outcome, response = refused.outcome, refused.response
            status = response.status_code
            self.statuses[status] += 1
            self.outcomes[ex.outcome] += 1
            if ex.outcome == "throttled":
                self.throttled_at.append(ex.at)
            if self.record_calls:
                self.calls.append(Call(ex.at, request.method, request.url.path,
                                       request.url.query, ex.body, ex.tenant, status,
                                       ex.outcome, ex.idempotency_key))
            return response

        return endpoint

    async def _take_fault(self, ex: Exchange) -> Response | None:
        """The injected answer for this call, if a fault is queued: after its delay, the
        failure response, or None (a slow fault: go on and answer normally)."""
        if not self._faults:
            return None
        fault = self._faults[0]
        fault.remaining -= 1
        if fault.remaining <= 0:
            self._faults.popleft()
        if fault.delay > 0:
            self.delaying += 1
            try:
                await asyncio.sleep(fault.delay)
            finally:
                self.delaying -= 1
        if fault.status is None:
            return None
        ex.outcome = "fault"
        return self._fault_response(fault.status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def host_without_port(host: str) -> str:
    """``127.0.0.2:8080`` -> ``127.0.0.2``; ``[::1]:80`` -> ``::1``."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class TokenBucket:
    """A bucket of `capacity` tokens refilled at `rate` per second (time.monotonic())."""

    __slots__ = ("capacity", "rate", "stamp", "tokens")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be > 0")
        self.rate, self.capacity = float(rate), float(capacity)
        self.tokens, self.stamp = float(capacity), now

    def level(self, now: float) -> float:
        if now > self.stamp:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.tokens

    def take(self, amount: float, now: float) -> bool:
        if self.level(now) >= amount:
            self.tokens -= amount
            return True
        return False

    def give(self, amount: float) -> None:
        self.tokens = min(self.capacity, self.tokens + amount)
