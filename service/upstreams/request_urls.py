"""Request URLs under an upstream's base URL (`UrlMaker`): the base with a call's rendered
path and query, and for a templated upstream a checked host in place of PROBE_HOST.

For our own transport a plain path and query skip httpx's URL parse: the request carries its
origin's URL, parsed once per host, and its target as bytes in the TARGET request extension
(service/protocols/transport.py). What it saves: bench/reports/design-notes.md, "The wire".
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import urlsplit

import httpx

PROBE_HOST: Final = "sweeper-host.invalid"  # stands for a templated host until a call fills it


# A path httpx would take exactly as it is: ASCII path characters and valid percent escapes
# (no `?`, `#`, spaces or unicode to encode), and no dot segment to normalise away. A query
# likewise (`?` and `/` are plain there).
_PLAIN_PATH: Final = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*")
_PLAIN_QUERY: Final = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*")
_PROBES: Final = (("/probe/a%2Fb/c-d_e~f", None), ("/probe/x", "a=b%26c&d=%3D/?e"))
ORIGINS_KEPT: Final = 4096  # parsed origins (one per templated host) kept for reuse


class UrlMaker:
    """Request URLs under one base URL: the base with a rendered path and query (already
    percent-encoded: service/config/request_templates.py) and, for a templated upstream, a checked
    host in place of PROBE_HOST. Each URL is text httpx.URL parses, through its public
    constructor only (tests/unit/test_private_api.py keeps it so).

    `target` (for our own transport, which reads the request's target from the
    TARGET extension): a plain path and query are not parsed at all; the request carries
    its origin's URL, parsed once per host, and the target as bytes. That a plain path
    goes on the wire exactly as httpx would put it is checked at construction on probes;
    anything else takes the ordinary parse."""

    def __init__(self, base_url: str, *, target: bool = False) -> None:
        self._base_url = base_url
        self._base_path = urlsplit(base_url).path
        before, found, after = base_url.partition(PROBE_HOST)
        self._host_slot = (before, after) if found else None
        self._origins: dict[str | None, httpx.URL] = {}
        self._target = target and all(
            self._target_of(path, query)
            == httpx.URL(self._full(path, query, "probe.example" if found else None)).raw_path
            for path, query in _PROBES)

    @property
    def fixed_host(self) -> bool:
        return self._host_slot is None

    def _base(self, host: str | None) -> str:
        if host is None:
            return self._base_url
        if self._host_slot is None:
            raise ValueError("this base URL has a fixed host")
        return self._host_slot[0] + host + self._host_slot[1]

    def _full(self, path: str, query: str | None, host: str | None) -> str:
        base = self._base(host)
        return base + path if query is None else f"{base}{path}?{query}"

    def _target_of(self, path: str, query: str | None) -> bytes:
        target = self._base_path + path
        return (target if query is None else f"{target}?{query}").encode("ascii")

    def url(self, path: str, *, query: str | None = None, host: str | None = None
            ) -> tuple[httpx.URL, bytes | None]:
        """The URL of `path` and `query` (already rendered and percent-encoded; None: no
        query) under the base URL, with `host` (a checked host name) in place of its own;
        and the request target as bytes where the transport takes it so (then the URL is
        the origin's: the target is the rest)."""
        if self._target and _PLAIN_PATH.fullmatch(path) and "/." not in path and (
                query is None or _PLAIN_QUERY.fullmatch(query)):
            origin = self._origins.get(host)
            if origin is None:
                if len(self._origins) >= ORIGINS_KEPT:
                    self._origins.clear()
                origin = self._origins[host] = httpx.URL(self._base(host))
            return origin, self._target_of(path, query)
        return httpx.URL(self._full(path, query, host)), None
