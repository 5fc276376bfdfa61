"""A tenant id (and an object id) as the API takes it: in the one spelling the ledger stores
(service/config/tenants.py; a policy's object_id_case), or refused with a 422 naming the form."""

from __future__ import annotations

from collections.abc import Sequence

from service.config.policies import Policies
from service.http.api.problems import validation_problem


def stored_tenant(policies: Policies, tenant_id: str, policy: str | None,
                  loc: Sequence[str]) -> str:
    """`tenant_id` as the ledger stores it for `policy` (or every policy); a 422 at `loc`
    when, without a policy, the spelling is ambiguous."""
    try:
        return policies.tenant(tenant_id, policy)
    except ValueError as exc:
        raise validation_problem([{"loc": list(loc), "type": "tenant_not_canonical",
                                   "message": str(exc)}]) from None


def stored_filter(policies: Policies, tenant_id: str | None, policy: str | None,
                  loc: Sequence[str]) -> str | None:
    """A tenant filter (None: every tenant) in the stored spelling."""
    return None if tenant_id is None else stored_tenant(policies, tenant_id, policy, loc)


def stored_object(policies: Policies, object_id: str, policy: str | None,
                  loc: Sequence[str]) -> str:
    """`object_id` (or an id prefix) as the ledger stores it for `policy` (or every policy);
    a 422 at `loc` when, without a policy, the case is ambiguous."""
    try:
        return policies.object_id(object_id, policy)
    except ValueError as exc:
        raise validation_problem([{"loc": list(loc), "type": "object_id_not_canonical",
                                   "message": str(exc)}]) from None
