"""Deletion evidence by object, and the keys that verify evidence exports."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from service import evidence
from service.api.bodies import ID_PATTERN, MAX_ID_CHARS, JsonRoute
from service.api.deps import OperatorDep, RuntimeDep
from service.api.problems import problem_responses, validation_problem
from service.api.tenants import stored_tenant
from service.errors import Problem
from service.ledger import id_problem

router = APIRouter(prefix="/v1", tags=["evidence"], route_class=JsonRoute,
                   responses=problem_responses(401))

IdQuery = Query(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)


class Deletion(BaseModel):
    """One deletion of the object: under which policy and version, when, what the
    upstream answered."""

    item_id: int
    run_id: int | None = Field(description="the run whose batch released it (null: a "
                                           "webhook released it)")
    policy: str
    policy_version: int
    operation_key: str
    outcome: str
    upstream_status: int | None
    attempts: int
    completed_at: datetime
    kept_in: Literal["ledger", "evidence"] = Field(description=(
        "`ledger`: the item is still in the ledger; `evidence`: retention pruned the item "
        "and kept this record (for SWEEPER_EVIDENCE_RETENTION_DAYS after completed_at)"))


class EvidenceOut(BaseModel):
    """Whether the object was deleted, when, and under which policy."""

    tenant_id: str
    object_id: str
    deleted: bool
    deletions: list[Deletion] = Field(description="oldest first")


class KeyOut(BaseModel):
    key_id: str = Field(description="what a manifest's key_id names")
    algorithm: Literal["Ed25519"] = "Ed25519"
    public_key: str = Field(description="the raw 32-byte public key, base64")
    pem: str = Field(description="the same key as a PEM SubjectPublicKeyInfo")
    current: bool = Field(description="signs new exports; the others signed earlier ones")


class KeysOut(BaseModel):
    """The keys that verify evidence exports: save this document and pass it to
    `sweeper evidence verify --public-key`."""

    keys: list[KeyOut]


@router.get("/evidence", operation_id="getEvidence", response_model=EvidenceOut,
            responses=problem_responses(422, 503))
async def get_evidence(runtime: RuntimeDep, _actor: OperatorDep,
                       tenant_id: Annotated[str, IdQuery],
                       object_id: Annotated[str, IdQuery],
                       limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> EvidenceOut:
    """Was this object deleted, when, and under which policy: from the ledger and from the
    evidence kept after retention pruned its items."""
    errors = [{"loc": ["query", name], "type": "invalid_id", "message": problem}
              for name, value in (("tenant_id", tenant_id), ("object_id", object_id))
              if (problem := id_problem(value))]
    if errors:
        raise validation_problem(errors)
    # the deletions were recorded under the tenant's stored spelling (service/tenants.py)
    tenant_id = stored_tenant(runtime.policies, tenant_id, None, ("query", "tenant_id"))
    rows = await evidence.lookup(runtime.engine, tenant_id, object_id, limit=limit)
    return EvidenceOut(tenant_id=tenant_id, object_id=object_id, deleted=bool(rows),
                       deletions=[Deletion.model_validate(r) for r in rows])


@router.get("/evidence/public-key", operation_id="getEvidencePublicKeys",
            response_model=KeysOut, responses=problem_responses(404))
async def get_public_keys(runtime: RuntimeDep, _actor: OperatorDep) -> KeysOut:
    """The public keys that verify evidence exports: the current one first, then earlier
    ones still published (SWEEPER_EVIDENCE_PREVIOUS_PUBLIC_KEYS)."""
    signer = runtime.signer
    if signer is None:
        raise Problem(404, "evidence-unsigned", "Evidence exports are not signed",
                      "no signing key is configured (SWEEPER_EVIDENCE_SIGNING_KEY_FILE)")
    current = signer.current.key_id
    return KeysOut(keys=[KeyOut(key_id=k.key_id, public_key=k.base64, pem=k.pem,
                                current=k.key_id == current) for k in signer.published])
