"""The OpenAPI contract: a valid 3.1 document, sorted, stable ids, every error declared as
problem+json, examples on every request body. (The drift check runs the real command in
tests/integration/test_cli.py.)"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from service.commands.openapi import openapi_document, render_openapi
from tests.conftest import REPO_ROOT

CHECKED_IN = REPO_ROOT / "openapi" / "openapi.json"
PROBLEM_REF = {"$ref": "#/components/schemas/ProblemDetails"}
OPERATION_ID = re.compile(r"^[a-z][A-Za-z]+$")  # chosen by hand, not FastAPI's generated ids


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, ops in doc["paths"].items()
            for method, op in ops.items()]


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return json.loads(render_openapi())


def test_the_document_is_valid_openapi(doc: dict[str, Any]) -> None:
    assert doc["openapi"].startswith("3.1")
    validate(doc)
    validate(json.loads(CHECKED_IN.read_text(encoding="utf-8")))


def test_the_validator_rejects_a_broken_document(doc: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(doc))
    broken["paths"]["/v1/runs"]["post"]["responses"]["202"] = {"content": {}}  # no description
    with pytest.raises(OpenAPIValidationError):
        validate(broken)


def test_rendering_is_sorted_and_stable() -> None:
    first, second = render_openapi(), render_openapi()
    assert first == second
    assert first == json.dumps(json.loads(first), indent=2, sort_keys=True,
                               ensure_ascii=False) + "\n"
    assert json.loads(first) == openapi_document()


def test_operation_ids_are_explicit_and_unique(doc: dict[str, Any]) -> None:
    ids = [op.get("operationId", "") for _, _, op in operations(doc)]
    assert all(OPERATION_ID.match(i) for i in ids), ids
    assert len(ids) == len(set(ids))


def test_every_error_is_problem_json(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    assert {"type", "title", "status"} <= set(schemas["ProblemDetails"]["required"])
    assert "HTTPValidationError" not in schemas  # FastAPI's default 422 shape is not ours
    for method, path, op in operations(doc):
        for status, response in op["responses"].items():
            if int(status) < 400:
                continue
            assert response["content"] == {"application/problem+json": {"schema": PROBLEM_REF}
                                           }, (method, path, status)
            assert response["description"], (method, path, status)


def test_routes_declare_the_errors_they_can_give(doc: dict[str, Any]) -> None:
    for method, path, op in operations(doc):
        declared = {int(s) for s in op["responses"]}
        where = (method, path, sorted(declared))
        if path.startswith("/v1/webhooks/"):
            # signed deliveries, no bearer token: 401 without a bearer challenge
            assert "security" not in op and 401 in declared and 503 in declared, where
        elif path.startswith("/v1/"):
            assert op["security"] == [{"HTTPBearer": []}], where
            assert 401 in declared, where
            assert "WWW-Authenticate" in op["responses"]["401"]["headers"], where
            # every other /v1 route reads the database
            if path not in ("/v1/policies", "/v1/evidence/public-key"):
                assert 503 in declared, where
                assert "Retry-After" in op["responses"]["503"]["headers"], where
        if op.get("parameters") or op.get("requestBody"):
            assert 422 in declared, where
        if op.get("requestBody"):
            assert 400 in declared, where
        if "{" in path:
            assert 404 in declared, where


def test_every_request_body_has_examples(doc: dict[str, Any]) -> None:
    bodies = [(m, p, op["requestBody"]) for m, p, op in operations(doc) if "requestBody" in op]
    assert bodies
    for method, path, body in bodies:
        examples = body["content"]["application/json"].get("examples")
        assert examples, (method, path)
        for name, example in examples.items():
            assert example["summary"] and "value" in example, (method, path, name)
