"""The methods a path allows, for `Allow` on 405 and OPTIONS answers."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.routing import BaseRoute, Match
from starlette.types import Scope


class RouteMethods:
    """Every route of the app, flat (FastAPI keeps included routers as opaque entries), to
    tell which methods a path allows."""

    def __init__(self, routes: Iterable[BaseRoute]) -> None:
        self.routes = [r for r in routes if getattr(r, "methods", None)]

    def allowed(self, scope: Scope) -> set[str]:
        """Every method some route serves at this path (HEAD wherever GET is), plus
        OPTIONS; empty when no route has this path."""
        methods: set[str] = set()
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                methods |= set(getattr(route, "methods", ()))
        if "GET" in methods:
            methods.add("HEAD")
        return methods | {"OPTIONS"} if methods else methods


def allow_header(methods: set[str]) -> str:
    """The `Allow` field value (RFC 9110 10.2.1)."""
    return ", ".join(sorted(methods))
