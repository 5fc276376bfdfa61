"""The request log: one line and one duration sample per HTTP request, and the request id
that problem answers name the request by. Outermost of the app's middleware, so it logs
and times what the gate answers too.

The id is the caller's `X-Request-ID` when it is a plain token (1-64 letters, digits, `.`,
`_`, `:`, `-`), else a new one; every line logged while the request runs carries it
(service/observability/logs.py `REQUEST_ID`), and the answer echoes it."""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.http.api.problems import REQUEST_ID, route_template
from service.observability import metrics
from service.observability.logs import REQUEST_ID as LOGGED_REQUEST

log = logging.getLogger("service.http")

# probes and scrapes, logged only when they fail
_QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_CALLERS_ID: Final = re.compile(rb"[A-Za-z0-9._:-]{1,64}")


def request_id_of(scope: Scope) -> str:
    """The caller's X-Request-ID if it is a plain token, else a new id."""
    for name, value in scope.get("headers") or ():
        if name == b"x-request-id":
            if _CALLERS_ID.fullmatch(value):
                return str(value, "ascii")
            break
    return uuid.uuid4().hex[:16]


class RequestLog:
    """One log line per request: method, route template (never the raw path, which can
    carry tenant ids), status, duration. Never headers or bodies."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        request_id = request_id_of(scope)
        scope[REQUEST_ID] = request_id  # problem answers name the request by it
        logged = LOGGED_REQUEST.set(request_id)

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            _record(scope, status, time.perf_counter() - started)
            LOGGED_REQUEST.reset(logged)


def _record(scope: Scope, status: int, elapsed: float) -> None:
    """The request's duration sample, labelled by its route, and its log line."""
    matched = scope.get("route")
    # only methods the matched route declares are labelled, so requests with any method
    # to any path add at most one `other` per route template
    declared = getattr(matched, "methods", None) or ()
    method = scope["method"] if scope["method"] in declared else "other"
    route = route_template(scope)
    metrics.HTTP_DURATION.labels(route, method, metrics.status_class(status)).observe(elapsed)
    if scope["path"] not in _QUIET_PATHS or status >= 500:
        # OpenTelemetry's HTTP attribute names; the request id comes from the context
        log.log(logging.WARNING if status >= 500 else logging.INFO, "request", extra={
            "http.request.method": scope["method"], "http.route": route,
            "http.response.status_code": status, "duration_ms": round(elapsed * 1000, 2)})
