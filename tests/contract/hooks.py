"""Schemathesis hooks for the contract test: the operator's bearer token, and webhook
deliveries signed the way the configured source's storefront signs them.

Registered globally on import (schemathesis' `before_call` hook is global only); only the
contract tests import this module.
"""

from __future__ import annotations

from typing import Any

import requests
import schemathesis

from tests.conftest import TOKEN_A
from tests.contract.seeded import delivery_headers

WEBHOOK = "POST /v1/webhooks/{source}"


@schemathesis.auth()
class BearerToken:
    """The operator token on every request, through schemathesis' own auth hook: its
    negative cases and auth checks (a missing or ignored token) then still apply."""

    def get(self, case: Any, context: Any) -> str:
        return TOKEN_A

    def set(self, case: Any, data: str, context: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


class SignedDelivery(requests.auth.AuthBase):
    """Signs the request as `requests` is about to send it: the body is final by then, so the
    signature covers exactly the bytes on the wire, whatever schemathesis serialized."""

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        body = request.body or b""
        if isinstance(body, str):
            body = body.encode("utf-8")
        request.headers.update(delivery_headers(body))
        return request


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Every delivery is signed, valid and invalid bodies alike: an invalid body must be
    refused by the mapping, not merely by the signature check. (Which source a delivery
    goes to is generated; schemathesis.toml makes it mostly the configured one.)"""
    if case.operation.label == WEBHOOK:
        kwargs["auth"] = SignedDelivery()
