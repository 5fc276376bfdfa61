"""RFC 9457 problem+json answers for every error, with a stable `type` per kind.

FastAPI's default 422 echoes the offending input back; ours names the location and the
rule that failed, never the value (it may be a secret or customer data).
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException
from starlette.types import Scope

from service.db.engine import is_busy, is_unavailable
from service.errors import DatabaseUnavailable, Problem
from service.http.api.methods import allow_header

log = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"
# The scope key of the id the request log gives each request (also its X-Request-Id answer).
REQUEST_ID = "sweeper.request_id"


def route_template(scope: Scope) -> str:
    """The matched route's template without its convertors (`{tenant_id}`, not
    `{tenant_id:path}`), as the OpenAPI document names it; `unmatched` when none matched.
    What logs and metrics name a request by: never its path, which can carry tenant ids."""
    matched = scope.get("route")
    return str(getattr(matched, "path_format", None) or getattr(matched, "path", "unmatched"))
DATABASE_RETRY_AFTER_SECONDS = 5

_HTTP_SLUGS = {
    400: "bad-request",
    401: "unauthorized",
    403: "forbidden",
    404: "not-found",
    405: "method-not-allowed",
    406: "not-acceptable",
    413: "payload-too-large",
    415: "unsupported-media-type",
}


class ValidationIssue(BaseModel):
    """One failing location of a request and the rule it broke (never the value sent)."""

    loc: list[str] = Field(examples=[["body", "items", "0", "due_at"]])
    message: str = Field(examples=["Input should have timezone info"])
    type: str = Field(examples=["timezone_aware"])


class ProblemDetails(BaseModel):
    """The error document every non-2xx answer carries (RFC 9457). Extension members may
    follow (e.g. `run_id` on an idempotency conflict)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(examples=["urn:sweeper:problem:validation-error"])
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[ValidationIssue] | None = Field(
        default=None, description="for validation errors: where and which rule, never the value")


_SCHEMA_REF = "#/components/schemas/{model}"
RETRY_AFTER_HEADER = {"Retry-After": {"description": "seconds to wait before retrying",
                                "schema": {"type": "integer", "minimum": 0}}}
# Every error answer a route may declare: a description and the headers it carries.
_DECLARED: dict[int, tuple[str, dict[str, Any]]] = {
    400: ("the body is not valid JSON (`malformed-json`)", {}),
    401: ("no valid bearer token (`unauthorized`)",
          {"WWW-Authenticate": {"description": 'always `Bearer realm="sweeper"`',
                                "schema": {"type": "string"}}}),
    404: ("no such resource (`*-not-found`)", {}),
    409: ("the Idempotency-Key started a run with a different request "
          "(`idempotency-key-reused`; `run_id` names that run)", {}),
    422: ("the request is not valid: each failing location and rule is named, never the "
          "value (`validation-error`, `unknown-policy`, `empty-selection`)", {}),
    503: ("the ledger database is unreachable (`database-unavailable`) or gave up on the "
          "request under contention or a timeout (`database-busy`), or the "
          "schema is not at this build's head (`schema-not-at-head`)", RETRY_AFTER_HEADER),
}


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` declaring the problem+json answers a route can give; routers
    pass this instead of repeating the declarations."""
    return {status: problem_doc(*_DECLARED[status]) for status in statuses}


def problem_doc(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """One declared problem+json answer, for routes whose errors read differently from the
    operator API's (the webhook intake)."""
    schema = {"$ref": _SCHEMA_REF.format(model=ProblemDetails.__name__)}
    doc: dict[str, Any] = {"description": description,
                           "content": {PROBLEM_MEDIA_TYPE: {"schema": schema}}}
    if headers:
        doc["headers"] = headers
    return doc


def _document_problems(app: FastAPI) -> None:
    """Add the ProblemDetails schema that `problem_responses` refers to to the app's
    OpenAPI document (FastAPI lists only models used as a response_model or body)."""
    generate = app.openapi  # FastAPI's: cached until the routes change
    problem = ProblemDetails.model_json_schema(ref_template=_SCHEMA_REF)
    added = {**problem.pop("$defs", {}), ProblemDetails.__name__: problem}

    def openapi() -> dict[str, Any]:
        document = generate()
        document.setdefault("components", {}).setdefault("schemas", {}).update(added)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def problem_response(problem: Problem, request: Request | None = None) -> JSONResponse:
    """Render a Problem with its headers. `instance` names the request (as in the logs and
    its X-Request-Id), never its path: a path may hold a tenant id."""
    request_id = request.scope.get(REQUEST_ID) if request is not None else None
    instance = f"urn:sweeper:request:{request_id}" if request_id else None
    return JSONResponse(problem.body(instance), status_code=problem.status,
                        headers=problem.headers, media_type=PROBLEM_MEDIA_TYPE)


def validation_problem(errors: list[dict[str, Any]], status: int = 422) -> Problem:
    """A 422 naming each failing location and rule without echoing input values."""
    return Problem(status, "validation-error", "Request is not valid",
                   f"{len(errors)} problem(s) in the request", errors=errors)


def _clean_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    cleaned = []
    for err in exc.errors():
        cleaned.append({"loc": [str(p) for p in err.get("loc", ())],
                        "message": str(err.get("msg", "")),
                        "type": str(err.get("type", ""))})
    return cleaned


async def _on_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Problem)
    return problem_response(exc, request)


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    invalid = [e for e in exc.errors() if e.get("type") == "json_invalid"]
    if invalid:
        why = str((invalid[0].get("ctx") or {}).get("error", "")) or "not parseable"
        problem = Problem(400, "malformed-json", "Request body is not valid JSON",
                          f"the body could not be parsed as JSON: {why}")
        return problem_response(problem, request)
    errors = _clean_errors(exc)
    return problem_response(validation_problem(errors), request)


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    slug = _HTTP_SLUGS.get(exc.status_code, f"http-{exc.status_code}")
    title = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, slug)
    detail = exc.detail if isinstance(exc.detail, str) else None
    headers = dict(exc.headers or {})
    route_methods = getattr(request.app.state, "route_methods", None)
    if exc.status_code == 405 and route_methods is not None:
        # the router names the first route matching the path; RFC 9110 wants every method
        headers["Allow"] = allow_header(route_methods.allowed(request.scope))
    problem = Problem(exc.status_code, slug, title, detail, headers=headers)
    return problem_response(problem, request)


def database_unavailable() -> Problem:
    """The 503 answer while PostgreSQL is unreachable or the pool is exhausted."""
    return Problem(503, "database-unavailable", "Database unavailable",
                   "the ledger database cannot be reached right now; retry later",
                   headers={"Retry-After": str(DATABASE_RETRY_AFTER_SECONDS)})


def database_busy() -> Problem:
    """The 503 answer when the database reached gave up on the statement (a statement or
    lock timeout, a deadlock, exhausted resources): nothing was written."""
    return Problem(503, "database-busy", "Database busy",
                   "the ledger database is reachable but gave up on this request (a timeout "
                   "or contention); nothing was changed; retry later",
                   headers={"Retry-After": str(DATABASE_RETRY_AFTER_SECONDS)})


def _unstorable_text(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) says the request carried text PostgreSQL cannot
    store: a NUL character, or an unpaired surrogate (valid JSON escapes both)."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if isinstance(seen, UnicodeEncodeError | asyncpg.CharacterNotInRepertoireError |
                      asyncpg.UntranslatableCharacterError):
            return True
        seen = getattr(seen, "orig", None) or seen.__cause__ or seen.__context__
    return False


def unstorable_text() -> Problem:
    """The 422 for text the database cannot hold; nothing was written."""
    return Problem(422, "unstorable-text", "Request is not valid",
                   "a text value contains a NUL character or an unpaired surrogate, which "
                   "the ledger cannot store; nothing was changed")


async def on_database(request: Request, exc: Exception) -> JSONResponse:
    if _unstorable_text(exc):
        return problem_response(unstorable_text(), request)
    if isinstance(exc, DatabaseUnavailable | PoolTimeoutError) or is_unavailable(exc):
        log.warning("database unavailable", extra={"http.route": route_template(request.scope),
                                                   "error": type(exc).__name__})
        return problem_response(database_unavailable(), request)
    if is_busy(exc):
        # e.g. the statement timeout cut a wait on a lock held by an idle transaction:
        # nothing was written (the transaction rolled back), so the client may retry
        log.warning("database busy", extra={"http.route": route_template(request.scope),
                                            "error": type(exc).__name__})
        return problem_response(database_busy(), request)
    if isinstance(exc, DBAPIError):
        # PostgreSQL's message may quote a value from the request ("invalid input syntax
        # for type integer: ..."): the log names the statement and SQLSTATE, not the message
        log.error("database error", extra={
            "http.route": route_template(request.scope), "error": type(exc.orig).__name__,
            "sqlstate": getattr(exc.orig, "sqlstate", None), "statement": exc.statement})
        return problem_response(internal_error(), request)
    return await _on_unexpected(request, exc)


async def _on_unstorable(request: Request, exc: Exception) -> JSONResponse:
    if _unstorable_text(exc):
        return problem_response(unstorable_text(), request)
    return await _on_unexpected(request, exc)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    if _unstorable_text(exc):
        return problem_response(unstorable_text(), request)
    log.error("unhandled error", extra={"http.route": route_template(request.scope)},
              exc_info=(type(exc), exc, exc.__traceback__))
    return problem_response(internal_error(), request)


def internal_error() -> Problem:
    """The 500 for a failure that is Sweeper's, not the caller's."""
    return Problem(500, "internal-error", "Internal error",
                   "the request failed unexpectedly; it has been logged")


def install_problem_handlers(app: FastAPI) -> None:
    """Make every error answer problem+json, and document its schema."""
    _document_problems(app)
    app.add_exception_handler(Problem, _on_problem)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(HTTPException, _on_http)
    app.add_exception_handler(DBAPIError, on_database)
    app.add_exception_handler(PoolTimeoutError, on_database)
    app.add_exception_handler(DatabaseUnavailable, on_database)
    app.add_exception_handler(OSError, on_database)
    # Text the database cannot store is the caller's error. Handled here, not by the
    # catch-all: Starlette re-raises whatever the catch-all answers, which logs a 500 and
    # drops the connection.
    for unstorable in (UnicodeEncodeError, asyncpg.CharacterNotInRepertoireError,
                       asyncpg.UntranslatableCharacterError):
        app.add_exception_handler(unstorable, _on_unstorable)
    app.add_exception_handler(Exception, _on_unexpected)
