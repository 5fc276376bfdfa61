"""What request bodies share: strict JSON types, and timestamps as RFC 3339 text."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field


def _rfc3339_text(value: Any) -> Any:
    """A timestamp in a request is RFC 3339 text, as the contract says; a number is not
    silently read as seconds since the epoch."""
    if not isinstance(value, str):
        raise ValueError("must be an RFC 3339 date-time string")
    return value


class RequestBody(BaseModel):
    """Base of request bodies: values must have the JSON type the contract declares (no
    "5" for 5, no 1 for true); timestamps are RFC 3339 strings, parsed leniently."""

    model_config = ConfigDict(strict=True)


Timestamp = Annotated[AwareDatetime, Field(strict=False), BeforeValidator(_rfc3339_text)]
