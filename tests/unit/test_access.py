"""Every route of the app has a declared role (service/http/api/access.py), so a new route cannot
forget one; the table names no route that does not exist; and the OpenAPI document states
each operator operation's role."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fastapi.routing import _IncludedRouter
from starlette.routing import BaseRoute

from service.app import create_app
from service.commands.openapi import openapi_document
from service.config.policies import Policies
from service.config.settings import Settings, async_url
from service.config.tokens import Role
from service.http.api import access


def every_route(routes: Iterable[BaseRoute]) -> Iterator[tuple[str, str]]:
    """(method, path) of every route, included routers opened (HEAD is served as GET)."""
    for route in routes:
        if isinstance(route, _IncludedRouter):
            yield from every_route(route.original_router.routes)
            continue
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                yield method, route.path


APP = create_app(Settings.model_construct(), Policies.empty(),
                 async_url("postgresql://localhost/sweeper"))
ROUTES = set(every_route(APP.router.routes))


def test_every_route_has_a_declared_role() -> None:
    undeclared = sorted(ROUTES - set(access.ROUTES))
    assert not undeclared, f"add these routes to service/http/api/access.py ROUTES: {undeclared}"
    assert len(ROUTES) > 50  # the walk reached the included routers


def test_the_table_names_only_routes_that_exist() -> None:
    assert sorted(set(access.ROUTES) - ROUTES) == []


def test_only_probes_metrics_docs_webhooks_and_sign_in_are_public() -> None:
    public = {path for (method, path), need in access.ROUTES.items() if need == access.PUBLIC}
    assert {p for p in public if p.startswith("/v1/")} == {"/v1/webhooks/{source}"}
    assert {p for p in public if p.startswith("/console")} == {
        "/console/sign-in", "/console/static/{name:path}"}


def test_reads_are_for_viewers_and_admin_holds_the_irreversible() -> None:
    for (method, path), need in access.ROUTES.items():
        if method == "GET" and need != access.PUBLIC:
            assert need is Role.VIEWER, path
    assert access.ROUTES[("POST", "/v1/holds/{hold_id}/release")] is Role.ADMIN
    assert access.ROUTES[("PUT", "/v1/tenants/{tenant_id:path}/credentials/{upstream}")] \
        is Role.ADMIN
    assert access.LIFT_CLOSURE is Role.ADMIN
    assert access.needed("POST", "/v1/not-in-the-table") is Role.ADMIN  # fail closed


def test_the_contract_states_each_operations_role() -> None:
    for path, operations in openapi_document()["paths"].items():  # type: ignore[attr-defined]
        for method, operation in operations.items():
            if not path.startswith("/v1/"):
                continue
            role = operation["x-sweeper-role"]
            assert role in ("public", "viewer", "operator", "admin"), (method, path)
            assert ("403" in operation["responses"]) == (role in ("operator", "admin")), (
                method, path)
