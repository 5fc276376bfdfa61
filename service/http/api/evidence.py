"""Deletion evidence by object, the evidence log's ranges and checkpoints, and the keys
that verify them."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from service.errors import Problem
from service.evidence import chain, export_slices, object_deletions
from service.http.api.bodies import ID_PATTERN, MAX_BIGINT, MAX_ID_CHARS, JsonRoute
from service.http.api.deps import OperatorDep, RuntimeDep
from service.http.api.problems import problem_responses, validation_problem
from service.http.api.tenants import stored_object, stored_tenant
from service.ledger.registration import id_problem

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
    # the deletions were recorded under the tenant's stored spelling (service/config/tenants.py)
    tenant_id = stored_tenant(runtime.policies, tenant_id, None, ("query", "tenant_id"))
    object_id = stored_object(runtime.policies, object_id, None, ("query", "object_id"))
    rows = await object_deletions.lookup(runtime.engine, tenant_id, object_id, limit=limit)
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


# Entries per range export and checkpoints per page: one answer stays a few MB.
MAX_LOG_ENTRIES = 10_000
MAX_CHECKPOINTS = 1000


@router.get("/evidence/log", operation_id="getEvidenceLog",
            response_class=StreamingResponse,
            responses={200: {"content": {"application/x-ndjson": {}},
                             "description": (
                                 "a slice of the evidence log as JSON lines: the signed "
                                 "checkpoint at or before `after`, every entry after it up "
                                 "to the first checkpoint at or past after + limit, that "
                                 "checkpoint, then the signed manifest line (its "
                                 "`next_after` is the next page's `after`, null at the end; "
                                 "a `Link: rel=next` header says the same)")},
                       **problem_responses(422, 503)})
async def get_evidence_log(runtime: RuntimeDep, _actor: OperatorDep,
                           # after + limit stays a bigint (the log never gets near it)
                           after: Annotated[int, Query(
                               ge=0, le=MAX_BIGINT - MAX_LOG_ENTRIES)] = 0,
                           limit: Annotated[int, Query(ge=1, le=MAX_LOG_ENTRIES)] = 1000
                           ) -> StreamingResponse:
    """Every deletion, whatever released its item, in log order: entries after+1 ..
    after+limit, widened to the checkpoints around them (at most CHECKPOINT_RECORDS and a
    segment more each side), each record in full, each segment closed by the chain hash
    after it. `sweeper evidence verify`
    checks it against the checkpoints' signatures offline. The head is checkpointed first,
    so every deletion committed before the request is in some page."""
    lines, next_after = await export_slices.range_export(runtime.engine, runtime.signer,
                                                         after=after, limit=limit)
    headers = ({"Link": f'</v1/evidence/log?after={next_after}&limit={limit}>; rel="next"'}
               if next_after is not None else {})
    return StreamingResponse(lines, media_type="application/x-ndjson", headers=headers)


class CheckpointOut(BaseModel):
    """A signed checkpoint: the statement and its Ed25519 signature (base64) over the
    statement's canonical JSON (keys sorted, no spaces)."""

    checkpoint: dict[str, str | int | None] = Field(description=(
        "format, size (entries in the log), head (the chain hash after entry `size`, hex), "
        "signed_at, key_id"))
    signature: str | None = Field(description="null: the server had no signing key")


class CheckpointsOut(BaseModel):
    """Checkpoints oldest first: keep them outside the database and pass them to
    `sweeper evidence verify --checkpoints`."""

    checkpoints: list[CheckpointOut]
    next_after: int | None = Field(description="the next page's `after`; null: no more")


@router.get("/evidence/checkpoints", operation_id="getEvidenceCheckpoints",
            response_model=CheckpointsOut, responses=problem_responses(422, 503))
async def get_evidence_checkpoints(runtime: RuntimeDep, _actor: OperatorDep,
                                   after: Annotated[int, Query(ge=0, le=MAX_BIGINT)] = 0,
                                   limit: Annotated[int, Query(
                                       ge=1, le=MAX_CHECKPOINTS)] = MAX_CHECKPOINTS
                                   ) -> CheckpointsOut:
    """The evidence log's signed checkpoints with a size past `after`, oldest first. An
    operator who copies them somewhere the database's writers cannot change can later
    prove the log up to each was not rewritten."""
    found = await chain.checkpoints(runtime.engine, after=after, limit=limit)
    return CheckpointsOut(
        checkpoints=[CheckpointOut(checkpoint=c.statement(), signature=c.signature)
                     for c in found],
        next_after=found[-1].size if len(found) == limit else None)
