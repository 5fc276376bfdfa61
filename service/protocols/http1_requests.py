"""A request as service/protocols/transport.py takes it: the request extensions it reads
besides httpx's "timeout", and the request's bytes on the wire.

httpx carries a request's extensions with it down to the transport (`request.extensions`),
the way it carries its timeouts: settings of one request, set by whoever builds it
(https://www.python-httpx.org/advanced/extensions/).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import httpx

from service.protocols.egress import Proxy

# TARGET: its request-target as bytes (path and query), when its URL is its origin's alone
# (service/upstreams/request_urls.py's UrlMaker spares a parse of every call's URL).
TARGET: Final = "sweeper.target"
# SEND_BY: the time.monotonic() moment after which the request must not be written at all.
# A worker spends a rate-limit token only until a tolerance after its moment
# (service/worker/attempts.py); taking a connection, or opening one, can outlast that.
SEND_BY: Final = "sweeper.send_by"
# SEND_GATE: a SendGate asked in the same step that writes the request, with nothing run
# between: False withholds it (a legal hold took the call back: service/worker/hold_gate.py).
SEND_GATE: Final = "sweeper.send_gate"
SendGate = Callable[[], bool]


def request_target(request: httpx.Request) -> bytes:
    """The request-target: the TARGET extension's, or the URL's path and query."""
    target = request.extensions.get(TARGET)
    return target if isinstance(target, bytes) else request.url.raw_path


def absolute_form(data: bytes, url: httpx.URL, path: bytes, proxy: Proxy) -> bytes:
    """A serialized request as an HTTP proxy takes it: the absolute URL as its target, and
    the proxy's credentials."""
    line, _, rest = data.partition(b"\r\n")
    method, _, _ = line.partition(b" ")
    target = url.scheme.encode("ascii") + b"://" + url.netloc + path
    auth = b"" if proxy.authorization is None else (
        b"Proxy-Authorization: " + proxy.authorization + b"\r\n")
    return method + b" " + target + b" HTTP/1.1\r\n" + auth + rest


def closing(data: bytes) -> bytes:
    """A serialized request that also says `Connection: close` (its own Connection header,
    if it had one, is replaced)."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n")
             if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body


async def serialized(request: httpx.Request) -> bytes:
    """The request as bytes on the wire: its request line, its headers as given (Host added
    if missing), and its body, framed by Content-Length unless it says Transfer-Encoding."""
    url = request.url
    headers = request.headers
    stream = request.stream
    body = b"".join(stream) if isinstance(stream, httpx.ByteStream) else await request.aread()
    raw = headers.raw
    if "host" not in headers:
        raw = [(b"Host", url.netloc), *raw]
    chunked = "transfer-encoding" in headers
    if body and not chunked and "content-length" not in headers:
        raw.append((b"Content-Length", str(len(body)).encode("ascii")))
    head = [request.method.encode("ascii"), b" ", request_target(request), b" HTTP/1.1\r\n"]
    for name, value in raw:
        head += (name, b": ", value, b"\r\n")
    head.append(b"\r\n")
    data = b"".join(head)
    # a CR, LF or NUL inside a name, value or the path would end a line early: another
    # header, or another request, smuggled in
    lines = len(raw) + 2
    if data.count(b"\n") != lines or data.count(b"\r") != lines or b"\0" in data:
        raise httpx.LocalProtocolError("a header or the path holds a line break")
    if chunked:
        body = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    return data + body
