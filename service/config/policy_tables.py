"""A policy's sub-tables as the policies file writes them: the cost of a call in points, the
backoff of transient failures, a batch of objects per call, and the confirmation read; each
key, its type, bounds and default (`policy_file.PolicyConfig` holds them).
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.config.answer_rules import parse_path
from service.config.placeholders import REQUEST_FIELDS, template_fields


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CostConfig(_Strict):
    """What a call costs in points: `requested` is taken before it runs; `actual` and
    `available` are paths into the answer's JSON body (service/config/answer_rules.py): the actual
    cost refunds the difference, the upstream's points left lower the shared bucket."""

    requested: float = Field(gt=0, le=1_000_000)
    actual: str | None = Field(default=None, min_length=1, max_length=500)
    available: str | None = Field(default=None, min_length=1, max_length=500)

    @field_validator("actual", "available")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_path(value)
        return value


class BackoffConfig(_Strict):
    """Exponential backoff with full jitter for transient failures and 429s without a date."""

    base_seconds: float = Field(default=1.0, gt=0, le=3600)
    max_seconds: float = Field(default=900.0, gt=0, le=86_400)


MAX_OBJECTS_PER_CALL = 1000


class BatchConfig(_Strict):
    """Many objects of one scope per call: up to `max_objects`, named by {object_ids}.
    `failed`, a path into the answer's JSON body, lists the ids of objects the call did not
    delete (the others did); without it a call succeeds or fails as a whole."""

    max_objects: int = Field(ge=2, le=MAX_OBJECTS_PER_CALL)
    failed: str | None = Field(default=None, min_length=1, max_length=500)

    @field_validator("failed")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_path(value)
        return value


# A confirmation read's statuses that say the object is gone: a few client errors, never
# one that means something else (401/403 credentials, 408 a timeout, 429 a throttle)
MAX_ABSENT_STATUSES: Final = 8
_NOT_ABSENT: Final = frozenset({401, 403, 408, 429})


class ConfirmConfig(_Strict):
    """A confirmation read (service/outcomes.py `classify_confirmation`): after a deletion
    answered success, `method` `path` on the same upstream, with its headers and the
    tenant's credential, must answer one of `absent` before the item is `succeeded`.
    `share` of the policy's items are confirmed, chosen by their operation key."""

    # GET only: our transport reads an answer's body by its length, which a HEAD's lacks
    method: Literal["GET"] = "GET"
    path: str
    absent: list[int] = Field(default_factory=lambda: [404, 410], min_length=1,
                              max_length=MAX_ABSENT_STATUSES)
    share: float = Field(default=1.0, ge=0.0, le=1.0)

    @field_validator("path")
    @classmethod
    def _path_template(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        if "#" in value:
            raise ValueError("must not contain '#' (a fragment is never sent)")
        names = template_fields(value)
        unknown = names - set(REQUEST_FIELDS)
        if unknown:
            raise ValueError(f"unknown placeholder(s) {sorted(unknown)}; allowed: "
                             f"{sorted(REQUEST_FIELDS)}")
        if "object_id" not in names:
            raise ValueError("must contain {object_id}: the read is of the item's object")
        if "object_ids" in names:
            raise ValueError("{object_ids} is a batch's: a confirmation reads one object")
        return value

    @field_validator("absent")
    @classmethod
    def _absent(cls, value: list[int]) -> list[int]:
        for status in value:
            if not 400 <= status <= 499 or status in _NOT_ABSENT:
                raise ValueError(f"{status} cannot mean absent: a client error (400-499) "
                                 f"other than {sorted(_NOT_ABSENT)}, e.g. [404, 410]")
        if len(set(value)) != len(value):
            raise ValueError("a status is listed twice")
        return value


class TracingConfig(_Strict):
    """What this policy's traces may carry beyond ledger ids and outcomes (tracing on:
    docs/operations.md, "Traces"). `object_ids`: the objects a call names, as span
    attributes; `send_traceparent`: the call's trace context in its request's headers (by
    OTEL_PROPAGATORS), for an upstream that joins its own spans to ours."""

    object_ids: bool = False
    send_traceparent: bool = False
