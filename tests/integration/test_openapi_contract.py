"""The contract against the running service: every error a route answers is declared for it
in the OpenAPI document with the problem+json shape, every declared error is one the route
really gives, and every request-body example is accepted."""

from __future__ import annotations

import base64
import re
from typing import Any

import httpx
import pytest

from service.commands.openapi import openapi_document
from service.config.policies import Policies
from service.http.api.problems import ProblemDetails
from tests.conftest import LiveServer, policies_from, test_settings

DOC = openapi_document()
# The operator API. The webhook intake authenticates by signature, not bearer token: its
# declared answers are checked against signed deliveries in test_webhooks.py.
OPERATIONS = {op["operationId"]: (method.upper(), path, op)
              for path, ops in DOC["paths"].items() for method, op in ops.items()
              if not path.startswith("/v1/webhooks/")}
# valid path parameters; `run_id` 1 is the run the setup creates
VALID = {"run_id": "1", "scope": "tenant:acme.myshopify.com", "tenant_id": "acme.myshopify.com",
         "upstream": "shop", "hold_id": "1"}
MISSING = {"run_id": str(2**62), "scope": "tenant:nobody", "tenant_id": "nobody",
           "upstream": "nowhere", "hold_id": str(2**62)}
INVALID = {"run_id": "0", "scope": "x" * 1537, "tenant_id": "x" * 513, "upstream": "x" * 64,
           "hold_id": "0"}
# a token of the lowest role: every operation that declares 403 refuses it
VIEWER_TOKEN = "test-token-viewer-vvvvvvvvvvvv"
# SWEEPER_CREDENTIALS_KEY for the servers that store credentials (the first one does not:
# there storing one answers 409)
CREDENTIALS_KEY = base64.b64encode(bytes(32)).decode()

# One invalid-but-well-formed request per operation that takes input (answers 422).
INVALID_INPUT: dict[str, dict[str, Any]] = {
    "createRun": {"json": {"max_items": 0}},
    "listRuns": {"params": {"limit": 0}},
    "getRun": {"path": INVALID},
    "getRunEvidence": {"path": INVALID},
    "getRunDiscovery": {"path": INVALID},
    "registerItems": {"json": {"items": []}},
    "listItems": {"params": {"status": "gone"}},
    "redriveItems": {"json": {"why": "nothing selected"}},
    "cancelItems": {"json": {"ids": [1]}},  # no `why`
    "listScopes": {"params": {"limit": 501}},
    "setScopeBudget": {"json": {"rate_per_second": 0, "burst": 1}},
    "pauseScope": {"json": {"reason": "x" * 1001}},
    "resumeScope": {"path": INVALID},
    "pauseWorkers": {"json": {"reason": ["not", "text"]}},
    "resumeWorkers": {"json": {"reason": 7}},
    "putTenantCredential": {"json": {"secret": ""}},
    "deleteTenantCredential": {"path": INVALID},
    "listTenantCredentials": {"path": INVALID},
    "placeHold": {"json": {"reason": "no tenant", "reference": "CASE-1"}},
    "listHolds": {"params": {"limit": 0}},
    "getHold": {"path": INVALID},
    "releaseHold": {"json": {}},  # no `why`
    "getEvidence": {"params": {"tenant_id": "acme.myshopify.com"}},  # no object_id
    "getEvidenceLog": {"params": {"limit": 10_001}},
    "getEvidenceCheckpoints": {"params": {"after": -1}},
}
# the query an operation cannot do without (valid values)
VALID_QUERY: dict[str, dict[str, str]] = {
    "getEvidence": {"tenant_id": "acme.myshopify.com", "object_id": "cart-1"}}
# a valid body per operation: its first documented example
VALID_BODY: dict[str, Any] = {
    operation: next(iter(op["requestBody"]["content"]["application/json"]["examples"].values())
                    )["value"]
    for operation, (_, _, op) in OPERATIONS.items() if "requestBody" in op}


def url_of(path: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)


async def answer(client: httpx.AsyncClient, operation: str, *, path: dict[str, str] | None
                 = None, **kwargs: Any) -> httpx.Response:
    method, template, _ = OPERATIONS[operation]
    return await client.request(method, url_of(template, path or VALID), **kwargs)


def check(operation: str, response: httpx.Response, status: int,
          seen: dict[str, set[int]]) -> None:
    """The answer has the expected status, is problem+json, and is declared."""
    assert response.status_code == status, (operation, response.status_code, response.text)
    assert response.headers["content-type"] == "application/problem+json", operation
    problem = ProblemDetails.model_validate(response.json())
    assert problem.status == status
    declared = OPERATIONS[operation][2]["responses"]
    assert str(status) in declared, f"{operation} answers {status} but does not declare it"
    for header in declared[str(status)].get("headers", {}):
        assert header in response.headers, (operation, status, header)
    seen.setdefault(operation, set()).add(status)


@pytest.fixture
def policies() -> Policies:
    return policies_from({
        "upstreams": {"shop": {"base_url": "http://127.0.0.1:9",
                               "credentials": {"api": True},
                               "headers": {"Authorization": "Bearer {credential}"}}},
        "policies": {"cart-retention": {"version": 1, "upstream": "shop",
                                        "path": "/carts/{object_id}",
                                        "scope": "tenant:{tenant_id}",
                                        "rate": {"per_second": 5}}}})


async def test_declared_errors_are_the_answers(db_url: str, policies: Policies) -> None:
    seen: dict[str, set[int]] = {}
    async with LiveServer(test_settings(db_url, viewer_tokens=VIEWER_TOKEN), policies,
                          db_url) as live:
        async with live.client() as client:
            await client.post("/v1/items", json={"items": [{
                "tenant_id": "acme.myshopify.com", "object_id": "cart-1",
                "policy": "cart-retention", "due_at": "2020-01-01T00:00:00Z"}]})
            first = await client.post("/v1/runs", json={}, headers={"Idempotency-Key": "k"})
            assert first.json()["id"] == 1
            check("createRun", await client.post("/v1/runs", json={"dry_run": True},
                                                 headers={"Idempotency-Key": "k"}), 409, seen)
            check("putTenantCredential", await answer(  # no SWEEPER_CREDENTIALS_KEY here
                client, "putTenantCredential", json=VALID_BODY["putTenantCredential"]), 409, seen)
            hold = await answer(client, "placeHold", json=VALID_BODY["placeHold"])
            assert hold.status_code == 201 and hold.json()["id"] == 1, hold.text
            assert (await answer(client, "releaseHold", json=VALID_BODY["releaseHold"])
                    ).status_code == 200
            check("releaseHold", await answer(client, "releaseHold",
                                              json=VALID_BODY["releaseHold"]), 409, seen)
            # no signing key configured here
            check("getEvidencePublicKeys", await answer(client, "getEvidencePublicKeys"), 404,
                  seen)
            for operation, (_, template, op) in OPERATIONS.items():
                if template.startswith("/v1/"):
                    check(operation, await answer(client, operation, headers={
                        "Authorization": "Bearer not-a-valid-token-at-all"}), 401, seen)
                if op.get("x-sweeper-role") in ("operator", "admin"):
                    check(operation, await answer(client, operation, json=VALID_BODY.get(
                        operation), headers={"Authorization": f"Bearer {VIEWER_TOKEN}"}),
                          403, seen)
                if "requestBody" in op:
                    check(operation, await answer(client, operation, content=b'{"x": ',
                                                  headers={"Content-Type": "application/json"}),
                          400, seen)
                if operation in INVALID_INPUT:
                    case = dict(INVALID_INPUT[operation])
                    check(operation, await answer(client, operation, **case), 422, seen)
                if "{" in template:
                    body = VALID_BODY.get(operation)
                    check(operation, await answer(client, operation, path=MISSING, json=body),
                          404, seen)
    # the database is gone: every route that reads it says so, and says when to retry
    gone = "postgresql://postgres@127.0.0.1:1/nowhere"
    async with LiveServer(test_settings(gone, credentials_key=CREDENTIALS_KEY), policies,
                          gone) as live:
        async with live.client(timeout=20) as client:
            for operation, (_, _, op) in OPERATIONS.items():
                if "503" in op["responses"]:
                    check(operation, await answer(client, operation,
                                                  json=VALID_BODY.get(operation),
                                                  params=VALID_QUERY.get(operation)), 503, seen)

    for operation, (_, _, op) in OPERATIONS.items():
        declared = {int(s) for s in op["responses"] if int(s) >= 400}
        assert declared == seen.get(operation, set()), (
            f"{operation} declares {sorted(declared)}, answered {sorted(seen.get(operation, []))}")
    assert set(INVALID_INPUT) == {o for o, (_, _, op) in OPERATIONS.items()
                                  if "422" in op["responses"]}


async def test_every_request_example_is_accepted(db_url: str, policies: Policies) -> None:
    examples = {operation: op["requestBody"]["content"]["application/json"]["examples"]
                for operation, (_, _, op) in OPERATIONS.items() if "requestBody" in op}
    async with LiveServer(test_settings(db_url, credentials_key=CREDENTIALS_KEY), policies,
                          db_url) as live:
        async with live.client() as client:
            # registration first: it creates the scope the scope examples change
            for operation in sorted(examples, key=lambda o: o != "registerItems"):
                for name, example in examples[operation].items():
                    response = await answer(client, operation, json=example["value"])
                    assert response.status_code in (200, 201, 202), (operation, name,
                                                                      response.text)
