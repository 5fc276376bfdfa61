"""Schemathesis over the whole OpenAPI contract, in-process (ASGI) against a real database:
every operation, valid and invalid inputs, every check. Zero server errors, zero schema
violations.

One test per operation (labels read from the committed openapi/openapi.json, which another
test keeps equal to the app's). Each builds the app on its own fresh database and runs
Hypothesis over schemathesis' strategy for that operation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.python import asgi

from service.app import create_app
from service.settings import async_url
from tests.conftest import TOKEN_A, test_settings
from tests.integration.test_pipeline import make_policies


@schemathesis.auth()
class BearerToken:
    """The operator token on every request, through schemathesis' own auth hook: its
    negative cases and auth checks (a missing or ignored token) then still apply."""

    def get(self, case: Any, context: Any) -> str:
        return TOKEN_A

    def set(self, case: Any, data: str, context: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}

CONTRACT = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"
CONFIG = SchemathesisConfig.from_path(Path(__file__).with_name("schemathesis.toml"))
EXAMPLES = 30


def cases() -> list[tuple[str, GenerationMode]]:
    """Every operation with valid inputs; those that take inputs also with invalid ones
    (an operation without parameters or body has no invalid request to generate)."""
    out = []
    for path, item in json.loads(CONTRACT.read_text())["paths"].items():
        for method, op in item.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            label = f"{method.upper()} {path}"
            out.append((label, GenerationMode.POSITIVE))
            if op.get("parameters") or op.get("requestBody"):
                out.append((label, GenerationMode.NEGATIVE))
    return sorted(out)


@pytest.mark.slow
@pytest.mark.parametrize(("label", "mode"), cases())
def test_operation_honours_the_contract(db_url: str, label: str, mode: GenerationMode) -> None:
    app = create_app(test_settings(db_url, workers=0), make_policies("http://127.0.0.1:9"),
                     async_url(db_url))
    operation = schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG
                                               ).find_operation_by_label(label)
    assert operation is not None, label

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        case.call_and_validate()

    try:
        check()
    finally:
        asgi.shutdown_lifespans()
