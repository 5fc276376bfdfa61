"""The gate every request passes before routing: what a caller can cost the process before
it has proved who it is, and how much it may send.

For the operator API (`/v1/*` except the webhooks, which authenticate by signature over the
body they read themselves):
    1. the bearer token is checked first: an unauthenticated request is answered 401 from
       its headers alone, before any body is read or parsed; the token's role is checked
       against the route's after routing, before the body is parsed (service/http/api/access.py);
    2. the body is read in full, bounded in size (413, refused at once when Content-Length
       says so) and in time (408), and must be UTF-8 (400 `malformed-json`), before the route
       parses it.
    3. a scope route's path keeps an encoded '/' in the scope's name (`scope_names.routing_path`).
`POST /v1/webhooks/{source}` goes straight to its endpoint (`webhooks` below, the route's
`direct`), past the router: the storefronts' traffic pays for no routing it does not need.
For every path: HEAD is answered as GET without the body, OPTIONS with the methods the
path allows.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Awaitable, Callable
from typing import Final, Literal

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import Problem
from service.http.api import scope_names
from service.http.api.methods import allow_header
from service.http.api.problems import problem_response
from service.runtime import Runtime

CALLER: Final = "sweeper.caller"  # the scope key holding the authenticated token (Caller)
OPERATOR_PREFIX: Final = "/v1/"
WEBHOOK_PREFIX: Final = "/v1/webhooks/"
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CHALLENGE: Final = {"WWW-Authenticate": 'Bearer realm="sweeper"'}
# a webhook source's endpoint, called with the source's name from the path
WebhookEndpoint = Callable[[Scope, Receive, Send, str], Awaitable[None]]


def unauthorized(detail: str) -> Problem:
    """The 401 every operator route answers without a valid token."""
    return Problem(401, "unauthorized", "Authentication required", detail, headers=CHALLENGE)


BodyRefusal = Literal["bad-length", "too-large", "too-slow", "gone"]


class BodyRefused(Exception):
    """A body not read: its Content-Length is no number, it passed the size limit, it did
    not arrive in time, or the client went away. `detail` is for the caller's answer."""

    def __init__(self, reason: BodyRefusal, detail: str) -> None:
        super().__init__(detail)
        self.reason: BodyRefusal = reason
        self.detail = detail


async def read_body(scope: Scope, receive: Receive, *, limit: int, timeout_s: float) -> bytes:
    """The whole body from the ASGI stream, within `timeout_s`, refused as soon as it passes
    `limit` bytes (at once when Content-Length says it will); raises BodyRefused."""
    declared = _header(scope, b"content-length")
    if declared is not None:
        length = content_length(declared)
        if length is None:
            raise BodyRefused("bad-length", "Content-Length is not a number")
        if length > limit:
            raise BodyRefused("too-large", f"the body may be at most {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise BodyRefused("gone", "the client went away mid-body")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise BodyRefused("too-large", f"the body may be at most {limit} bytes")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise BodyRefused("too-slow", f"the body must arrive within {timeout_s:g} s") from None


# how the operator API answers each refusal ("gone" has no one to answer)
_BODY_ANSWERS: Final[dict[BodyRefusal, tuple[int, str, str]]] = {
    "bad-length": (400, "bad-request", "Bad request"),
    "too-large": (413, "payload-too-large", "Payload too large"),
    "too-slow": (408, "request-timeout", "Request body too slow"),
}


class Gate:
    """Pure ASGI middleware in front of the routes; see the module docstring."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, body_timeout_s: float,
                 webhooks: WebhookEndpoint | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.webhooks = webhooks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        source = self._webhook_source(scope)
        if source is not None and self.webhooks is not None:
            await self.webhooks(scope, receive, send, source)
            return
        path: str = scope["path"]
        if path.startswith(OPERATOR_PREFIX) and not path.startswith(WEBHOOK_PREFIX):
            admitted = await self._admit(scope, receive, send)
            if admitted is None:
                return  # answered, or the client went away
            receive = admitted
        await self._route(scope, receive, send)

    def _webhook_source(self, scope: Scope) -> str | None:
        """The source a delivery names, when it goes straight to its endpoint."""
        path: str = scope["path"]
        if (self.webhooks is None or scope["method"] != "POST"
                or not path.startswith(WEBHOOK_PREFIX)):
            return None
        source = path[len(WEBHOOK_PREFIX):]
        return source if source and "/" not in source else None  # what {source} matches

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """An operator request authenticated and its body read: the receive the routes read
        the body from, or None when the request was answered here (or its client left)."""
        runtime: Runtime = scope["state"]["runtime"]
        token = _bearer(scope)
        caller = runtime.tokens.match(token) if token else None
        if caller is None:
            await _answer(unauthorized("send Authorization: Bearer <token>" if token is None
                                       else "the bearer token is not valid"),
                          scope, receive, send)
            return None
        scope[CALLER] = caller
        if scope["path"].startswith(scope_names.PREFIX) and "raw_path" in scope:
            scope["path"] = scope_names.routing_path(scope["raw_path"])
        if scope["method"] not in _BODY_METHODS:
            return receive
        read = await self._read_body(scope, receive)
        if isinstance(read, Problem):
            await _answer(read, scope, receive, send)
        return _replay(read, receive) if isinstance(read, bytes) else None

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """To the routes; OPTIONS answered with the methods the path allows, HEAD routed as
        GET where the path allows GET."""
        method = scope["method"]
        allowed = (scope["app"].state.route_methods.allowed(scope)
                   if method in ("HEAD", "OPTIONS") else set[str]())
        if method == "OPTIONS" and allowed:
            await _answer(None, scope, receive, send, status=204,
                          headers={"Allow": allow_header(allowed)})
        elif method == "HEAD" and "GET" in allowed:
            # the routes see GET; the server's own scope still says HEAD, so it sends no
            # body. The matched route is copied back for the request log.
            inner = {**scope, "method": "GET"}
            try:
                await self.app(inner, receive, send)
            finally:
                scope["route"] = inner.get("route")
        else:
            await self.app(scope, receive, send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | Problem | None:
        """The whole body, or the Problem that refuses it, or None if the client left."""
        try:
            body = await read_body(scope, receive, limit=self.max_body_bytes,
                                   timeout_s=self.body_timeout_s)
        except BodyRefused as exc:
            if exc.reason == "gone":
                return None
            return Problem(*_BODY_ANSWERS[exc.reason], exc.detail)
        try:
            body.decode("utf-8")  # RFC 8259: JSON exchanged between systems is UTF-8
        except UnicodeDecodeError:
            return Problem(400, "malformed-json", "Request body is not valid JSON",
                           "the body is not UTF-8 text")
        return body


_DIGITS: Final = re.compile(r"[0-9]+", re.ASCII)


def content_length(value: str) -> int | None:
    """A Content-Length value (RFC 9110: 1*DIGIT, ASCII only), or None when it is none;
    thousands of digits are not converted (any such length is over every limit)."""
    value = value.strip()
    if not _DIGITS.fullmatch(value):
        return None
    return int(value) if len(value) <= 30 else sys.maxsize


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _bearer(scope: Scope) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if any."""
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then waits on the client."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(problem: Problem | None, scope: Scope, receive: Receive, send: Send, *,
                  status: int = 0, headers: dict[str, str] | None = None) -> None:
    """Answer without routing: a problem, or an empty response."""
    response = (problem_response(problem, Request(scope)) if problem is not None
                else Response(status_code=status, headers=headers))
    await response(scope, receive, send)
