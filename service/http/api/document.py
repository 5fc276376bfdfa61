"""The OpenAPI document the app serves and `sweeper openapi` writes: FastAPI's, completed by
the steps it cannot take from the routes (links between operations, the schema of each line
of a JSON-lines response)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from service.http.api.evidence_lines import add_line_schemas
from service.http.api.links import add_links


def install_document(app: FastAPI) -> None:
    """Make `app.openapi()` return FastAPI's document completed by the steps (built once,
    cached as FastAPI caches it)."""
    build = app.openapi
    steps = (add_links, add_line_schemas)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            for step in steps:
                step(document)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

