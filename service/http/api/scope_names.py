"""How a scope's name travels in a path: one percent-encoded segment, '/' as %2F."""

from __future__ import annotations

import re
from urllib.parse import unquote

PREFIX = "/v1/scopes/"
_ENCODED_SLASH = re.compile(r"%2f", re.IGNORECASE)


def routing_path(raw_path: bytes) -> str:
    """The path the router sees for a scope route. Scope names hold tenant ids, which may
    contain '/': a name is one path segment, percent-encoded, and an encoded '/' (%2F) is
    part of the name, never a separator. The server decodes %2F like any escape, so here
    the raw path is decoded except for %2F, kept as it is, and '%', kept as %25; the
    route's handler decodes the name once (`scope_name`)."""
    return "%2F".join(unquote(part).replace("%", "%25")
                      for part in _ENCODED_SLASH.split(raw_path.decode("latin-1")))


def scope_name(segment: str) -> str:
    """A scope's name from its path segment as `routing_path` left it."""
    return unquote(segment)
