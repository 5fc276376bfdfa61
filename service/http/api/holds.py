"""Legal holds: place, list, read and release them (service/ledger/holds.py enforces them)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query
from fastapi.openapi.models import Example
from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.errors import Problem
from service.http.api.bodies import (
    ID_PATTERN,
    MAX_BIGINT,
    Id,
    JsonRoute,
    PolicyName,
    RequestBody,
    Timestamp,
)
from service.http.api.deps import OperatorDep, RuntimeDep
from service.http.api.problems import problem_responses, validation_problem
from service.http.api.reasons import Reason, Reference
from service.http.api.tenants import stored_filter, stored_object, stored_tenant
from service.ledger import hold_marking, holds, registration

router = APIRouter(prefix="/v1", tags=["holds"], route_class=JsonRoute,
                   responses=problem_responses(401, 503))

class HoldIn(RequestBody):
    """What a hold covers and why. It covers the tenant's items of every policy unless
    `policy` names one, and all of their objects unless `object_ids` or `object_id_prefix`
    (not both) narrows it; items registered later are covered too."""

    # the schema states the server's rule: not both narrowing fields given (non-null)
    model_config = ConfigDict(json_schema_extra={"not": {
        "required": ["object_ids", "object_id_prefix"],
        "properties": {"object_ids": {"not": {"type": "null"}},
                       "object_id_prefix": {"not": {"type": "null"}}}}})

    tenant_id: Id
    policy: PolicyName | None = None
    object_ids: list[Id] | None = Field(default=None, min_length=1, max_length=1000)
    object_id_prefix: Id | None = Field(default=None, description=(
        "covers every object id that starts with it (at least one character)"))
    reason: Reason = Field(examples=["litigation hold: order dispute"])
    reference: Reference = Field(examples=["CASE-2291"])
    expires_at: Timestamp | None = Field(default=None, description=(
        "when the hold ends by itself (in the future); none: until released. Items stay "
        "held up to a few seconds past it, never less"))

    @model_validator(mode="after")
    def _one_selector(self) -> HoldIn:
        if self.object_ids is not None and self.object_id_prefix is not None:
            raise ValueError("give object_ids or object_id_prefix, not both")
        return self


class ReleaseIn(RequestBody):
    """Why the hold ends (recorded on the hold and in the audit trail)."""

    why: Reason = Field(examples=["case CASE-2291 settled"])


class InFlight(BaseModel):
    """Calls that were in flight when the hold took effect: items leased then, and
    covered items that finished after the hold was recorded. No call starts for a covered
    item after `effective_at`."""

    count: int
    item_ids: list[int] = Field(description=f"at most {hold_marking.IN_FLIGHT_IDS_KEPT}, by id")


class HoldOut(BaseModel):
    """A legal hold as stored."""

    id: int
    tenant_id: str
    policy: str | None
    object_ids: list[str] | None
    object_id_prefix: str | None
    reason: str
    reference: str
    expires_at: datetime | None
    active: bool = Field(description="neither released nor past its expiry")
    placed_by: str
    placed_at: datetime = Field(description="when claims began to skip what it covers")
    effective_at: datetime | None = Field(description=(
        "when its items were marked: from then on no call starts for any of them (null "
        "while the marking is still to finish; claims skip them meanwhile)"))
    items_held: int = Field(description="pending and leased items it covered when placed")
    in_flight: InFlight
    released_at: datetime | None
    released_by: str | None
    release_why: str | None


class HoldPage(BaseModel):
    """Newest first; pass `next_before` as `before` for the next page."""

    holds: list[HoldOut]
    next_before: int | None


class ReleasedOut(HoldOut):
    """The hold after its release, and where its items went."""

    items_freed: int = Field(description="items no other active hold covers: claimable again "
                                         "once due and released by a run")
    items_still_held: int = Field(description="items another active hold covers")


HOLD_EXAMPLES: dict[str, Example] = {
    "tenant": {"summary": "hold everything of one shop",
               "value": {"tenant_id": "acme.myshopify.com", "reason": "litigation hold",
                         "reference": "CASE-2291"}},
    "customer": {"summary": "hold one customer's carts under one policy, until a date",
                 "value": {"tenant_id": "acme.myshopify.com", "policy": "cart-retention",
                           "object_ids": ["7702"], "reason": "regulator request",
                           "reference": "DPA-2026-114",
                           "expires_at": "2099-03-01T00:00:00Z"}},
}
RELEASE_EXAMPLES: dict[str, Example] = {
    "settled": {"summary": "the case is closed", "value": {"why": "case CASE-2291 settled"}},
}

HoldId = Annotated[int, Path(ge=1, le=MAX_BIGINT)]


def _out(hold: dict[str, Any]) -> dict[str, Any]:
    return {**hold, "in_flight": {"count": hold["in_flight"],
                                  "item_ids": hold["in_flight_item_ids"]}}


@router.post("/holds", operation_id="placeHold", status_code=201, response_model=HoldOut,
             responses=problem_responses(400, 422))
async def place_hold(runtime: RuntimeDep, actor: OperatorDep,
                     body: Annotated[HoldIn, Body(openapi_examples=HOLD_EXAMPLES)]
                     ) -> dict[str, Any]:
    """Place a legal hold. When this answers, no upstream call starts for any item it
    covers, on any replica, until it is released or expires; the calls that were already
    in flight are listed. Each request places a new hold."""
    errors = []
    if body.policy is not None and runtime.policies.policy(body.policy) is None:
        errors.append({"loc": ["body", "policy"], "type": "unknown_policy",
                       "message": "no such policy in the policies file"})
    ids = [("tenant_id", body.tenant_id)] + [
        (f"object_ids.{n}", v) for n, v in enumerate(body.object_ids or ())]
    for field, value in ids:
        problem = registration.id_problem(value)
        if problem:
            errors.append({"loc": ["body", *field.split(".")], "type": "invalid_id",
                           "message": problem})
    prefix = body.object_id_prefix
    # a prefix may be "." or ".." (of ".x"), which no whole id may be
    if prefix is not None and prefix not in registration.DOT_SEGMENTS and (
            problem := registration.id_problem(prefix)):
        errors.append({"loc": ["body", "object_id_prefix"], "type": "invalid_id",
                       "message": problem})
    if body.expires_at is not None and body.expires_at <= datetime.now(UTC):
        errors.append({"loc": ["body", "expires_at"], "type": "in_the_past",
                       "message": "must be in the future"})
    if errors:
        raise validation_problem(errors)
    # the tenant as the covered items store it: a hold on another spelling would hold nothing
    tenant_id = stored_tenant(runtime.policies, body.tenant_id, body.policy,
                              ("body", "tenant_id"))
    object_ids = None if body.object_ids is None else [
        stored_object(runtime.policies, value, body.policy, ("body", "object_ids", str(n)))
        for n, value in enumerate(body.object_ids)]
    prefix = None if body.object_id_prefix is None else stored_object(
        runtime.policies, body.object_id_prefix, body.policy, ("body", "object_id_prefix"))
    hold = await holds.place(runtime.engine, holds.HoldSpec(
        tenant_id=tenant_id, policy=body.policy, object_ids=object_ids,
        object_id_prefix=prefix, reason=body.reason,
        reference=body.reference, expires_at=body.expires_at), actor=actor)
    return _out(hold)


@router.get("/holds", operation_id="listHolds", response_model=HoldPage,
            responses=problem_responses(422))
async def list_holds(runtime: RuntimeDep, _actor: OperatorDep,
                     tenant_id: Annotated[str | None, Query(
                         min_length=1, max_length=512, pattern=ID_PATTERN)] = None,
                     active: bool | None = None,
                     before: Annotated[int | None, Query(ge=1, le=MAX_BIGINT)] = None,
                     limit: Annotated[int, Query(ge=1, le=500)] = 100) -> dict[str, Any]:
    """Holds newest first, of one tenant or all; `active=true` for those in force."""
    tenant_id = stored_filter(runtime.policies, tenant_id, None, ("query", "tenant_id"))
    rows = await holds.list_holds(runtime.engine, tenant_id=tenant_id, active=active,
                                  before=before, limit=limit)
    return {"holds": [_out(r) for r in rows],
            "next_before": rows[-1]["id"] if len(rows) == limit else None}


@router.get("/holds/{hold_id}", operation_id="getHold", response_model=HoldOut,
            responses=problem_responses(404, 422))
async def get_hold(runtime: RuntimeDep, _actor: OperatorDep, hold_id: HoldId
                   ) -> dict[str, Any]:
    """One hold."""
    hold = await holds.get(runtime.engine, hold_id)
    if hold is None:
        raise Problem(404, "hold-not-found", "Hold not found", f"no hold {hold_id}")
    return _out(hold)


@router.post("/holds/{hold_id}/release", operation_id="releaseHold",
             response_model=ReleasedOut, responses=problem_responses(400, 404, 409, 422))
async def release_hold(runtime: RuntimeDep, actor: OperatorDep, hold_id: HoldId,
                       body: Annotated[ReleaseIn, Body(openapi_examples=RELEASE_EXAMPLES)]
                       ) -> dict[str, Any]:
    """Release a hold. Its items that no other active hold covers can be deleted again:
    those already released by a run and due are claimable at once, the others wait for
    the next run."""
    try:
        hold = await holds.release(runtime.engine, hold_id, why=body.why, actor=actor)
    except holds.HoldNotFound:
        raise Problem(404, "hold-not-found", "Hold not found", f"no hold {hold_id}") from None
    except holds.HoldAlreadyReleased as exc:
        raise Problem(409, "hold-already-released", "Hold already released",
                      f"hold {hold_id} was released at "
                      f"{exc.hold['released_at'].isoformat()}") from None
    return _out(hold)
