"""Rate budget and pause controls for operators."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Body, Path, Query
from fastapi.openapi.models import Example
from pydantic import AfterValidator, BaseModel, Field

from service.budget import scope_controls as scopes
from service.cluster import leader
from service.config.policy_file import MAX_RATE_PER_SECOND, MAX_SCOPE_BYTES, MIN_RATE_PER_SECOND
from service.errors import Problem
from service.http.api import access
from service.http.api.bodies import ID_PATTERN, JsonInt, JsonRoute, RequestBody
from service.http.api.deps import CallerDep, OperatorDep, RuntimeDep
from service.http.api.problems import problem_responses
from service.http.api.reasons import Reason
from service.http.api.scope_names import scope_name
from service.runtime import Runtime

router = APIRouter(prefix="/v1", tags=["scopes"], route_class=JsonRoute,
                   responses=problem_responses(401, 503))

# the handlers receive the decoded name
ScopeName = Annotated[str, Path(
    min_length=1, max_length=3 * MAX_SCOPE_BYTES,
    description="the scope's name, percent-encoded as one path segment ('/' as %2F)"),
    AfterValidator(scope_name)]


class ScopeOut(BaseModel):
    """A limiter scope: its budget, bucket, closure, pause, and eligible backlog."""

    name: str
    rate_per_second: float
    burst: int
    weight: int
    tokens: float = Field(description=(
        "tokens in the bucket now; below zero while workers hold tokens reserved ahead. "
        "At most the burst less the tokens a worker may still spend late "
        "(burst - ceil(max(rate x 0.02, 1)), at least 1)"))
    closed_until: datetime | None = Field(description=(
        "the upstream's closure: no call before this moment (a 429's Retry-After, an "
        "exhausted RateLimit header, or the backoff after 429s without a date); null or "
        "past: not closed. A resume keeps it unless its body says lift_closure"))
    closed_reason: str | None = Field(default=None, description=(
        "what set closed_until: the answer's reason (http_429, quota_exhausted, "
        "store_guard: the store's guard was over its threshold, ...)"))
    backoff_level: int = Field(description=(
        "429s without a usable date since the last success: the next one closes the scope "
        "for the policy's backoff base x 2^level, at most its backoff max"))
    paused: bool
    paused_reason: str | None
    budget_from_policy: bool
    eligible: int = Field(description=(
        "items a worker may claim now: pending, released, and their next attempt due (not "
        "waiting out a retry delay); the set the sweeper_items_eligible gauge counts, here "
        "per scope, whether or not the scope is open"))
    oldest_due_at: datetime | None = Field(description="the earliest due_at of those items")
    oldest_eligible_age_seconds: float | None = Field(description=(
        "seconds since oldest_due_at, on the database's clock"))
    updated_at: datetime


class ScopePage(BaseModel):
    """Scopes by name; pass `next_after` as `after` for the next page."""

    scopes: list[ScopeOut]
    next_after: str | None


class BudgetIn(RequestBody):
    """A new budget for one scope, effective on every replica within a second."""

    rate_per_second: float = Field(ge=MIN_RATE_PER_SECOND, le=MAX_RATE_PER_SECOND,
                                   examples=[20.0])
    burst: Annotated[int, JsonInt] = Field(ge=1, le=100_000, examples=[5])
    weight: Annotated[int, Field(ge=1, le=1000), JsonInt] | None = None
    reason: Reason | None = None


class ReasonIn(RequestBody):
    """Why (recorded in the audit trail)."""

    reason: Reason | None = None


class ResumeIn(RequestBody):
    """Why (recorded in the audit trail), and whether to override the upstream's closure."""

    reason: Reason | None = None
    lift_closure: bool = Field(default=False, description=(
        "also end a closure the upstream imposed (a 429's Retry-After or its backoff) and "
        "reset the backoff: an operator overriding the upstream, recorded in the audit "
        "trail. Without it a closed scope stays closed until closed_until"))


class LeaderOut(BaseModel):
    """The process running the cluster's once-only loops (publication, holds maintenance,
    retention) and its lease, on the database clock."""

    name: str
    term: int
    lease_expires_at: datetime


class WorkersOut(BaseModel):
    """Whether every replica has stopped claiming, and which process leads the cluster
    (null while the lease has lapsed: a new leader is elected within seconds)."""

    workers_paused: bool
    paused_reason: str | None
    updated_at: datetime
    leader: LeaderOut | None


# a scope route with a body: bad JSON, no such scope, an invalid body
_SCOPE_ERRORS = problem_responses(400, 404, 422)
# an optional JSON body: bad JSON or an invalid body
_BODY_ERRORS = problem_responses(400, 422)

BUDGET_EXAMPLES: dict[str, Example] = {
    "slower": {"summary": "halve a tenant's rate after the upstream complained",
               "value": {"rate_per_second": 2.5, "burst": 5,
                         "reason": "upstream asked for less (ticket 4411)"}},
}
REASON_EXAMPLES: dict[str, Example] = {
    "why": {"summary": "why, for the audit trail",
            "value": {"reason": "upstream maintenance window"}},
}
# An optional body: left out, the parameter's default (None) stands; sent, it must be the
# object (a JSON null is a 422). Typed without `| None`, so the contract declares the object
# itself, not "object or null", which generated clients cannot leave out; each parameter
# says `= None  # type: ignore[assignment]` for it.
ReasonBody = Annotated[ReasonIn, Body(openapi_examples=REASON_EXAMPLES)]
RESUME_EXAMPLES: dict[str, Example] = {
    "lift-pause": {"summary": "lift a pause; a closure the upstream imposed (429) stays",
                   "value": {"reason": "migration done"}},
    "override-closure": {"summary": "also lift the upstream's closure and backoff, once it "
                                    "confirms its limit is reset",
                         "value": {"reason": "upstream reset our limit (ticket 4412)",
                                   "lift_closure": True}},
}


async def _changed(runtime: RuntimeDep, name: str, found: bool) -> ScopeOut:
    """The scope after a change, or 404 when it does not exist."""
    rows = await scopes.list_scopes(runtime.engine, name=name, limit=1) if found else []
    if not rows:
        # the name is not echoed: it holds a tenant id
        raise Problem(404, "scope-not-found", "Scope not found", "no scope of that name")
    return ScopeOut.model_validate(rows[0])


@router.get("/scopes", operation_id="listScopes", response_model=ScopePage,
            responses=problem_responses(422))
async def list_scopes(runtime: RuntimeDep, _actor: OperatorDep,
                      # a scope's name: no control characters
                      after: Annotated[str | None, Query(max_length=512,
                                                         pattern=ID_PATTERN)] = None,
                      limit: Annotated[int, Query(ge=1, le=500)] = 100) -> ScopePage:
    """Every scope's limiter state and backlog."""
    rows = await scopes.list_scopes(runtime.engine, after=after, limit=limit)
    return ScopePage(scopes=[ScopeOut.model_validate(r) for r in rows],
                     next_after=str(rows[-1]["name"]) if len(rows) == limit else None)


@router.put("/scopes/{scope}", operation_id="setScopeBudget", response_model=ScopeOut,
            responses=_SCOPE_ERRORS)
async def set_budget(runtime: RuntimeDep, actor: OperatorDep, scope: ScopeName,
                     body: Annotated[BudgetIn, Body(openapi_examples=BUDGET_EXAMPLES)]
                     ) -> ScopeOut:
    """Change a scope's rate and burst at run time."""
    found = await scopes.set_budget(runtime.engine, scope, rate=body.rate_per_second,
                                    burst=body.burst, weight=body.weight, actor=actor,
                                    reason=body.reason)
    return await _changed(runtime, scope, found)


@router.post("/scopes/{scope}/pause", operation_id="pauseScope", response_model=ScopeOut,
             responses=_SCOPE_ERRORS)
async def pause_scope(runtime: RuntimeDep, actor: OperatorDep, scope: ScopeName,
                      body: ReasonBody = None) -> ScopeOut:  # type: ignore[assignment]
    """Stop calls for one scope; its items wait, unpunished."""
    found = await scopes.pause(runtime.engine, scope, actor=actor,
                               reason=body.reason if body else None)
    return await _changed(runtime, scope, found)


@router.post("/scopes/{scope}/resume", operation_id="resumeScope", response_model=ScopeOut,
             responses=_SCOPE_ERRORS)
async def resume_scope(runtime: RuntimeDep, caller: CallerDep, scope: ScopeName,
                       body: Annotated[ResumeIn, Body(
                           openapi_examples=RESUME_EXAMPLES)] = None  # type: ignore[assignment]
                       ) -> ScopeOut:
    """Lift a scope's pause (an operator's, or `unauthorized` after a 401/403). A closure
    the upstream imposed (a 429's Retry-After, or its backoff) stays until `closed_until`,
    which the answer shows, unless `lift_closure` is true (admin role only): then the
    closure ends and the backoff resets, paused or not. The audit trail records the
    choice."""
    request = body or ResumeIn()
    if request.lift_closure:
        access.demand(caller, access.LIFT_CLOSURE, "lift_closure")
    found = await scopes.resume(runtime.engine, scope, actor=caller.id, reason=request.reason,
                                lift_closure=request.lift_closure)
    return await _changed(runtime, scope, found)


async def _workers(runtime: Runtime) -> WorkersOut:
    found = await leader.current(runtime.engine)
    return WorkersOut.model_validate({
        **await scopes.workers_state(runtime.engine),
        "leader": None if found is None else LeaderOut(
            name=found.holder, term=found.term, lease_expires_at=found.lease_expires_at)})


@router.get("/workers", operation_id="getWorkers", response_model=WorkersOut)
async def get_workers(runtime: RuntimeDep, _actor: OperatorDep) -> WorkersOut:
    """Whether workers are paused everywhere, and the cluster's leader."""
    return await _workers(runtime)


@router.post("/workers/pause", operation_id="pauseWorkers", response_model=WorkersOut,
             responses=_BODY_ERRORS)
async def pause_workers(runtime: RuntimeDep, actor: OperatorDep,
                        body: ReasonBody = None) -> WorkersOut:  # type: ignore[assignment]
    """Stop claiming on every replica without losing the schedule."""
    await scopes.set_workers_paused(runtime.engine, paused=True, actor=actor,
                                    reason=body.reason if body else None)
    return await _workers(runtime)


@router.post("/workers/resume", operation_id="resumeWorkers", response_model=WorkersOut,
             responses=_BODY_ERRORS)
async def resume_workers(runtime: RuntimeDep, actor: OperatorDep,
                         body: ReasonBody = None) -> WorkersOut:  # type: ignore[assignment]
    """Claim again everywhere."""
    await scopes.set_workers_paused(runtime.engine, paused=False, actor=actor,
                                    reason=body.reason if body else None)
    return await _workers(runtime)
