"""What a credential source promises, and what a credential may be.

A credential ends up as (part of) an HTTP header value of an upstream call, so it must be
one httpx sends as given: httpx encodes a header value as ASCII (anything else raises) and
h11 refuses NUL, CR, LF and other whitespace but space and tab, and a value that starts or
ends with whitespace. A credential is therefore printable ASCII (space to tilde), with no
space at either end: refused when it is stored (the API, a file), never at call time.
"""

from __future__ import annotations

import re
from typing import Final, Protocol

MAX_SECRET_CHARS: Final = 8192
# printable ASCII, no space at either end
_HEADER_SAFE: Final = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
# the same rule as a JSON Schema pattern, for the API's contract
HEADER_VALUE_PATTERN: Final = r"^[!-~](?:[ -~]*[!-~])?$"


def secret_problem(value: str) -> str | None:
    """Why `value` cannot be a credential, or None when it can. Never quotes the value."""
    if not value:
        return "must not be empty"
    if len(value) > MAX_SECRET_CHARS:
        return f"must be at most {MAX_SECRET_CHARS} characters"
    if not _HEADER_SAFE.fullmatch(value):
        return ("must be printable ASCII (no control characters, no line breaks) with no "
                "space at either end: it is sent as an HTTP header value")
    return None


class CredentialSource(Protocol):
    """Where a worker finds a tenant's credential for an upstream."""

    async def get(self, tenant_id: str, upstream: str) -> str | None:
        """The credential, or None when the tenant has none (or none that can be used)."""
        ...
