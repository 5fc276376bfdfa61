"""Cron triggers and run status."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Path, Query, Response
from fastapi.openapi.models import Example
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from service.errors import Problem
from service.evidence import export_slices
from service.http.api.bodies import (
    ID_PATTERN,
    MAX_BIGINT,
    Id,
    JsonInt,
    JsonRoute,
    PolicyName,
    RequestBody,
    Timestamp,
)
from service.http.api.deps import OperatorDep, RuntimeDep
from service.http.api.problems import problem_responses, validation_problem
from service.http.api.tenants import stored_filter
from service.ledger.registration import MAX_ID_BYTES, id_problem, utf8_size_over
from service.runs import discovery, progress, trigger
from service.runtime import Runtime

router = APIRouter(prefix="/v1", tags=["runs"], route_class=JsonRoute,
                   responses=problem_responses(401, 503))

RUN_EXAMPLES: dict[str, Example] = {
    "scheduled": {"summary": "a cron trigger for one policy",
                  "value": {"policy": "cart-retention"}},
    "report-only": {"summary": "a dry run first: figures only, nothing released",
                    "value": {"policy": "cart-retention", "dry_run": True}},
    "rollout": {"summary": "one tenant, a small cap, a fixed cutoff",
                "value": {"policy": "cart-retention", "tenant_id": "acme.myshopify.com",
                          "cutoff": "2026-11-30T00:00:00Z", "max_items": 500}},
}


class RunIn(RequestBody):
    """A trigger: which policy (all when absent), an optional tenant for rollouts, the cutoff
    (default: the database's now()), report-only, and a cap on items released."""

    policy: PolicyName | None = None
    tenant_id: Id | None = None
    cutoff: Timestamp | None = None
    dry_run: bool = False
    max_items: Annotated[int, Field(ge=1, le=100_000_000), JsonInt] | None = None


class RunOut(BaseModel):
    """A run and its progress."""

    id: int
    trigger_key: str | None
    policy: str | None
    tenant_id: str | None
    cutoff: datetime
    dry_run: bool
    max_items: int | None
    state: str
    candidates: int
    released: int
    batches: int
    remaining: int
    oldest_due_at: datetime | None
    newest_due_at: datetime | None
    report: dict[str, Any] = Field(description=(
        "the candidate figures per policy (`policies`: candidates, oldest_due_at, "
        "newest_due_at, and `held`, the candidates a legal hold keeps)"))
    created_at: datetime
    published_at: datetime | None
    items: dict[str, int] = Field(default_factory=dict, description=(
        "items by status (pending items under a legal hold count as `held`, not `pending`); "
        "counted at most every 2 s per replica, like `attempts` and "
        "`oldest_remaining_due_at` (a drained run's, published or failed with nothing "
        "pending or leased, at most every 60 s until an operator acts)"))
    attempts: dict[str, int] = Field(default_factory=dict, description="attempts by outcome")
    oldest_remaining_due_at: datetime | None = Field(default=None, description=(
        "the earliest due_at among the run's items still pending or leased"))


class TenantFigures(BaseModel):
    """What discovery found of one tenant."""

    tenant_id: str
    candidates: int
    oldest_age: datetime | None
    newest_age: datetime | None
    previous_candidates: int | None = Field(description=(
        "the previous report-only run's figure for this tenant (a report-only run only)"))
    difference: int | None = Field(description="candidates less previous_candidates")


class DiscoveredPolicy(BaseModel):
    """A source policy's discovery in one run: how far the walk is, what it found."""

    policy: str
    pages: int
    candidates: int
    registered: int = Field(description="items registered (none for a report-only run)")
    errors: int = Field(description=(
        "rows or list entries that could not become items (a missing or malformed id, a "
        "refused tenant), and a list source's tenants skipped (their list calls refused)"))
    error_samples: list[dict[str, str]] = Field(description=(
        "the first problems, each with a prefix of the row's ids"))
    oldest_age: datetime | None
    newest_age: datetime | None
    done: bool
    failure: str | None = Field(description=(
        "why the last page could not be read (the run waits and tries again)"))
    updated_at: datetime
    tenants: list[TenantFigures] = Field(description="per tenant, the largest first (1,000 "
                                                     "at most)")


class DiscoveryOut(BaseModel):
    """What a run found through its policies' sources (a store's query, an upstream's
    list)."""

    run_id: int
    previous_dry_run: int | None = Field(description=(
        "the report-only run this one is compared with (a report-only run only)"))
    policies: list[DiscoveredPolicy]


class RunPage(BaseModel):
    """Newest first; pass `next_before` as `before` for the next page."""

    runs: list[RunOut]
    next_before: int | None


@router.post("/runs", operation_id="createRun", status_code=202, response_model=RunOut,
             responses={200: {"model": RunOut, "description": "the run this key already started"},
                        **problem_responses(400, 409, 422)})
async def create_run(runtime: RuntimeDep, actor: OperatorDep, response: Response,
                     # optional, and never null (see scopes.ReasonBody)
                     body: Annotated[RunIn, Body(
                         openapi_examples=RUN_EXAMPLES)] = None,  # type: ignore[assignment]
                     idempotency_key: Annotated[str | None, Header(
                         max_length=MAX_ID_BYTES, pattern=ID_PATTERN,
                         description="one run per key: a cron slot's name, at most 512 "
                                     "bytes in UTF-8, no control characters")] = None,
                     ) -> RunOut:
    """Record a run and start publication; answers at once whatever the backlog. The run is
    in the audit trail under the token's id, once per Idempotency-Key."""
    if idempotency_key and utf8_size_over(idempotency_key, MAX_ID_BYTES):
        # the schema counts characters; the ledger stores the key in at most 512 bytes
        raise validation_problem([{"loc": ["header", "idempotency-key"], "type": "too_long",
                                   "message": f"must be at most {MAX_ID_BYTES} bytes"}])
    request = body or RunIn()
    if request.tenant_id is not None and (problem := id_problem(request.tenant_id)):
        # the same rule as a registered tenant id (the schema cannot count UTF-8 bytes)
        raise validation_problem([{"loc": ["body", "tenant_id"], "type": "invalid_id",
                                   "message": problem}])
    if request.policy is not None and runtime.policies.policy(request.policy) is None:
        # the name is not echoed: whatever a caller sent may be customer data
        raise Problem(422, "unknown-policy", "Unknown policy",
                      "no such policy in the policies file (GET /v1/policies lists them)")
    tenant_id = stored_filter(runtime.policies, request.tenant_id, request.policy,
                              ("body", "tenant_id"))
    try:
        run_id, created = await trigger.create_run(
            runtime.engine, trigger.RunRequest(request.policy, tenant_id, request.cutoff,
                                               request.dry_run, request.max_items),
            idempotency_key or None, actor=actor)
    except trigger.TriggerKeyReused as exc:
        raise Problem(409, "idempotency-key-reused", "Idempotency-Key already used",
                      "this key started a run with a different request",
                      run_id=exc.run_id) from None
    if not created:
        response.status_code = 200
    runtime.wake_publisher()
    status = await progress.run_status(runtime.engine, run_id, runtime.run_progress)
    assert status is not None
    return RunOut.model_validate(status)


@router.get("/runs", operation_id="listRuns", response_model=RunPage,
            responses=problem_responses(422))
async def list_runs(runtime: RuntimeDep, _actor: OperatorDep,
                    limit: Annotated[int, Query(ge=1, le=500)] = 50,
                    before: Annotated[int | None, Query(ge=1, le=MAX_BIGINT)] = None
                    ) -> RunPage:
    """Runs, newest first, each with its counts as `GET /v1/runs/{run_id}` shows them (the
    same per-replica counts; the runs without a recent one are counted together)."""
    rows = await progress.list_runs(runtime.engine, limit=limit, before=before,
                                    progress=runtime.run_progress)
    return RunPage(runs=[RunOut.model_validate(r) for r in rows],
                   next_before=rows[-1]["id"] if len(rows) == limit else None)


@router.get("/runs/{run_id}", operation_id="getRun", response_model=RunOut,
            responses=problem_responses(404, 422))
async def get_run(runtime: RuntimeDep, _actor: OperatorDep,
                  run_id: Annotated[int, Path(ge=1, le=MAX_BIGINT)]) -> RunOut:
    """A run with counts by item status, attempts by outcome and the oldest remaining item
    (counted at most every 2 s per replica, a drained run's at most every 60 s: the counts
    read every item of the run)."""
    status = await progress.run_status(runtime.engine, run_id, runtime.run_progress)
    if status is None:
        raise Problem(404, "run-not-found", "Run not found", f"no run {run_id}")
    return RunOut.model_validate(status)


@router.get("/runs/{run_id}/discovery", operation_id="getRunDiscovery",
            response_model=DiscoveryOut, responses=problem_responses(404, 422))
async def get_run_discovery(runtime: RuntimeDep, _actor: OperatorDep,
                            run_id: Annotated[int, Path(ge=1, le=MAX_BIGINT)]) -> DiscoveryOut:
    """What the run's sources (a store's query, an upstream's list) found: per policy the
    pages read, candidates, items registered, malformed rows or entries and why a page
    could not be read; per tenant the candidates
    with their oldest and newest age, and for a report-only run the difference from the
    previous report-only run over the same policy and tenant."""
    found = await discovery.report(runtime.engine, run_id)
    if found is None:
        raise Problem(404, "run-not-found", "Run not found", f"no run {run_id}")
    return DiscoveryOut.model_validate(found)


@router.get("/runs/{run_id}/evidence", operation_id="getRunEvidence",
            response_class=StreamingResponse,
            responses={200: {"content": {"application/x-ndjson": {}},
                             "description": (
                                 "the spans of the evidence log that hold the run's "
                                 "deletions, as JSON lines: signed checkpoints around each "
                                 "span's entries (the run's in full, others' as their leaf "
                                 "digest), then the signed manifest line")},
                       **problem_responses(404, 422)})
async def get_run_evidence(runtime: RuntimeDep, _actor: OperatorDep,
                           run_id: Annotated[int, Path(ge=1, le=MAX_BIGINT)]
                           ) -> StreamingResponse:
    """The run's deletions as slices of the evidence log: each between two signed
    checkpoints, its entries in order (the run's records in full: object, policy version,
    operation key, outcome, upstream status, attempts, completed_at, no payloads; other
    entries as their leaf digest only), each completion's segment of entries closed by the
    chain hash after it, the whole closed by a manifest signed with the evidence key
    (`sweeper evidence verify` checks it offline). The entries were chained when they were
    written, so a row edited since fails the verification. Read page by page, so a slow
    reader holds no database connection; a stream that fails part way ends without its
    final chunk and without its manifest (an incomplete body to the client), never as a
    short clean one."""
    response = await evidence_export(runtime, run_id)
    if response is None:
        raise Problem(404, "run-not-found", "Run not found", f"no run {run_id}")
    return response


async def evidence_export(runtime: Runtime, run_id: int) -> StreamingResponse | None:
    """A run's evidence export as a streamed answer (the API's and the console's), or None
    when there is no such run."""
    if not await progress.run_exists(runtime.engine, run_id):
        return None
    # the checkpoint and the spans are read before answering: a database failing now gets
    # its problem answer, not a 200
    lines = await export_slices.run_export(runtime.engine, runtime.signer, run_id)
    return StreamingResponse(lines, media_type="application/x-ndjson")
