"""The checked-in OpenAPI contract: rendered from the app, sorted, stable."""

from __future__ import annotations

import json

from service.app import create_app
from service.config.policies import Policies
from service.config.settings import Settings, async_url


def openapi_document() -> dict[str, object]:
    """The OpenAPI document of an app built with default settings (nothing connects)."""
    app = create_app(Settings.model_construct(), Policies.empty(),
                     async_url("postgresql://localhost/sweeper"))
    return app.openapi()


def render_openapi() -> str:
    """The document as the JSON text written to openapi/openapi.json."""
    return json.dumps(openapi_document(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
