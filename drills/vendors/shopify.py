"""A fake Shopify GraphQL Admin API: the ``customerDelete`` mutation, under Shopify's
calculated-query-cost leaky bucket.

Documentation followed:

- https://shopify.dev/docs/api/admin-graphql (``POST /admin/api/{version}/graphql.json``, the
  ``X-Shopify-Access-Token`` header)
- https://shopify.dev/docs/api/admin-graphql/latest/mutations/customerDelete and
  https://shopify.dev/docs/api/admin-graphql/latest/input-objects/CustomerDeleteInput
  (``input.id``, the docs' own example sends ``variables.id`` into ``input: {id: $id}``)
- https://shopify.dev/docs/api/admin-graphql/latest/payloads/CustomerDeletePayload
  (``deletedCustomerId: ID``, ``userErrors: [UserError!]!``)
- https://shopify.dev/docs/api/shop-users/latest/objects/UserError and the Admin API's
  ``DisplayableError`` (a ``UserError`` has ``field: [String!]`` and ``message: String!``, and
  no ``code``: the typed ``*UserError`` objects that have one are other mutations')
- https://shopify.dev/docs/apps/build/apis/graphql-admin/rate-limits,
  https://shopify.dev/docs/api/usage/rate-limits and https://shopify.dev/docs/api/usage/limits
  (a leaky bucket per app and store; the Standard plan restores 100 points/s; the requested
  cost must be available before a query runs and the difference to the actual cost is
  refunded; ``extensions.cost.throttleStatus``)
- what the API answers when throttled (HTTP 200, ``errors[].extensions.code`` ``THROTTLED``,
  ``actualQueryCost: null``) and over the single-query maximum of 1,000 points
  (``MAX_COST_EXCEEDED``), as quoted in
  https://community.shopify.com/t/graphql-admin-api-example-throttled-requests-response/8456
- https://shopify.dev/docs/api/usage/response-codes (400 for a body that is not understood or
  not ``application/json``; 401 for missing or wrong credentials)

A shop is a loopback address: the Host header (without its port) names it, as
``{shop}.myshopify.com`` does. One token per shop, so one app and one bucket per shop.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from drills.vendors import (
    Exchange,
    Refused,
    TokenBucket,
    VendorFake,
    host_without_port,
    json_response,
    parse_json,
)

__all__ = ["FakeShopify", "Spend"]

# Shopify's answer to a missing or wrong access token (its REST and GraphQL Admin APIs alike)
INVALID_TOKEN = ("[API] Invalid API key or access token "  # noqa: S105 - an error text
                 "(unrecognized login or wrong password)")
THROTTLE_DOCS = "https://shopify.dev/api/usage/rate-limits"
MISSING_QUERY = "Required parameter missing or invalid"
# The docs give Standard's restore rate (100 points/s) but the bucket size only by example; the
# bucket has been 20 s of restore on every plan (1,000 at 50/s before, 2,000 at 100/s now).
STANDARD_BUCKET = 2000.0
STANDARD_RESTORE = 100.0
MUTATION_COST = 10  # every mutation's requested cost
SINGLE_QUERY_MAX = 1000

_GID = re.compile(r"gid://shopify/([A-Za-z]+)/(\d+)\Z")
_LITERAL_ID = re.compile(r'"(gid://shopify/Customer/\d+)"')


class Spend(NamedTuple):
    """Points a call took from a shop's bucket (its actual cost), and when."""

    at: float
    points: int
    shop: str


@dataclass(slots=True)
class _Shop:
    token: str
    bucket: TokenBucket
    customers: set[str] = field(default_factory=set)


def customer_gid(customer: int | str) -> str:
    text = str(customer)
    return text if text.startswith("gid://") else f"gid://shopify/Customer/{text}"


class FakeShopify(VendorFake):
    """Shops by host, each with its token, customers and cost bucket.

    Costs: each ``customerDelete`` requests `requested_cost` points; it then costs
    `actual_cost` (default: the requested cost, as a mutation's does) or, for a customer that
    does not exist, `actual_cost_not_found` (default: `actual_cost`).
    """

    def __init__(self, *, maximum_available: float = STANDARD_BUCKET,
                 restore_rate: float = STANDARD_RESTORE, requested_cost: int = MUTATION_COST,
                 actual_cost: int | None = None, actual_cost_not_found: int | None = None,
                 record_calls: bool = True) -> None:
        self._shops: dict[str, _Shop] = {}
        self.maximum_available, self.restore_rate = maximum_available, restore_rate
        self.set_costs(requested_cost, actual_cost, actual_cost_not_found)
        self.spent: list[Spend] = []
        super().__init__(record_calls=record_calls)

    def _build_app(self) -> Starlette:
        return Starlette(routes=[Route("/admin/api/{version}/graphql.json",
                                       self._route(self._graphql), methods=["POST"])])

    # ----------------------------------------------------------------- test API
    def add_shop(self, host: str, token: str, *, maximum_available: float | None = None,
                 restore_rate: float | None = None) -> None:
        """A shop served at `host` (e.g. ``127.0.0.2``), its bucket full."""
        self._shops[host] = _Shop(token, TokenBucket(
            restore_rate or self.restore_rate, maximum_available or self.maximum_available,
            time.monotonic()))

    def set_limits(self, host: str, *, maximum_available: float | None = None,
                   restore_rate: float | None = None, currently_available: float | None = None
                   ) -> None:
        """Change a shop's bucket (size, restore rate, or its level now)."""
        bucket = self._shops[host].bucket
        bucket.level(time.monotonic())
        if maximum_available is not None:
            bucket.capacity = float(maximum_available)
        if restore_rate is not None:
            bucket.rate = float(restore_rate)
        if currently_available is not None:
            bucket.tokens = float(currently_available)
        bucket.tokens = min(bucket.tokens, bucket.capacity)

    def set_costs(self, requested: int = MUTATION_COST, actual: int | None = None,
                  actual_not_found: int | None = None) -> None:
        actual = requested if actual is None else actual
        not_found = actual if actual_not_found is None else actual_not_found
        if requested < 0 or not 0 <= actual <= requested or not 0 <= not_found <= requested:
            raise ValueError("costs must be >= 0 and actual costs at most the requested cost")
        self.requested_cost, self.actual_cost, self.actual_cost_not_found = (
            requested, actual, not_found)

    def add_customers(self, host: str, ids: Iterable[int | str]) -> None:
        """Customers of the shop, by number or ``gid://shopify/Customer/N``."""
        self._shops[host].customers.update(customer_gid(i) for i in ids)

    def customers(self, host: str) -> set[str]:
        """The customers (gids) the shop still has."""
        return set(self._shops[host].customers)

    def available(self, host: str) -> float:
        """Points in the shop's bucket now."""
        return self._shops[host].bucket.level(time.monotonic())

    def points_spent(self, start: float, end: float, host: str | None = None) -> int:
        """Points spent by calls that arrived in [start, end) (time.monotonic())."""
        return sum(s.points for s in self.spent
                   if start <= s.at < end and (host is None or s.shop == host))

    # ----------------------------------------------------------------- the API
    def _fault_response(self, status: int) -> Response:
        # Shopify's own error bodies are {"errors": "<text>"} (see INVALID_TOKEN); a 5xx from
        # its edge may be HTML, which a client must survive anyway: this fake stays JSON.
        return json_response(status, {"errors": _REASONS.get(status, "Error")})

    async def _graphql(self, request: Request, raw: bytes, ex: Exchange) -> Response:
        host = host_without_port(request.headers.get("host", ""))
        shop = self._shops.get(host)
        ctype = request.headers.get("content-type", "")
        ex.body = raw.decode("utf-8", "replace") if "graphql" in ctype else parse_json(raw)
        if shop is None:
            # no such shop: Shopify answers its "Not Found" page (docs silent on the body)
            raise Refused("not_found", json_response(404, {"errors": "Not Found"}))
        ex.tenant = host
        if request.headers.get("x-shopify-access-token") != shop.token:
            raise Refused("unauthorized", json_response(401, {"errors": INVALID_TOKEN}))
        fault = await self._take_fault(ex)
        if fault is not None:
            return fault
        gid = self._customer_to_delete(ex.body, ctype)
        return self._delete(shop, host, gid, ex)

    def _customer_to_delete(self, body: Any, ctype: str) -> str:
        """The gid a valid ``customerDelete`` names; Refused (invalid) as Shopify answers a
        request it cannot run, before any cost is taken."""
        query, variables = self._operation(body, ctype)
        if query is None:
            # what Shopify answers to a body without a usable "query" (its clients report
            # "(400 Bad Request) query: Required parameter missing or invalid")
            raise _invalid(400, {"errors": {"query": MISSING_QUERY}})
        if "customerDelete" not in query:
            # the fake knows one mutation; a real schema error reads the same way
            raise _invalid(200, {"errors": [{
                "message": "This fake serves only the customerDelete mutation",
                "extensions": {"code": "undefinedField"}}]})
        gid, problem = self._customer_id(query, variables)
        if problem is not None:
            # variables are checked before the query runs: no cost is taken (docs silent on
            # the exact text; this is the shape of GraphQL's variable errors)
            raise _invalid(200, {"errors": [{
                "message": "Variable $input of type CustomerDeleteInput! was provided invalid "
                           f"value for id ({problem})",
                "extensions": {"value": variables, "problems": [
                    {"path": ["id"], "explanation": problem}]}}]})
        requested = self.requested_cost
        if requested > SINGLE_QUERY_MAX:
            raise _invalid(200, {"errors": [{
                "message": f"Query cost is {requested}, which exceeds the single query max "
                           f"cost limit ({SINGLE_QUERY_MAX}).",
                "extensions": {"code": "MAX_COST_EXCEEDED", "cost": requested,
                               "maxCost": SINGLE_QUERY_MAX, "documentation": THROTTLE_DOCS}}]})
        return gid

    def _delete(self, shop: _Shop, host: str, gid: str, ex: Exchange) -> Response:
        """The mutation run under the shop's bucket: the requested cost taken first (or
        THROTTLED), the difference to the actual cost refunded."""
        requested, bucket = self.requested_cost, shop.bucket
        if not bucket.take(requested, ex.at):
            raise Refused("throttled", json_response(200, {
                "errors": [{"message": "Throttled", "extensions": {
                    "code": "THROTTLED", "documentation": THROTTLE_DOCS}}],
                "extensions": {"cost": self._cost(bucket, requested, None)}}))
        if gid in shop.customers:
            shop.customers.discard(gid)
            actual = self.actual_cost
            payload: dict[str, Any] = {"deletedCustomerId": gid, "userErrors": []}
        else:
            ex.outcome = "not_found"
            actual = self.actual_cost_not_found
            # docs silent on the message; this is what the admin shows for a missing customer
            payload = {"deletedCustomerId": None,
                       "userErrors": [{"field": ["id"], "message": "Customer can't be found"}]}
        bucket.give(requested - actual)
        self.spent.append(Spend(ex.at, actual, host))
        return json_response(200, {"data": {"customerDelete": payload},
                                   "extensions": {"cost": self._cost(bucket, requested, actual)}})

    @staticmethod
    def _operation(body: Any, ctype: str) -> tuple[str | None, dict[str, Any]]:
        """The query text and variables, or None when the body has no usable query."""
        if "graphql" in ctype:  # application/graphql: the body is the query itself
            return (body if isinstance(body, str) and body.strip() else None), {}
        if "json" not in ctype or not isinstance(body, dict):
            return None, {}
        query, variables = body.get("query"), body.get("variables")
        if not isinstance(query, str) or not query.strip():
            return None, {}
        return query, variables if isinstance(variables, dict) else {}

    @staticmethod
    def _customer_id(query: str, variables: dict[str, Any]) -> tuple[str, str | None]:
        """The customer's gid, or a problem with it."""
        value: Any = None
        inp = variables.get("input")
        if isinstance(inp, dict):
            value = inp.get("id")
        if value is None:
            value = variables.get("id")
        if value is None:
            literal = _LITERAL_ID.search(query)
            if literal is None:
                return "", "Expected value to not be null"
            value = literal.group(1)
        if not isinstance(value, str) or _GID.match(value) is None:
            return "", f"Invalid global id '{value}'"
        return value, None

    @staticmethod
    def _cost(bucket: TokenBucket, requested: int, actual: int | None) -> dict[str, Any]:
        return {"requestedQueryCost": requested, "actualQueryCost": actual,
                "throttleStatus": {"maximumAvailable": bucket.capacity,
                                   "currentlyAvailable": int(bucket.tokens),
                                   "restoreRate": bucket.rate}}


def _invalid(status: int, payload: Any) -> Refused:
    return Refused("invalid", json_response(status, payload))


_REASONS = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout", 429: "Exceeded 2 calls per second for api client. "
            "Reduce request rates to resume uninterrupted service."}
