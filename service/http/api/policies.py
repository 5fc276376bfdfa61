"""Operators read the loaded policies (never the secrets the file names)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from service.config.policies import Policy
from service.http.api.bodies import JsonRoute
from service.http.api.deps import OperatorDep, RuntimeDep
from service.http.api.problems import problem_responses

router = APIRouter(prefix="/v1", tags=["policies"], route_class=JsonRoute,
                   responses=problem_responses(401))


class PolicyView(BaseModel):
    """A policy as loaded from the policies file."""

    name: str
    version: int
    # an HTTP policy's upstream, method and path; a store target's store (then they are null)
    upstream: str | None
    method: str | None
    path: str | None
    target_store: str | None = None
    # where candidates come from: "registered" (POST /v1/items, webhooks), "store:NAME" (a
    # store's query) or "upstream:NAME" (an upstream's list calls)
    source: str = "registered"
    scope: str
    rate_per_second: float
    burst: int
    rate_unit: str = "calls"
    lease_seconds: int
    max_attempts: int
    absent_means_deleted: bool


class PolicyList(BaseModel):
    """All loaded policies and where they came from."""

    source: str
    policies: list[PolicyView]


@router.get("/policies", operation_id="listPolicies", response_model=PolicyList)
async def list_policies(runtime: RuntimeDep, _actor: OperatorDep) -> PolicyList:
    """The policies this process enforces, sorted by name."""
    views = []
    for name in sorted(runtime.policies.policies):
        cfg = runtime.policies.policies[name].config
        views.append(PolicyView(
            name=name, version=cfg.version, upstream=cfg.upstream,
            method=None if cfg.target else cfg.method, path=cfg.path,
            target_store=cfg.target.store if cfg.target else None,
            source=_source(runtime.policies.policies[name]),
            scope=cfg.scope, rate_per_second=cfg.rate.per_second,
            burst=cfg.rate.burst, rate_unit=cfg.rate.unit, lease_seconds=cfg.lease_seconds,
            max_attempts=cfg.max_attempts, absent_means_deleted=cfg.absent_means_deleted))
    return PolicyList(source=runtime.policies.source, policies=views)


def _source(policy: Policy) -> str:
    if policy.store_source is not None:
        return f"store:{policy.store_source.store}"
    if policy.list_source is not None:
        return f"upstream:{policy.list_source.upstream}"
    return "registered"
