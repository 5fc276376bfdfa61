"""Who may call what: the role every route needs, in one table, and the refusal.

The gate authenticates the bearer token (401 otherwise) and records its `Caller`; the
route's class then compares the caller's role with the route's entry here before the body
is parsed (`JsonRoute` for the API, `signed_in` for the console), and answers 403
`insufficient-role` naming the role needed and the role held. A route missing from the
table needs `admin` (refused rather than open), and tests/unit/test_access.py fails for it.

One right depends on the body rather than the route: resuming a scope with `lift_closure`
(overriding the upstream's own closure) needs `LIFT_CLOSURE`; both resume routes call
`demand` for it once they have read the body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from starlette.types import Scope

from service.config.tokens import Caller, Role
from service.errors import Problem
from service.http.api.gate import CALLER, unauthorized
from service.http.api.problems import problem_doc

PUBLIC: Final = "public"  # no token: health, metrics, signed webhooks, console sign-in
Access = Role | Literal["public"]

VIEWER, OPERATOR, ADMIN = Role.VIEWER, Role.OPERATOR, Role.ADMIN
# (method, route path) -> what it needs. HEAD is served as GET.
ROUTES: Final[Mapping[tuple[str, str], Access]] = {
    # open to all: the orchestrator's probes, Prometheus, the contract, signed deliveries
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/metrics"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/docs/oauth2-redirect"): PUBLIC,
    ("GET", "/redoc"): PUBLIC,
    ("POST", "/v1/webhooks/{source}"): PUBLIC,
    # the operator API
    ("GET", "/v1/policies"): VIEWER,
    ("POST", "/v1/items"): OPERATOR,
    ("GET", "/v1/items"): VIEWER,
    ("POST", "/v1/items/redrive"): OPERATOR,
    ("POST", "/v1/items/cancel"): OPERATOR,
    ("POST", "/v1/runs"): OPERATOR,
    ("GET", "/v1/runs"): VIEWER,
    ("GET", "/v1/runs/{run_id}"): VIEWER,
    ("GET", "/v1/runs/{run_id}/discovery"): VIEWER,
    ("GET", "/v1/runs/{run_id}/evidence"): VIEWER,
    ("GET", "/v1/scopes"): VIEWER,
    ("PUT", "/v1/scopes/{scope}"): OPERATOR,
    ("POST", "/v1/scopes/{scope}/pause"): OPERATOR,
    ("POST", "/v1/scopes/{scope}/resume"): OPERATOR,  # with lift_closure: LIFT_CLOSURE
    ("GET", "/v1/workers"): VIEWER,
    ("POST", "/v1/workers/pause"): OPERATOR,
    ("POST", "/v1/workers/resume"): OPERATOR,
    ("PUT", "/v1/tenants/{tenant_id:path}/credentials/{upstream}"): ADMIN,
    ("DELETE", "/v1/tenants/{tenant_id:path}/credentials/{upstream}"): ADMIN,
    ("GET", "/v1/tenants/{tenant_id:path}/credentials"): VIEWER,  # fingerprints, never secrets
    ("POST", "/v1/holds"): OPERATOR,  # keeping more is the safe side: releasing is admin
    ("GET", "/v1/holds"): VIEWER,
    ("GET", "/v1/holds/{hold_id}"): VIEWER,
    ("POST", "/v1/holds/{hold_id}/release"): ADMIN,
    ("GET", "/v1/evidence"): VIEWER,
    ("GET", "/v1/evidence/public-key"): VIEWER,
    ("GET", "/v1/evidence/log"): VIEWER,  # a slice of the log: ids and outcomes, as the run export
    ("GET", "/v1/evidence/checkpoints"): VIEWER,
    # the console: signing in is open; its pages read, its forms change
    ("GET", "/console/static/{name:path}"): PUBLIC,
    ("GET", "/console/sign-in"): PUBLIC,
    ("POST", "/console/sign-in"): PUBLIC,
    ("POST", "/console/sign-out"): VIEWER,
    ("GET", "/console"): VIEWER,
    ("GET", "/console/overview/live"): VIEWER,
    ("GET", "/console/charts/outcomes"): VIEWER,
    ("GET", "/console/charts/backlog"): VIEWER,
    ("GET", "/console/charts/oldest"): VIEWER,
    ("GET", "/console/charts/leases"): VIEWER,
    ("GET", "/console/charts/scope"): VIEWER,
    ("GET", "/console/charts/runs/{run_id}"): VIEWER,
    ("GET", "/console/runs"): VIEWER,
    ("GET", "/console/runs/{run_id}"): VIEWER,
    ("GET", "/console/runs/{run_id}/live"): VIEWER,
    ("GET", "/console/runs/{run_id}/evidence"): VIEWER,
    ("GET", "/console/items"): VIEWER,
    ("GET", "/console/items/{item_id}"): VIEWER,
    ("GET", "/console/scopes"): VIEWER,
    ("GET", "/console/scope"): VIEWER,
    ("GET", "/console/webhooks"): VIEWER,
    ("GET", "/console/audit"): VIEWER,
    ("GET", "/console/audit/{action_id}"): VIEWER,
    ("POST", "/console/runs"): OPERATOR,
    ("POST", "/console/runs/{run_id}/delete"): OPERATOR,
    ("POST", "/console/items/action"): OPERATOR,
    ("POST", "/console/scope/pause"): OPERATOR,
    ("POST", "/console/scope/resume"): OPERATOR,  # with lift_closure: LIFT_CLOSURE
    ("POST", "/console/scope/budget"): OPERATOR,
    ("POST", "/console/workers/{change}"): OPERATOR,
}
LIFT_CLOSURE: Final = Role.ADMIN

INSUFFICIENT_ROLE: Final = "insufficient-role"


def needed(method: str, path: str) -> Access:
    """What a route (by its method and path template) needs; admin when undeclared."""
    return ROUTES.get(("GET" if method == "HEAD" else method, path), Role.ADMIN)


def refusal(need: Role, held: Role, what: str = "this operation") -> Problem:
    """The 403 for a caller whose role is below what it asked for."""
    return Problem(403, INSUFFICIENT_ROLE, "Role too low",
                   f"{what} needs the {need.label} role; this token has the {held.label} role",
                   required_role=need.label, role=held.label)


def demand(caller: Caller, need: Role, what: str) -> None:
    """Raise the 403 unless the caller's role reaches `need` (for a right the body asks
    for, such as LIFT_CLOSURE)."""
    if caller.role < need:
        raise refusal(need, caller.role, what)


def check(need: Access, scope: Scope) -> None:
    """Refuse a request to a route that needs `need`: 401 without the caller the gate
    authenticated (a route outside its prefix: refused, never open), 403 below the role."""
    if not isinstance(need, Role):
        return  # public
    caller: Caller | None = scope.get(CALLER)
    if caller is None:
        raise unauthorized("send Authorization: Bearer <token>")
    if caller.role < need:
        raise refusal(need, caller.role)


FORBIDDEN_DOC: Final = problem_doc(
    "the token's role is below the one this operation needs (`insufficient-role`; "
    "`required_role` and `role` name both)")


def documented(need: Access) -> tuple[dict[str, Any], dict[int | str, dict[str, Any]]]:
    """What an operation's OpenAPI entry says of its access: `x-sweeper-role`, and the 403
    where a viewer's token is refused."""
    if not isinstance(need, Role):
        return {"x-sweeper-role": PUBLIC}, {}
    return {"x-sweeper-role": need.label}, ({403: FORBIDDEN_DOC} if need > Role.VIEWER else {})
