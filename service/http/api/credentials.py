"""Tenants' upstream credentials, stored encrypted: put, delete, list. An answer carries a
credential's fingerprint, never its secret; a refused secret is named by its location and
rule, never echoed (service/http/api/problems.py)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Response
from fastapi.openapi.models import Example
from pydantic import AfterValidator, BaseModel, Field, SecretStr

from service.budget import credential_waits
from service.config.policy_file import NAME_PATTERN
from service.credentials import tenant_credentials
from service.credentials.source import HEADER_VALUE_PATTERN, MAX_SECRET_CHARS, secret_problem
from service.errors import Problem
from service.http.api.bodies import ID_PATTERN, MAX_ID_CHARS, JsonRoute, RequestBody
from service.http.api.deps import OperatorDep, RuntimeDep
from service.http.api.problems import problem_doc, problem_responses
from service.http.api.reasons import Reason
from service.http.api.tenants import stored_tenant
from service.ledger import registration
from service.observability.failures import InternalErrors, expected
from service.observability.metrics import Where

_errors = InternalErrors(logging.getLogger("service.http"))

router = APIRouter(prefix="/v1", tags=["credentials"], route_class=JsonRoute,
                   responses=problem_responses(401, 503))


def _tenant_id(value: str) -> str:
    problem = registration.id_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _usable(value: SecretStr) -> SecretStr:
    problem = secret_problem(value.get_secret_value())
    if problem:
        raise ValueError(problem)
    return value


# A tenant id as items take it; one holding '/' is sent as %2F, and the route matches it
# whole (the `:path` converter), so every tenant an item can name can have a credential.
TenantId = Annotated[str, Path(
    min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN,
    description="the tenant's id as items carry it, percent-encoded ('/' as %2F)",
    examples=["acme.myshopify.com"]), AfterValidator(_tenant_id)]
UpstreamName = Annotated[str, Path(
    min_length=1, max_length=63, pattern=NAME_PATTERN,
    description="an upstream of the policies file", examples=["storefront"])]
# the bounds are checked by secret_problem (pydantic's own length error on a SecretStr
# speaks of "items"); the schema still states them
Secret = Annotated[SecretStr, Field(
    description=("the credential as the upstream takes it, sent in the header the upstream's "
                 "template names; printable ASCII, no space at either end. Never answered "
                 "back, logged or stored in the clear"),
    json_schema_extra={"pattern": HEADER_VALUE_PATTERN, "minLength": 1,
                       "maxLength": MAX_SECRET_CHARS}), AfterValidator(_usable)]


class CredentialIn(RequestBody):
    """A tenant's credential for one upstream, and why (for the audit trail)."""

    secret: Secret
    reason: Reason | None = None


class CredentialOut(BaseModel):
    """A stored credential: its fingerprint, never its secret."""

    tenant_id: str
    upstream: str
    fingerprint: str = Field(description=(
        "12 hex digits identifying the secret under the current key: the same secret "
        "stored twice has the same fingerprint; a new key changes every fingerprint"))
    updated_at: datetime
    updated_by: str = Field(description="the operator (token) that stored it")


class TenantCredentialOut(BaseModel):
    """One of a tenant's stored credentials."""

    upstream: str
    fingerprint: str
    updated_at: datetime
    updated_by: str


class TenantCredentials(BaseModel):
    """A tenant's stored credentials by upstream."""

    credentials: list[TenantCredentialOut]


PUT_EXAMPLES: dict[str, Example] = {
    "access-token": {"summary": "a shop's access token for the storefront upstream",
                     "value": {"secret": "example-access-token-0123456789",
                               "reason": "shop installed the app (ticket 5120)"}},
}
_STORAGE_OFF = 409
_PUT_ERRORS: dict[int | str, dict[str, Any]] = {
    **problem_responses(400, 404, 422),
    _STORAGE_OFF: problem_doc(
        "credential storage is not configured on this server: SWEEPER_CREDENTIALS_KEY is "
        "not set (`credential-storage-off`)"),
}
_PATH = "/tenants/{tenant_id:path}/credentials"


def _not_found(detail: str) -> Problem:
    # the tenant id is not echoed: answers never carry it (the request id names the request)
    return Problem(404, "credential-not-found", "Credential not found", detail)


@router.put(_PATH + "/{upstream}", operation_id="putTenantCredential",
            response_model=CredentialOut, responses=_PUT_ERRORS)
async def put_credential(runtime: RuntimeDep, actor: OperatorDep, tenant_id: TenantId,
                         upstream: UpstreamName,
                         body: Annotated[CredentialIn, Body(openapi_examples=PUT_EXAMPLES)]
                         ) -> CredentialOut:
    """Store a tenant's credential for an upstream, encrypted, replacing any earlier one (a
    rotation is a new PUT). Every replica uses it within seconds."""
    if upstream not in runtime.credential_upstreams():
        raise Problem(404, "upstream-not-found", "Upstream not found",
                      f"upstream {upstream!r} takes no stored credentials: it is not in the "
                      "policies file, or its credentials come from elsewhere")
    if runtime.keyring is None:
        # 409, not 503: no retry helps until the server is configured differently, and a
        # 503 here means "the database is busy, retry after" to clients and proxies alike
        raise Problem(_STORAGE_OFF, "credential-storage-off",
                      "Credential storage is not configured",
                      "set SWEEPER_CREDENTIALS_KEY on the server to store credentials")
    # the spelling the upstream's items look it up by (service/config/tenants.py)
    tenant_id = runtime.policies.upstreams[upstream].tenant(tenant_id)
    stored = await tenant_credentials.put(runtime.engine, runtime.keyring, tenant_id, upstream,
                               body.secret.get_secret_value(), actor=actor, reason=body.reason)
    if runtime.credentials is not None:
        runtime.credentials.invalidate(tenant_id, upstream)
    # the tenant's scopes waiting for it resume now (other replicas' checks would within
    # seconds); the credential is stored whatever this finds
    try:
        await credential_waits.resume_arrived(runtime.engine, runtime.policies,
                                              runtime.tenant_credentials, tenant_id=tenant_id)
    except Exception as exc:
        if not expected(exc):
            _errors.caught(Where.WAITS, exc, check="credentials")
    return CredentialOut(**asdict(stored))


@router.delete(_PATH + "/{upstream}", operation_id="deleteTenantCredential",
               status_code=204, response_class=Response, responses=problem_responses(404, 422))
async def delete_credential(runtime: RuntimeDep, actor: OperatorDep, tenant_id: TenantId,
                            upstream: UpstreamName) -> Response:
    """Remove a tenant's credential for an upstream (whether or not the policies file still
    names the upstream); every replica stops using it within seconds."""
    known = runtime.policies.upstreams.get(upstream)
    if known is not None:
        tenant_id = known.tenant(tenant_id)
    if not await tenant_credentials.delete(runtime.engine, tenant_id, upstream, actor=actor):
        raise _not_found("no credential is stored for this tenant and upstream")
    if runtime.credentials is not None:
        runtime.credentials.invalidate(tenant_id, upstream)
    return Response(status_code=204)


@router.get(_PATH, operation_id="listTenantCredentials", response_model=TenantCredentials,
            responses=problem_responses(404, 422))
async def list_credentials(runtime: RuntimeDep, _actor: OperatorDep,
                           tenant_id: TenantId) -> TenantCredentials:
    """A tenant's stored credentials by upstream (fingerprints, never secrets); 404 when it
    has none."""
    tenant_id = stored_tenant(runtime.policies, tenant_id, None, ("path", "tenant_id"))
    rows = await tenant_credentials.list_for_tenant(runtime.engine, tenant_id)
    if not rows:
        raise _not_found("no credential is stored for this tenant")
    return TenantCredentials(credentials=[TenantCredentialOut(
        upstream=r.upstream, fingerprint=r.fingerprint, updated_at=r.updated_at,
        updated_by=r.updated_by) for r in rows])
