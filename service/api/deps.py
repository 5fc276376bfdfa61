"""Dependencies shared by routers: the runtime and the bearer-token check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.errors import Problem
from service.runtime import Runtime

_bearer = HTTPBearer(auto_error=False, description="one of SWEEPER_API_TOKENS")


def get_runtime(request: Request) -> Runtime:
    """The process runtime stored in the lifespan state."""
    runtime: Runtime = request.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def require_operator(
    runtime: RuntimeDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """Accept the request only with a configured bearer token; returns the actor name."""
    challenge = {"WWW-Authenticate": 'Bearer realm="sweeper"'}
    if credentials is None:
        raise Problem(401, "unauthorized", "Authentication required",
                      "send Authorization: Bearer <token>", headers=challenge)
    actor = runtime.tokens.match(credentials.credentials)
    if actor is None:
        raise Problem(401, "unauthorized", "Authentication required",
                      "the bearer token is not valid", headers=challenge)
    return actor


OperatorDep = Annotated[str, Depends(require_operator)]
