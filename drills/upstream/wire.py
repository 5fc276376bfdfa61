"""HTTP/1.1 framing on asyncio streams: reading one request, writing one response.

Stdlib only, and by hand rather than through an HTTP library, because the faults need raw
control of the socket (see `drills.upstream.faults`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

MAX_BODY = 1 << 20
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/1\.[01]")


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """Parse one request; None on a clean EOF between requests, `BadRequest` if malformed."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError:
        raise BadRequest(431, "request head too large") from None
    lines = raw.decode("latin-1").lstrip("\r\n").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _VERSION.fullmatch(parts[2]):
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    headers = _headers(lines[1:])
    body = await reader.readexactly(_content_length(headers))
    split = urlsplit(target)
    if not split.path.startswith("/"):
        raise BadRequest(400, "bad request target")
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "close" not in tokens and (version == "HTTP/1.1" or "keep-alive" in tokens)
    return Request(method, split.path, split.query, headers, body, keep)


def _headers(lines: list[str]) -> dict[str, str]:
    """The header fields by lower-case name, repeated ones joined with a comma."""
    headers: dict[str, str] = {}
    for line in lines:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise BadRequest(400, "malformed header line")
        name, value = name.lower(), value.strip(" \t")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


def _content_length(headers: dict[str, str]) -> int:
    """The body's length; BadRequest for a framing this fake does not read."""
    if "transfer-encoding" in headers:
        raise BadRequest(501, "transfer-encoding is not supported")
    length = headers.get("content-length", "0")
    if not re.fullmatch(r"[0-9]+", length):
        raise BadRequest(400, "bad content-length")
    if int(length) > MAX_BODY:
        raise BadRequest(413, "request body too large")
    return int(length)


def response(status: int, headers: Mapping[str, str], body: bytes, *, keep: bool,
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


async def wait_eof(reader: asyncio.StreamReader, seconds: float) -> None:
    """Sleep up to `seconds`, returning early when the peer closes its side."""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
