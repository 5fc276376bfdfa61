"""A fake commercetools Composable Commerce HTTP API: ``DELETE
/{projectKey}/customers/{id}?version=N`` with optimistic concurrency.

Documentation followed:

- https://docs.commercetools.com/learning-composable-commerce-developer-essentials/manage-resources-with-the-sdk/delete-a-customer
  (``DELETE https://api.{region}.commercetools.com/{projectKey}/customers/...?version={version}``
  with ``Authorization: Bearer``; the SDK returns the deleted Customer)
- the API's RAML, https://github.com/commercetools/commercetools-api-reference
  (``traits/versioned.raml``: ``version`` is a required int64 query parameter;
  ``traits/errorable.raml``: 400 ``InvalidInput`` for missing or malformed parameters, 401, 404
  ``ResourceNotFound``, 409, 500 ``General``, 502 when scaling, 503 ``OverCapacity``)
- https://docs.commercetools.com/api/errors (``ErrorResponse``: ``statusCode``, ``message``,
  ``errors: [{code, message, ...}]``; ``AuthErrorResponse`` adds OAuth's ``error``, e.g.
  ``{"statusCode": 401, "message": "invalid_token", "errors": [{"code": "invalid_token",
  "message": "invalid_token"}], "error": "invalid_token"}``; ``ConcurrentModification``:
  "Object $resourceId has a different version than expected. Expected: $expectedVersion -
  Actual: $currentVersion." with ``currentVersion``)
- https://dev.commercetools.com/http-api-errors.html (409: the resource was modified since the
  client last read it; the body carries ``currentVersion`` whenever possible)
- https://docs.commercetools.com/api/error-handling (timeouts and retries; no request-rate limit
  is published for the HTTP API)

The docs publish no request-rate limit, so the fake's is off by default; when set it answers
429 (or, as the docs describe load, 503 ``OverCapacity``) in the ``ErrorResponse`` shape.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from drills.vendors import Exchange, Refused, TokenBucket, VendorFake, json_response

__all__ = ["FakeCommercetools"]


@dataclass(slots=True)
class _Customer:
    version: int
    created: str
    modified: str


@dataclass(slots=True)
class _Project:
    token: str
    customers: dict[str, _Customer] = field(default_factory=dict)
    bucket: TokenBucket | None = None
    limited_status: int = 429


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _errors(status: int, code: str, message: str, headers: dict[str, str] | None = None,
            **extra: Any) -> Response:
    return json_response(status, {"statusCode": status, "message": message,
                                  "errors": [{"code": code, "message": message, **extra}]},
                         headers)


def _limited(status: int) -> Response:
    """The answer past a project's rate limit, in the status it was set to answer."""
    if status == 503:
        return _errors(503, "OverCapacity", "Service is over capacity. Please retry later.")
    # no documented 429 code for this API: the ErrorResponse shape, a plain code
    return _errors(429, "TooManyRequests", "Too many requests. Please retry later.",
                   {"Retry-After": "1"})


def _expected_version(raw: str | None) -> int:
    """The `version` a deletion must name; Refused (invalid) when it is missing or no
    integer."""
    if raw is None or not raw.lstrip("-").isdigit():
        # InvalidInput as errorable.raml lists it; the wording is the fake's (docs silent)
        message = ("Missing version number" if raw is None
                   else f"Invalid version number '{raw}'")
        raise Refused("invalid", _errors(400, "InvalidInput", message))
    return int(raw)


class FakeCommercetools(VendorFake):
    """Projects by key, each with its bearer token and customers (id -> version)."""

    def __init__(self, *, record_calls: bool = True) -> None:
        self._projects: dict[str, _Project] = {}
        super().__init__(record_calls=record_calls)

    def _build_app(self) -> Starlette:
        return Starlette(routes=[Route("/{project_key}/customers/{customer_id}",
                                       self._route(self._delete), methods=["DELETE"])])

    # ----------------------------------------------------------------- test API
    def add_project(self, project_key: str, token: str) -> None:
        self._projects[project_key] = _Project(token)

    def add_customers(self, project_key: str, ids: Iterable[str], version: int = 1) -> None:
        stamp = _now_iso()
        for customer_id in ids:
            self._projects[project_key].customers[customer_id] = _Customer(version, stamp, stamp)

    def bump_version(self, project_key: str, customer_id: str, by: int = 1) -> int:
        """A concurrent update of the customer; its new version."""
        customer = self._projects[project_key].customers[customer_id]
        customer.version += by
        customer.modified = _now_iso()
        return customer.version

    def version(self, project_key: str, customer_id: str) -> int | None:
        customer = self._projects[project_key].customers.get(customer_id)
        return None if customer is None else customer.version

    def customers(self, project_key: str) -> dict[str, int]:
        return {i: c.version for i, c in self._projects[project_key].customers.items()}

    def set_rate_limit(self, project_key: str, per_second: float | None,
                       burst: int | None = None, *, status: int = 429) -> None:
        """`per_second` requests per second (bursts of `burst`) answered `status` (429 or 503)
        beyond it; None (the default) is unlimited, as the docs publish no limit."""
        if status not in (429, 503):
            raise ValueError("status must be 429 or 503")
        project = self._projects[project_key]
        project.limited_status = status
        project.bucket = None if per_second is None else TokenBucket(
            per_second, burst or max(1.0, per_second), time.monotonic())

    # ----------------------------------------------------------------- the API
    def _fault_response(self, status: int) -> Response:
        if status == 503:
            return _errors(503, "OverCapacity", "Service is over capacity. Please retry later.")
        if status == 502:
            return _errors(502, "BadGateway", "Bad gateway. Please retry later.")
        if status >= 500:
            return _errors(status, "General", "An unexpected error occurred.")
        return _errors(status, "InvalidOperation", "Injected fault.")

    async def _delete(self, request: Request, raw: bytes, ex: Exchange) -> Response:
        project_key = request.path_params["project_key"]
        project = self._projects.get(project_key)
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if project is None or scheme.lower() != "bearer" or token.strip() != project.token:
            # AuthErrorResponse as the errors page shows it; a token for another project is
            # just as invalid for this one
            raise Refused("unauthorized", json_response(401, {
                "statusCode": 401, "message": "invalid_token",
                "errors": [{"code": "invalid_token", "message": "invalid_token"}],
                "error": "invalid_token"}))
        ex.tenant = project_key
        fault = await self._take_fault(ex)
        if fault is not None:
            return fault
        if project.bucket is not None and not project.bucket.take(1.0, ex.at):
            raise Refused("throttled", _limited(project.limited_status))
        expected = _expected_version(request.query_params.get("version"))
        customer_id = request.path_params["customer_id"]
        customer = project.customers.get(customer_id)
        if customer is None:
            raise Refused("not_found", _errors(
                404, "ResourceNotFound", f"The Resource with ID '{customer_id}' was not found."))
        if customer.version != expected:
            raise Refused("conflict", _errors(
                409, "ConcurrentModification",
                f"Object {customer_id} has a different version than expected. "
                f"Expected: {expected} - Actual: {customer.version}.",
                currentVersion=customer.version))
        del project.customers[customer_id]
        # the Customer as it was; a minimal one (no email or names were ever set here)
        return json_response(200, {
            "id": customer_id, "version": customer.version,
            "versionModifiedAt": customer.modified, "createdAt": customer.created,
            "lastModifiedAt": customer.modified, "email": f"{customer_id}@example.com",
            "addresses": [], "shippingAddressIds": [], "billingAddressIds": [],
            "isEmailVerified": False, "customerGroupAssignments": [], "stores": [],
            "authenticationMode": "Password"})
