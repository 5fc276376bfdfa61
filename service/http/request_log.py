"""The request log: one line and one duration sample per HTTP request, and the request id
that problem answers name the request by. Outermost of the app's middleware, so it logs
and times what the gate answers too."""

from __future__ import annotations

import logging
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.http.api.problems import REQUEST_ID
from service.observability import metrics

log = logging.getLogger("service.http")

# probes and scrapes, logged only when they fail
_QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class RequestLog:
    """One log line per request: method, path (no query string), status, duration. Never
    headers or bodies."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        request_id = uuid.uuid4().hex[:16]
        scope[REQUEST_ID] = request_id  # problem answers name the request by it

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            _record(scope, status, time.perf_counter() - started, request_id)


def _record(scope: Scope, status: int, elapsed: float, request_id: str) -> None:
    """The request's duration sample, labelled by its route, and its log line."""
    matched = scope.get("route")
    # only methods the matched route declares are labelled, so requests with any method
    # to any path add at most one `other` per route template
    declared = getattr(matched, "methods", None) or ()
    method = scope["method"] if scope["method"] in declared else "other"
    # the template without its convertors (`{tenant_id}`, not `{tenant_id:path}`), as the
    # OpenAPI document names it
    route = getattr(matched, "path_format", None) or getattr(matched, "path", "unmatched")
    metrics.HTTP_DURATION.labels(route, method, metrics.status_class(status)).observe(elapsed)
    if scope["path"] not in _QUIET_PATHS or status >= 500:
        log.log(logging.WARNING if status >= 500 else logging.INFO, "request", extra={
            "method": scope["method"], "path": scope["path"], "status": status,
            "duration_ms": round(elapsed * 1000, 2), "request_id": request_id})
