"""Every error is problem+json; validation errors never echo the input."""

from __future__ import annotations

import sys

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

from service.errors import Problem
from service.http.api.gate import content_length
from service.http.api.problems import install_problem_handlers


class Body(BaseModel):
    object_id: str = Field(max_length=8)
    count: int


def make_app() -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)

    @app.post("/things")
    async def things(body: Body) -> dict[str, str]:
        return {"ok": body.object_id}

    @app.get("/conflict")
    async def conflict() -> None:
        raise Problem(409, "conflict", "Conflict", "already there", run_id=7)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("internal detail card=4111")

    return app


async def call(method: str, path: str, **kwargs: object) -> httpx.Response:
    transport = httpx.ASGITransport(app=make_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.request(method, path, **kwargs)  # type: ignore[arg-type]


async def test_validation_error_names_fields_without_echoing_input() -> None:
    secret = "SECRET-VALUE-123"
    response = await call("POST", "/things", json={"object_id": secret, "count": "x" + secret})
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    doc = response.json()
    assert doc["type"] == "urn:sweeper:problem:validation-error"
    assert {tuple(e["loc"]) for e in doc["errors"]} == {("body", "object_id"), ("body", "count")}
    assert secret not in response.text


async def test_malformed_json_is_400() -> None:
    response = await call("POST", "/things", content=b'{"object_id": ',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["type"] == "urn:sweeper:problem:malformed-json"


async def test_problem_carries_extension_members() -> None:
    response = await call("GET", "/conflict")
    assert response.status_code == 409
    assert response.json() == {"type": "urn:sweeper:problem:conflict", "title": "Conflict",
                               "status": 409, "detail": "already there", "run_id": 7}


async def test_unknown_route_and_method_are_problems() -> None:
    missing = await call("GET", "/nope")
    assert missing.status_code == 404
    assert missing.json()["type"] == "urn:sweeper:problem:not-found"
    wrong = await call("DELETE", "/things")
    assert wrong.status_code == 405
    assert wrong.headers["content-type"] == "application/problem+json"


async def test_unexpected_error_is_generic_500() -> None:
    response = await call("GET", "/boom")
    assert response.status_code == 500
    assert response.json()["type"] == "urn:sweeper:problem:internal-error"
    assert "4111" not in response.text


@pytest.mark.parametrize(("value", "length"), [
    ("0", 0), (" 42 ", 42), ("9" * 5000, sys.maxsize), ("\u00b2", None), ("-1", None),
    ("1e3", None), ("", None), ("\u0661", None),
])
def test_content_length_reads_ascii_digits_only(value: str, length: int | None) -> None:
    assert content_length(value) == length
