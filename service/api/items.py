"""Bulk, idempotent registration of cleanup obligations."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body
from pydantic import AwareDatetime, BaseModel, Field

from service import ledger
from service.api.deps import OperatorDep, RuntimeDep
from service.api.problems import ProblemDetails, validation_problem

MAX_ITEMS_PER_REQUEST = 10_000

router = APIRouter(prefix="/v1", tags=["items"], responses={
    401: {"model": ProblemDetails, "description": "no valid token"},
    422: {"model": ProblemDetails, "description": "invalid entries, named"}})


class ItemIn(BaseModel):
    """One obligation: remove this object of this tenant under this policy once due."""

    tenant_id: str = Field(examples=["acme.myshopify.com"])
    object_id: str = Field(examples=["cart-8812"])
    policy: str = Field(examples=["cart-retention"])
    due_at: AwareDatetime = Field(examples=["2026-12-01T00:00:00Z"])


class ItemsIn(BaseModel):
    """Up to 10,000 items; the request is all-or-nothing."""

    items: list[ItemIn] = Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)


class RegistrationOut(BaseModel):
    """How the request changed the ledger."""

    inserted: int
    advanced: int
    unchanged: int


@router.post("/items", operation_id="registerItems", response_model=RegistrationOut)
async def register_items(runtime: RuntimeDep, _actor: OperatorDep,
                         body: Annotated[ItemsIn, Body()]) -> RegistrationOut:
    """Register obligations. The same item twice is one row; an earlier due_at wins."""
    errors = []
    registrations = []
    for i, item in enumerate(body.items):
        policy = runtime.policies.policy(item.policy)
        if policy is None:
            errors.append({"loc": ["body", "items", str(i), "policy"], "type": "unknown_policy",
                           "message": "no such policy in the policies file"})
        for field in ("tenant_id", "object_id"):
            problem = ledger.id_problem(getattr(item, field))
            if problem:
                errors.append({"loc": ["body", "items", str(i), field], "type": "invalid_id",
                               "message": problem})
        if policy is not None and not errors:
            registrations.append(ledger.Registration(item.tenant_id, item.object_id, policy,
                                                     item.due_at))
    if errors:
        raise validation_problem(errors[:100])
    result = await ledger.register(runtime.engine, registrations)
    return RegistrationOut(inserted=result.inserted, advanced=result.advanced,
                           unchanged=result.unchanged)
