"""A fake BigCommerce Customers v3 API: bulk ``DELETE /stores/{store_hash}/v3/customers?id:in=``
under a per-store request quota.

Documentation followed:

- https://docs.bigcommerce.com/developer/api-reference/rest/admin/management/customers/v3/delete-customers
  and its OpenAPI source, https://github.com/bigcommerce/docs/blob/main/reference/customers.v3.yml
  (``X-Auth-Token``; the required ``id:in`` is a comma-separated list of integers; 204 on
  success; "A query is required to delete customers. If not provided, a 204 is returned, with no
  changes to the data."; 422 when ``id:in`` is not valid, with the ``Error`` body
  ``{status, title, type, errors}``)
- https://developer-beta.bigcommerce.com/docs/start/best-practices/api-rate-limits,
  https://docs.bigcommerce.com/developer/docs/overview/api-fundamentals/rate-limits and
  https://developer.bigcommerce.com/resource-hub/navigating-bigcommerces-api-rate-limits-update
  (each request
  uses one unit of a store's quota, shared by every app of the store, refreshed every 30 s;
  Plus & Standard 150 per 30 s, Pro 450 per 30 s; 429 once the quota is used up)
- the response headers every REST reference page lists, e.g.
  https://docs.bigcommerce.com/developer/api-reference/rest/admin/content/page-widgets/get-page-widgets
  (``X-Rate-Limit-Time-Window-Ms``: the window's size; ``X-Rate-Limit-Time-Reset-Ms``: the
  milliseconds left in it; ``X-Rate-Limit-Requests-Left``: requests left in it;
  ``X-Rate-Limit-Requests-Quota``: the window's quota; a rate-limited answer carries the seconds
  until the quota refreshes, sent here as ``X-Retry-After``)
- https://developer.bigcommerce.com/api-docs/getting-started/api-status-codes (204 for DELETE;
  401 for missing or invalid credentials; 429)

The docs give no maximum number of ids per delete call: by default there is none (configurable,
answered 413 like the Customers API's documented item limits on create and update).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from drills.vendors import Exchange, Refused, VendorFake, json_response

__all__ = ["Deletion", "FakeBigCommerce"]

STATUS_CODES_DOC = "https://developer.bigcommerce.com/api-docs/getting-started/api-status-codes"
STANDARD_QUOTA = 150
STANDARD_WINDOW_S = 30.0


class Deletion(NamedTuple):
    """One accepted delete call: the ids it named and those that existed (now deleted)."""

    at: float
    store: str
    requested: tuple[int, ...]
    deleted: tuple[int, ...]


@dataclass(slots=True)
class _Store:
    token: str
    quota: int
    window_s: float
    customers: set[int] = field(default_factory=set)
    window_end: float = 0.0
    used: int = 0


def _error(status: int, title: str, errors: dict[str, str] | None = None,
           headers: dict[str, str] | None = None) -> Response:
    """BigCommerce's v3 ``Error`` body."""
    return json_response(status, {"status": status, "title": title, "type": STATUS_CODES_DOC,
                                  "errors": errors or {}}, headers)


class FakeBigCommerce(VendorFake):
    """Stores by hash, each with its token, customers (integer ids) and quota window."""

    def __init__(self, *, quota: int = STANDARD_QUOTA, window_s: float = STANDARD_WINDOW_S,
                 max_ids_per_call: int | None = None, record_calls: bool = True) -> None:
        self.quota, self.window_s, self.max_ids_per_call = quota, window_s, max_ids_per_call
        self._stores: dict[str, _Store] = {}
        self.deletions: list[Deletion] = []
        super().__init__(record_calls=record_calls)

    def _build_app(self) -> Starlette:
        return Starlette(routes=[Route("/stores/{store_hash}/v3/customers",
                                       self._route(self._delete), methods=["DELETE"])])

    # ----------------------------------------------------------------- test API
    def add_store(self, store_hash: str, token: str, *, quota: int | None = None,
                  window_s: float | None = None) -> None:
        self._stores[store_hash] = _Store(token, quota or self.quota, window_s or self.window_s)

    def set_limits(self, store_hash: str, *, quota: int | None = None,
                   window_s: float | None = None) -> None:
        """Change a store's quota or window; its current window starts over."""
        store = self._stores[store_hash]
        store.quota = quota or store.quota
        store.window_s = window_s or store.window_s
        store.window_end, store.used = 0.0, 0

    def add_customers(self, store_hash: str, ids: Iterable[int]) -> None:
        self._stores[store_hash].customers.update(int(i) for i in ids)

    def customers(self, store_hash: str) -> set[int]:
        return set(self._stores[store_hash].customers)

    @property
    def ids_deleted(self) -> int:
        return sum(len(d.deleted) for d in self.deletions)

    # ----------------------------------------------------------------- the API
    def _fault_response(self, status: int) -> Response:
        return _error(status, _REASONS.get(status, "Error"))

    async def _delete(self, request: Request, raw: bytes, ex: Exchange) -> Response:
        name = request.path_params["store_hash"]
        store = self._stores.get(name)
        # a store the token does not belong to is told apart from a bad token by nothing the
        # docs show: both are 401 here
        if store is None or request.headers.get("x-auth-token") != store.token:
            raise Refused("unauthorized", _error(401, "Unauthorized"))
        ex.tenant = name
        fault = await self._take_fault(ex)
        if fault is not None:
            return fault
        allowed, headers = self._quota(store, ex.at)
        if not allowed:
            raise Refused("throttled", _error(429, "Too Many Requests", headers=headers))
        values = request.query_params.getlist("id:in")
        if values:  # documented: no query, no change, 204
            ids = self._ids(values, headers)
            deleted = tuple(i for i in dict.fromkeys(ids) if i in store.customers)
            store.customers.difference_update(deleted)
            self.deletions.append(Deletion(ex.at, name, tuple(ids), deleted))
            if not deleted:
                ex.outcome = "not_found"  # still a 204: ids that do not exist are not an error
        return Response(status_code=204, headers=headers)

    def _ids(self, values: list[str], headers: dict[str, str]) -> list[int]:
        """The ids of the `id:in` filter; Refused (invalid) for one that is no integer, or
        more than max_ids_per_call of them."""
        ids: list[int] = []
        for part in ",".join(values).split(","):
            part = part.strip()
            if not part.isdigit():
                # 422 as documented; the title's wording is not (docs silent)
                raise Refused("invalid", _error(422, "The filter(s): id:in are not valid.",
                                                {"id:in": f"'{part}' is not an integer"},
                                                headers))
            ids.append(int(part))
        if self.max_ids_per_call is not None and len(ids) > self.max_ids_per_call:
            raise Refused("invalid", _error(
                413, "The request payload is too large. The maximum number of items allowed "
                f"in the array is {self.max_ids_per_call}.", headers=headers))
        return ids

    @staticmethod
    def _quota(store: _Store, now: float) -> tuple[bool, dict[str, str]]:
        """Take a unit of the store's quota; whether one was left, and the headers to send.
        The window is fixed: it starts with the first request after the last one ended."""
        if now >= store.window_end:
            store.window_end, store.used = now + store.window_s, 0
        allowed = store.used < store.quota
        if allowed:
            store.used += 1
        # never above the window (float arithmetic can make 0.3 s 300.00000001 ms)
        reset_ms = max(0, min(round(store.window_s * 1000),
                              math.ceil((store.window_end - now) * 1000)))
        headers = {"X-Rate-Limit-Time-Window-Ms": str(round(store.window_s * 1000)),
                   "X-Rate-Limit-Time-Reset-Ms": str(reset_ms),
                   "X-Rate-Limit-Requests-Left": str(store.quota - store.used),
                   "X-Rate-Limit-Requests-Quota": str(store.quota)}
        if not allowed:
            headers["X-Retry-After"] = str(max(1, math.ceil(reset_ms / 1000)))
        return allowed, headers


_REASONS = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout"}
