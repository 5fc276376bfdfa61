"""Dependencies shared by routers: the runtime and the bearer-token check."""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.config.tokens import Caller
from service.http.api.gate import CALLER, unauthorized
from service.http.api.problems import validation_problem
from service.runtime import Runtime

_bearer = HTTPBearer(auto_error=False, description=(
    "a token of SWEEPER_API_TOKENS (admin), SWEEPER_OPERATOR_TOKENS or SWEEPER_VIEWER_TOKENS"))


def get_runtime(request: Request) -> Runtime:
    """The process runtime stored in the lifespan state."""
    runtime: Runtime = request.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def require_caller(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    """The token the gate authenticated (it answers 401 before routing otherwise; the route
    has checked its role); the bearer scheme is declared here for the OpenAPI document."""
    caller: Caller | None = request.scope.get(CALLER)
    if caller is None:  # a route mounted outside the gate's prefix: refuse, never open
        raise unauthorized("send Authorization: Bearer <token>")
    return caller


def require_operator(caller: Annotated[Caller, Depends(require_caller)]) -> str:
    """Who the audit trail names for the request: its token's id."""
    return caller.id


CallerDep = Annotated[Caller, Depends(require_caller)]
OperatorDep = Annotated[str, Depends(require_operator)]


def strict_query(request: Request) -> None:
    """A query parameter the route does not declare is a 422 naming it (a typo such as
    `?limt=10` must not be silently ignored), never its value; so is one given twice (no
    operation takes a list in its query: `?tenant_id=a&tenant_id=b` would be read as one of
    them)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    given = Counter(name for name, _ in request.query_params.multi_items())
    undeclared = set(given) - _query_names(dependant)
    unknown = sorted(undeclared)
    repeated = sorted(name for name, n in given.items() if n > 1 and name not in undeclared)
    if unknown or repeated:
        raise validation_problem([
            *({"loc": ["query", name[:64]], "type": "unknown_parameter",
               "message": "this operation has no such query parameter"} for name in unknown[:20]),
            *({"loc": ["query", name[:64]], "type": "repeated_parameter",
               "message": "this parameter takes one value; it was given more than once"}
              for name in repeated[:20])])


def _query_names(dependant: Any) -> set[str]:
    """The query parameters a route declares, its dependencies' included."""
    names = {str(param.alias) for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names
