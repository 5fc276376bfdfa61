"""The OpenAPI contract: a valid 3.1 document, sorted, stable ids, every error declared as
problem+json, examples on every request body. (The drift check runs the real command in
tests/integration/test_cli.py.)"""

from __future__ import annotations

import json
import re
from typing import Any, Final

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


# JSON Schema 2020-12's keywords and OpenAPI 3.1's own: a bound written as anything else
# (pydantic's `ge`, say) is invisible to validators and generated clients
SCHEMA_KEYWORDS: Final = frozenset({
    "$ref", "$defs", "$schema", "$id", "$comment", "$anchor", "type", "enum", "const", "title",
    "description", "default", "examples", "example", "deprecated", "readOnly", "writeOnly",
    "format", "contentMediaType", "contentEncoding", "contentSchema", "multipleOf", "maximum",
    "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern",
    "maxItems", "minItems", "uniqueItems", "maxContains", "minContains", "maxProperties",
    "minProperties", "required", "dependentRequired", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "items", "prefixItems", "contains",
    "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if",
    "then", "else", "dependentSchemas", "discriminator", "xml", "externalDocs"})
_BY_NAME: Final = ("properties", "patternProperties", "$defs", "dependentSchemas")
_ONE: Final = ("items", "additionalProperties", "propertyNames", "contains", "not", "if",
               "then", "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_MANY: Final = ("allOf", "anyOf", "oneOf", "prefixItems")


def unknown_keywords(schema: Any, where: str) -> list[str]:
    """Every key of `schema` and its subschemas that is no schema keyword."""
    if not isinstance(schema, dict):
        return []
    found = [f"{where}/{k}" for k in schema
             if k not in SCHEMA_KEYWORDS and not k.startswith("x-")]
    for key in _BY_NAME:
        for name, sub in schema.get(key, {}).items():
            found += unknown_keywords(sub, f"{where}/{key}/{name}")
    for key in _ONE:
        found += unknown_keywords(schema.get(key), f"{where}/{key}")
    for key in _MANY:
        for i, sub in enumerate(schema.get(key, [])):
            found += unknown_keywords(sub, f"{where}/{key}/{i}")
    return found


def test_every_bound_is_a_json_schema_keyword(doc: dict[str, Any]) -> None:
    found = [bad for name, schema in doc["components"]["schemas"].items()
             for bad in unknown_keywords(schema, name)]
    for method, path, op in operations(doc):
        for param in op.get("parameters", []):
            found += unknown_keywords(param.get("schema"), f"{method} {path} {param['name']}")
        for media in op.get("requestBody", {}).get("content", {}).values():
            found += unknown_keywords(media.get("schema"), f"{method} {path} body")
    assert found == []
    # and the rule sees what it is for
    assert unknown_keywords({"anyOf": [{"type": "integer", "ge": 1}]}, "x") == ["x/anyOf/0/ge"]
