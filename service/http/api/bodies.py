"""What request bodies share: JSON read strictly, strict JSON types, no unknown fields,
bounded values, and timestamps as RFC 3339 text within a range both Python and PostgreSQL
can hold."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Annotated, Any, Final

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import AfterValidator, AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field

from service.config.policy_file import NAME_PATTERN
from service.http.api import access
from service.protocols import strict_json

# Every timestamp the API takes lies in this range (inclusive), whatever its offset: any
# instant in it is a valid Python datetime in every offset and a valid PostgreSQL timestamptz.
MIN_TIMESTAMP: Final = datetime(1970, 1, 1, tzinfo=UTC)
MAX_TIMESTAMP: Final = datetime(9999, 12, 31, tzinfo=UTC)
TIMESTAMP_RANGE: Final = (f"{MIN_TIMESTAMP:%Y-%m-%dT%H:%M:%SZ} to "
                          f"{MAX_TIMESTAMP:%Y-%m-%dT%H:%M:%SZ}")

# RFC 3339 section 5.6 date-time (ASCII digits only; `T`/`Z` in either case, as it allows).
_RFC3339: Final = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?"
    r"(?:[Zz]|[+-][0-9]{2}:[0-9]{2})", re.ASCII)

# What an id in a request may be: 1-512 characters, no control characters. The ledger's own
# limit is 512 UTF-8 bytes, checked after validation (a 422 naming the field).
ID_PATTERN: Final = r"^[^\x00-\x1f\x7f-\x9f]*$"
MAX_ID_CHARS: Final = 512
MAX_BIGINT: Final = 2**63 - 1


def _rfc3339_text(value: Any) -> Any:
    """A timestamp is RFC 3339 text, as the contract says: a number, or a string of digits,
    is not silently read as seconds since the epoch."""
    if not isinstance(value, str) or not _RFC3339.fullmatch(value):
        raise ValueError("must be an RFC 3339 date-time such as 2026-12-01T00:00:00Z")
    return value.upper()  # pydantic's parser wants `T` and `Z`


def _in_range(value: datetime) -> datetime:
    """The instant in UTC, once it is known to lie in the range. RFC 3339 allows offsets up
    to 23:59, PostgreSQL only up to 15:59, so no offset travels further than here."""
    # Aware datetimes compare by instant; the comparison itself never overflows.
    if not MIN_TIMESTAMP <= value <= MAX_TIMESTAMP:
        raise ValueError(f"must be from {TIMESTAMP_RANGE}")
    return value.astimezone(UTC)


def _integral(value: Any) -> Any:
    """JSON Schema counts 5.0 an integer; so does the API (but never true, or "5")."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class RequestBody(BaseModel):
    """Base of request bodies: values must have the JSON type the contract declares (no
    "5" for 5, no 1 for true), and a field the contract does not declare is refused, never
    ignored (a misspelt `dry_run` must not start a real deletion)."""

    model_config = ConfigDict(strict=True, extra="forbid")


Timestamp = Annotated[
    AwareDatetime, Field(strict=False, description=f"RFC 3339, from {TIMESTAMP_RANGE}"),
    BeforeValidator(_rfc3339_text), AfterValidator(_in_range)]
JsonInt = BeforeValidator(_integral)
"""Put on an int field of a request body: accepts 5.0 as 5, as JSON Schema does. Bounds go
before it, `Annotated[int, Field(ge=1), JsonInt]`: after it, or on an optional field's
Field, pydantic writes them as `ge`/`le`, which JSON Schema does not know."""
PolicyName = Annotated[str, Field(min_length=1, max_length=63, pattern=NAME_PATTERN,
                                  examples=["cart-retention"])]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]


def parse_json(body: bytes) -> Any:
    """A request body's JSON, read by strict_json: refusals are JSONDecodeError, which
    FastAPI answers as invalid JSON (400 malformed-json, the reason in its detail)."""
    try:
        return strict_json.loads(body)
    except strict_json.NotJson as exc:
        raise json.JSONDecodeError(str(exc), "", 0) from None


class JsonRequest(Request):
    """A request whose JSON body is read by `parse_json`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class JsonRoute(APIRoute):
    """The route class of every operator router: the caller's role is checked against the
    route's (service/http/api/access.py) before its body is read by `parse_json`."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        extra, responses = access.documented(self.access)
        self.openapi_extra = {**(self.openapi_extra or {}), **extra}
        self.responses = {**self.responses, **responses}

    @property
    def access(self) -> access.Access:
        """What this route needs (every operator route serves one method)."""
        (method,) = self.methods or ("GET",)
        return access.needed(method, self.path)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        need = self.access

        async def strictly(request: Request) -> Response:
            access.check(need, request.scope)
            return await handler(JsonRequest(request.scope, request.receive))

        return strictly
