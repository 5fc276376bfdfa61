"""A fake Stripe API: ``DELETE /v1/customers/{id}``, a request rate per account, and Stripe's
idempotency layer.

Documentation followed:

- https://docs.stripe.com/api/customers/delete (``{"id", "object": "customer", "deleted": true}``;
  an id that does not exist raises an error)
- https://docs.stripe.com/api/authentication (the secret key as a Bearer token, or as the HTTP
  basic user name with no password)
- https://docs.stripe.com/api/errors (the ``error`` object: ``type``, one of ``api_error``,
  ``card_error``, ``idempotency_error``, ``invalid_request_error``; ``code``, ``message``,
  ``param``; 401 for no valid key, 404, 409 for a request that conflicts with another using the
  same idempotency key, 429 "Too many requests hit the API too quickly"), and the codes
  ``resource_missing`` and ``rate_limit`` of https://docs.stripe.com/error-codes
- https://docs.stripe.com/api/idempotent_requests and https://docs.stripe.com/idempotency (the
  status and body of the first request with a key are saved once the endpoint starts executing,
  500s included, and returned to retries; a key reused with other parameters is an error; keys
  can be pruned once 24 hours old; and: idempotency keys are for POST requests, a key sent with
  a GET or DELETE has no effect, those being idempotent by definition)
- https://docs.stripe.com/rate-limits (per account: 100 requests/s in live mode, 25/s in a
  sandbox; an endpoint's own default limit is 25/s; 429 when exceeded)

So by default this fake, like Stripe, ignores ``Idempotency-Key`` on DELETE: a retried delete
whose first attempt went through gets a 404 ``resource_missing``. ``idempotent_deletes=True``
applies Stripe's POST idempotency to the deletes instead (replay with ``Idempotent-Replayed:
true``, 400 ``idempotency_error`` for other parameters, 409 while the first is in flight).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from drills.vendors import Exchange, TokenBucket, VendorFake, json_response

__all__ = ["FakeStripe"]

SANDBOX_PER_SECOND = 25.0  # also the default per-endpoint limit in live mode
IDEMPOTENCY_TTL_S = 24 * 3600.0
MAX_KEY_LENGTH = 255
NO_KEY = ("You did not provide an API key. You need to provide your API key in the "
          "Authorization header, using Bearer auth (e.g. 'Authorization: Bearer "
          "YOUR_SECRET_KEY'). See https://stripe.com/docs/api#authentication for details, or "
          "we can help at https://support.stripe.com/.")
RATE_LIMITED = ("Too many requests hit the API too quickly. We recommend an exponential backoff "
                "of your requests.")


@dataclass(slots=True)
class _Account:
    bucket: TokenBucket | None
    customers: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Saved:
    """An idempotency key's first request (its fingerprint) and, once answered, the answer."""

    fingerprint: tuple[str, str, str, bytes]
    created: float
    status: int | None = None
    body: bytes = b""


def _error(status: int, error: dict[str, str], headers: dict[str, str] | None = None
           ) -> Response:
    return json_response(status, {"error": error}, headers)


def _masked(key: str) -> str:
    """A key as Stripe quotes a wrong one: its ``sk_test_`` prefix and last four characters."""
    prefix = key[:key.find("_", key.find("_") + 1) + 1] if key.count("_") >= 2 else ""
    rest = key[len(prefix):]
    return prefix + ("*" * (len(rest) - 4) + rest[-4:] if len(rest) > 4 else "*" * len(rest))


class FakeStripe(VendorFake):
    """Accounts, each with its secret key, customers and request-rate bucket (`per_second`
    requests per second, bursts of `burst`, default `per_second`; None: unlimited)."""

    def __init__(self, *, per_second: float | None = SANDBOX_PER_SECOND,
                 burst: int | None = None, idempotent_deletes: bool = False,
                 idempotency_ttl_s: float = IDEMPOTENCY_TTL_S, record_calls: bool = True
                 ) -> None:
        self.per_second, self.burst = per_second, burst
        self.idempotent_deletes, self.idempotency_ttl_s = idempotent_deletes, idempotency_ttl_s
        self._keys: dict[str, str] = {}  # secret key -> account
        self._accounts: dict[str, _Account] = {}
        self._saved: dict[tuple[str, str], _Saved] = {}  # (account, idempotency key)
        self._request_ids = itertools.count(1)
        super().__init__(record_calls=record_calls)

    def _build_app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/customers/{customer_id}",
                                       self._route(self._delete), methods=["DELETE"])])

    # ----------------------------------------------------------------- test API
    def add_account(self, account: str, key: str, *, per_second: float | None = None,
                    burst: int | None = None) -> None:
        """An account with its secret key (``sk_test_...``) and, unless given here, the
        fake's default rate limit."""
        self._keys[key] = account
        self._accounts[account] = _Account(None)
        self.set_rate_limit(account, per_second or self.per_second, burst or self.burst)

    def set_rate_limit(self, account: str, per_second: float | None, burst: int | None = None
                       ) -> None:
        """`per_second` requests per second in bursts of `burst` (default `per_second`, at
        least 1); None removes the limit. The bucket starts full."""
        self._accounts[account].bucket = None if per_second is None else TokenBucket(
            per_second, burst or max(1.0, per_second), time.monotonic())

    def add_customers(self, account: str, ids: Iterable[str]) -> None:
        self._accounts[account].customers.update(ids)

    def customers(self, account: str) -> set[str]:
        return set(self._accounts[account].customers)

    # ----------------------------------------------------------------- the API
    def _fault_response(self, status: int) -> Response:
        return _error(status, {"type": "api_error", "message": "An unknown error occurred"},
                      self._headers())

    def _headers(self) -> dict[str, str]:
        return {"Request-Id": f"req_{next(self._request_ids):014x}"}

    def _account(self, request: Request) -> tuple[str | None, str | None]:
        """The account the request authenticates as, else None and the 401 message."""
        auth = request.headers.get("authorization", "")
        scheme, _, credential = auth.partition(" ")
        key = ""
        if scheme.lower() == "bearer":
            key = credential.strip()
        elif scheme.lower() == "basic":
            try:
                key = base64.b64decode(credential.strip(), validate=True).decode().split(":")[0]
            except (binascii.Error, UnicodeDecodeError):
                key = ""
        if not key:
            return None, NO_KEY
        account = self._keys.get(key)
        return (account, None) if account else (None, f"Invalid API Key provided: {_masked(key)}")

    async def _delete(self, request: Request, raw: bytes, ex: Exchange) -> Response:
        ex.body = dict(parse_qsl(raw.decode("utf-8", "replace"))) if raw else None
        account_name, problem = self._account(request)
        if account_name is None:
            ex.outcome = "unauthorized"
            return _error(401, {"type": "invalid_request_error", "message": problem or ""},
                          {**self._headers(), "WWW-Authenticate": 'Basic realm="Stripe"'})
        ex.tenant = account_name
        account = self._accounts[account_name]
        if account.bucket is not None and not account.bucket.take(1.0, ex.at):
            ex.outcome = "throttled"
            # not executed, so nothing is saved under an idempotency key
            return _error(429, {"type": "invalid_request_error", "code": "rate_limit",
                                "message": RATE_LIMITED,
                                "doc_url": "https://stripe.com/docs/error-codes/rate-limit"},
                          {**self._headers(), "Stripe-Rate-Limited-Reason": "global-rate"})
        key = ex.idempotency_key if self.idempotent_deletes else None
        saved: _Saved | None = None
        if key is not None:
            answer, saved = self._idempotency(account_name, key, request, raw, ex)
            if answer is not None:
                return answer
        try:
            response = await self._execute(request, account, ex)
        except BaseException:
            if saved is not None:  # never answered: the key is free again
                self._saved.pop((account_name, key or ""), None)
            raise
        if saved is not None:
            saved.status, saved.body = response.status_code, bytes(response.body)
        return response

    async def _execute(self, request: Request, account: _Account, ex: Exchange) -> Response:
        fault = await self._take_fault(ex)
        if fault is not None:
            return fault
        customer_id = request.path_params["customer_id"]
        if customer_id in account.customers:
            account.customers.discard(customer_id)
            return json_response(200, {"id": customer_id, "object": "customer", "deleted": True},
                                 self._headers())
        ex.outcome = "not_found"
        return _error(404, {"type": "invalid_request_error", "code": "resource_missing",
                            "param": "id", "message": f"No such customer: '{customer_id}'",
                            "doc_url": "https://stripe.com/docs/error-codes/resource-missing"},
                      self._headers())

    def _idempotency(self, account: str, key: str, request: Request, raw: bytes, ex: Exchange
                     ) -> tuple[Response | None, _Saved | None]:
        """A replayed or refused answer for a key already used, else None and the entry this
        request's answer is to be saved in."""
        if len(key) > MAX_KEY_LENGTH:
            ex.outcome = "invalid"
            return _error(400, {"type": "invalid_request_error", "message":
                                f"Keys for idempotent requests can only be {MAX_KEY_LENGTH} "
                                "characters long."}, self._headers()), None
        fingerprint = (request.method, request.url.path, request.url.query, raw)
        saved = self._saved.get((account, key))
        if saved is not None and ex.at - saved.created >= self.idempotency_ttl_s:
            saved = None  # pruned: the key makes a new request
        if saved is None:
            saved = self._saved[(account, key)] = _Saved(fingerprint, ex.at)
            return None, saved
        if saved.fingerprint != fingerprint:
            ex.outcome = "invalid"
            return _error(400, {"type": "idempotency_error", "message":
                                "Keys for idempotent requests can only be used with the same "
                                "parameters they were first used with. Try using a key other "
                                f"than '{key}' if you meant to execute a different request."},
                          self._headers()), None
        if saved.status is None:
            ex.outcome = "conflict"
            return _error(409, {"type": "invalid_request_error", "code": "idempotency_key_in_use",
                                "message": "There is currently another in-progress request "
                                "using this Idempotent Key (that probably means you submitted "
                                f"twice, and the other request is still going through): {key}. "
                                "Please try again later."}, self._headers()), None
        ex.outcome = "replayed"
        return Response(saved.body, saved.status, media_type="application/json",
                        headers={**self._headers(), "Idempotent-Replayed": "true"}), None
