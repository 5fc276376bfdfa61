"""Bulk, idempotent registration of cleanup obligations."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query
from fastapi.openapi.models import Example
from pydantic import BaseModel, ConfigDict, Field, with_config
from sqlalchemy.ext.asyncio import AsyncEngine
from typing_extensions import TypedDict

from service.config.policies import Policy
from service.errors import Problem
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
from service.http.api.reasons import Reason
from service.http.api.tenants import stored_filter
from service.ledger import item_selection, registration
from service.ledger.registration import MAX_ID_BYTES

MAX_ITEMS_PER_REQUEST = 10_000

router = APIRouter(prefix="/v1", tags=["items"], route_class=JsonRoute,
                   responses=problem_responses(401, 422, 503))
# the routes that read a JSON body may also answer 400 for one that does not parse
BODY_ERRORS = problem_responses(400)

REGISTER_EXAMPLES: dict[str, Example] = {
    "carts": {"summary": "two carts of one shop, due at the end of their retention",
              "value": {"items": [
                  {"tenant_id": "acme.myshopify.com", "object_id": "cart-8812",
                   "policy": "cart-retention", "due_at": "2026-12-01T00:00:00Z"},
                  {"tenant_id": "acme.myshopify.com", "object_id": "cart-8813",
                   "policy": "cart-retention", "due_at": "2026-12-02T00:00:00Z"}]}},
}
REDRIVE_EXAMPLES: dict[str, Example] = {
    "by-reason": {"summary": "every dead item of a policy that failed with one reason",
                  "value": {"policy": "cart-retention", "reason": "http_422",
                            "why": "upstream fixed its validation bug (INC-1234)"}},
    "by-identity": {"summary": "named items, under the policy's current version",
                    "value": {"items": [{"tenant_id": "acme.myshopify.com",
                                         "object_id": "cart-8812",
                                         "policy": "cart-retention"}],
                              "why": "customer asked again"}},
}
CANCEL_EXAMPLES: dict[str, Example] = {
    "by-id": {"summary": "withdraw items by id before they run",
              "value": {"ids": [41, 42], "why": "registered by mistake"}},
    "tenant": {"summary": "everything pending for one tenant",
               "value": {"tenant_id": "acme.myshopify.com",
                         "why": "tenant left; its store is deleted wholesale"}},
}


# Registration bodies are TypedDicts, not models: up to 10,000 items validate into plain
# dicts, with no model instance built per item; the OpenAPI document is the same.
@with_config(ConfigDict(strict=True, extra="forbid"))
class ItemIn(TypedDict):
    """One obligation: remove this object of this tenant under this policy once due."""

    tenant_id: Annotated[Id, Field(examples=["acme.myshopify.com"])]
    object_id: Annotated[Id, Field(examples=["cart-8812"])]
    policy: PolicyName
    due_at: Annotated[Timestamp, Field(examples=["2026-12-01T00:00:00Z"])]


@with_config(ConfigDict(strict=True, extra="forbid"))
class ItemsIn(TypedDict):
    """Up to 10,000 items; the request is all-or-nothing."""

    items: Annotated[list[ItemIn], Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)]


class RegistrationOut(BaseModel):
    """How the request changed the ledger."""

    inserted: int
    advanced: int
    unchanged: int


ID_FIELDS = ("tenant_id", "object_id")
# The schema has already refused empty ids, control characters and more than 512
# characters; what only the ledger's rules catch is a dot segment, or an id of more than
# 128 characters (4 UTF-8 bytes each at most) that is over 512 bytes.
_SHORT_ID = MAX_ID_BYTES // 4
MAX_ERRORS = 100  # the item errors one answer lists, by item order

ItemError = dict[str, Any]


def _item_error(n: int, field: str, kind: str, message: str) -> ItemError:
    return {"loc": ["body", "items", str(n), field], "type": kind, "message": message}


def _refuse(errors: list[ItemError]) -> None:
    """Answer 422 with the first MAX_ERRORS errors by item, if there are any."""
    if errors:
        errors.sort(key=lambda error: int(error["loc"][2]))
        raise validation_problem(errors[:MAX_ERRORS])


def _named_errors(items: list[ItemIn], policies: Mapping[str, Policy | None]
                  ) -> list[ItemError]:
    """Each item's unknown policy and each id the ledger's rules refuse."""
    errors = []
    for n, item in enumerate(items):
        if policies[item["policy"]] is None:
            errors.append(_item_error(n, "policy", "unknown_policy",
                                      "no such policy in the policies file"))
        for field in ID_FIELDS:
            value = item[field]  # type: ignore[literal-required]
            if value in registration.DOT_SEGMENTS or len(value) > _SHORT_ID:
                problem = registration.id_problem(value)
                if problem:
                    errors.append(_item_error(n, field, "invalid_id", problem))
    return errors


def _call_errors(obligations: registration.Obligations) -> list[ItemError]:
    """What the policies' upstreams and store targets could never take: a host that
    host_pattern refuses (a policy whose upstream makes its host from the item), an id a
    store target's statement cannot cast to its type. Each kind stops just past
    MAX_ERRORS."""
    errors = []
    for n, field, problem in registration.host_problems(
            obligations.tenant_ids, obligations.object_ids, obligations.policy_names,
            obligations.policies):
        errors.append(_item_error(n, field, "invalid_host", problem))
        if len(errors) > MAX_ERRORS:
            break
    for n, problem in registration.id_type_problems(obligations.object_ids,
                                                    obligations.policy_names,
                                                    obligations.policies):
        errors.append(_item_error(n, "object_id", "invalid_object_id", problem))
        if len(errors) > MAX_ERRORS:
            break
    return errors


async def _register(engine: AsyncEngine, obligations: registration.Obligations
                    ) -> registration.RegistrationResult:
    """Register, answering 422 for what only the statement itself finds."""
    try:
        return await registration.register(engine, obligations)
    except registration.ScopeTooLong as exc:
        n = next(n for n, pair in enumerate(zip(obligations.policy_names,
                                                 obligations.tenant_ids, strict=True))
                 if pair == (exc.policy, exc.tenant_id))
        error = _item_error(n, "tenant_id", "scope_too_long", str(exc))
    except registration.ObjectIdRefused as exc:  # likewise
        error = _item_error(exc.index, "object_id", "invalid_object_id", str(exc))
    except registration.HostRefused as exc:  # _call_errors reports these first, all of them
        error = _item_error(exc.index, exc.field, "invalid_host", str(exc))
    raise validation_problem([error]) from None


@router.post("/items", operation_id="registerItems", response_model=RegistrationOut,
             responses=BODY_ERRORS)
async def register_items(runtime: RuntimeDep, _actor: OperatorDep,
                         body: Annotated[ItemsIn, Body(openapi_examples=REGISTER_EXAMPLES)]
                         ) -> RegistrationOut:
    """Register obligations. The same item twice is one row; an earlier due_at wins."""
    items = body["items"]
    policies = {name: runtime.policies.policy(name) for name in {i["policy"] for i in items}}
    _refuse(_named_errors(items, policies))
    # each tenant id as its policy stores it (service/config/tenants.py): the checks below
    # and the ledger see the one spelling
    obligations = registration.Obligations(
        [i["tenant_id"] for i in items], [i["object_id"] for i in items],
        [i["policy"] for i in items], [i["due_at"] for i in items],
        {name: policy for name, policy in policies.items() if policy is not None}).canonical()
    _refuse(_call_errors(obligations))
    result = await _register(runtime.engine, obligations)
    return RegistrationOut(inserted=result.inserted, advanced=result.advanced,
                           unchanged=result.unchanged)


MAX_CHANGE = 10_000
ItemStatus = Literal["pending", "leased", "succeeded", "dead", "cancelled", "skipped"]


class ItemOut(BaseModel):
    """An item as the ledger holds it: identifiers and classified outcomes, no payload."""

    id: int
    tenant_id: str
    object_id: str
    policy: str
    policy_version: int
    operation_key: str
    scope: str
    status: str
    due_at: datetime
    next_attempt_at: datetime | None = Field(
        description="when the next attempt may start; null until a retry is planned")
    attempts: int
    released_at: datetime | None
    batch_id: int | None
    last_outcome: str | None
    last_status_code: int | None
    last_started_at: datetime | None = Field(description=(
        "when the last attempt's call started; a success has no entry in the attempts "
        "list: this, completed_at and last_status_code record it"))
    last_error: str | None
    dead_reason: str | None
    created_at: datetime
    updated_at: datetime
    completed_at: datetime | None
    hold_id: int | None = Field(description=(
        "the legal hold that keeps it from being deleted (GET /v1/holds/{id}); null: none"))
    region: str | None = Field(default=None, description=(
        "the region whose workers alone may process it (its tenant's pin in the policies "
        "file's [regions]); null: its tenant is pinned to none"))


class ItemPage(BaseModel):
    """Items by id; pass `next_after` as `after` for the next page."""

    items: list[ItemOut]
    next_after: int | None


@router.get("/items", operation_id="listItems", response_model=ItemPage)
async def list_items(
    runtime: RuntimeDep, _actor: OperatorDep,
    status: ItemStatus | None = None,
    # no control characters: no name, id or reason the ledger stores has one
    policy: Annotated[str | None, Query(max_length=63, pattern=ID_PATTERN)] = None,
    tenant_id: Annotated[str | None, Query(max_length=512, pattern=ID_PATTERN)] = None,
    reason: Annotated[str | None, Query(max_length=200, pattern=ID_PATTERN)] = None,
    after: Annotated[int | None, Query(ge=0, le=MAX_BIGINT)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> ItemPage:
    """Inspect items, e.g. `status=dead&policy=cart-retention&reason=http_422`."""
    tenant_id = stored_filter(runtime.policies, tenant_id, policy, ("query", "tenant_id"))
    rows = await item_selection.list_items(
        runtime.engine, status=status, after=after, limit=limit,
        item_filter=item_selection.ItemFilter(policy=policy, tenant_id=tenant_id, reason=reason))
    return ItemPage(items=[ItemOut.model_validate(r) for r in rows],
                    next_after=int(str(rows[-1]["id"])) if len(rows) == limit else None)


class ItemRef(RequestBody):
    """An item by identity, under the policy's current version."""

    tenant_id: Id
    object_id: Id
    policy: PolicyName


SELECTORS = ("ids", "items", "policy", "tenant_id", "reason")


class ItemSelection(RequestBody):
    """Which items to change: ids, identities, and/or a filter (at least one), and why."""

    # the schema states what the server enforces: some selector is given and not null (a
    # null one selects nothing). Said as "not every selector given is null" (`properties`
    # looks only at the keys present), not as an anyOf, which generated clients turn into
    # one type per selector.
    model_config = ConfigDict(json_schema_extra={"not": {"properties": {
        selector: {"type": "null"} for selector in SELECTORS}}})

    ids: list[Annotated[int, Field(ge=1, le=MAX_BIGINT), JsonInt]] | None = Field(
        default=None, min_length=1, max_length=MAX_CHANGE)
    items: list[ItemRef] | None = Field(default=None, min_length=1, max_length=MAX_CHANGE)
    policy: PolicyName | None = None
    tenant_id: Id | None = None
    reason: str | None = Field(default=None, min_length=1, max_length=200,
                               pattern=ID_PATTERN,
                               description="match the dead reason / last error code")
    why: Reason = Field(description="recorded in the audit trail",
                        examples=["upstream credential rotated; re-driving 401 failures"])
    limit: Annotated[int, JsonInt] = Field(default=MAX_CHANGE, ge=1, le=MAX_CHANGE)


class ChangeOut(BaseModel):
    """The items the change applied to."""

    count: int
    item_ids: list[int]


def _selection(runtime: RuntimeDep, body: ItemSelection) -> item_selection.ItemFilter:
    if all(getattr(body, selector) is None for selector in SELECTORS):
        raise Problem(422, "empty-selection", "Nothing selected",
                      "give ids, items, or a filter (policy, tenant_id, reason)")
    keys = None
    if body.items:
        keys = []
        for i, ref in enumerate(body.items):
            policy = runtime.policies.policy(ref.policy)
            if policy is None:
                raise validation_problem([{"loc": ["body", "items", str(i), "policy"],
                                           "type": "unknown_policy",
                                           "message": "no such policy in the policies file"}])
            keys.append(registration.operation_key(policy.tenant(ref.tenant_id),
                                                   policy.object_id(ref.object_id),
                                                   policy.name, policy.version))
    tenant_id = stored_filter(runtime.policies, body.tenant_id, body.policy,
                              ("body", "tenant_id"))
    return item_selection.ItemFilter(ids=body.ids, operation_keys=keys, policy=body.policy,
                                     tenant_id=tenant_id, reason=body.reason)


@router.post("/items/redrive", operation_id="redriveItems", response_model=ChangeOut,
             responses=BODY_ERRORS)
async def redrive_items(runtime: RuntimeDep, actor: OperatorDep,
                        body: Annotated[ItemSelection, Body(openapi_examples=REDRIVE_EXAMPLES)]
                        ) -> ChangeOut:
    """Put dead items back to pending with attempts reset, after the cause is fixed."""
    ids = await item_selection.redrive(runtime.engine, _selection(runtime, body), actor=actor,
                                       reason=body.why, limit=body.limit)
    if ids:
        runtime.run_progress.forget()  # their runs have pending items again
    return ChangeOut(count=len(ids), item_ids=ids)


@router.post("/items/cancel", operation_id="cancelItems", response_model=ChangeOut,
             responses=BODY_ERRORS)
async def cancel_items(runtime: RuntimeDep, actor: OperatorDep,
                       body: Annotated[ItemSelection, Body(openapi_examples=CANCEL_EXAMPLES)]
                       ) -> ChangeOut:
    """Withdraw pending items before they run (leased items are in flight and stay)."""
    ids = await item_selection.cancel(runtime.engine, _selection(runtime, body), actor=actor,
                                      reason=body.why, limit=body.limit)
    return ChangeOut(count=len(ids), item_ids=ids)
