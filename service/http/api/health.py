"""Liveness and readiness for the orchestrator."""

from __future__ import annotations

import asyncio
from typing import Final

from fastapi import APIRouter
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.engine import is_unavailable
from service.db.migrate import is_known
from service.db.statements import Statement, fetch
from service.errors import DatabaseUnavailable, Problem
from service.http.api.deps import RuntimeDep
from service.http.api.problems import problem_responses

READY_CHECK_TIMEOUT_SECONDS: Final = 2.0

router = APIRouter(tags=["health"])

_SCHEMA_REVISION = Statement("health.schema_revision", (
    "The schema revision Alembic recorded, for readiness (fails before the first "
    "migration)."), "SELECT version_num FROM alembic_version")


class Health(BaseModel):
    """A healthy answer."""

    status: str
    schema_revision: str | None = Field(default=None, description=(
        "the database schema's revision: on /healthz, the one last read (at start and by "
        "each /readyz; null before a first read succeeded)"))


UNSIGNED_WARNING: Final = ("evidence exports are unsigned: no signing key is configured "
                           "(set SWEEPER_EVIDENCE_SIGNING_KEY_FILE)")


class Readiness(Health):
    """A ready answer, and what an operator should know about how the process runs."""

    evidence_signed: bool = Field(description=(
        "whether evidence exports are signed; false: no signing key is configured"))
    warnings: list[str] = Field(description="conditions that do not stop readiness")


@router.get("/healthz", operation_id="healthz", response_model=Health)
async def healthz(runtime: RuntimeDep) -> Health:
    """Liveness: the process answers. Never touches the database: the schema revision is
    the one last read."""
    return Health(status="ok", schema_revision=runtime.schema.revision)


async def schema_revision(engine: AsyncEngine) -> str | None:
    """The revision Alembic recorded (None: not migrated, or no single row);
    DatabaseUnavailable when the database does not answer in time."""
    try:
        async with asyncio.timeout(READY_CHECK_TIMEOUT_SECONDS):
            rows = await fetch(engine, _SCHEMA_REVISION, {})
    except Exception as exc:
        if isinstance(exc, TimeoutError) or is_unavailable(exc):
            raise DatabaseUnavailable("the database does not answer") from None
        return None  # e.g. alembic_version does not exist yet: not migrated
    # one row at most (more, like none, is no revision this build can be ready at)
    return rows[0].version_num if len(rows) == 1 else None


@router.get("/readyz", operation_id="readyz", response_model=Readiness,
            responses=problem_responses(503))
async def readyz(runtime: RuntimeDep) -> Readiness:
    """Readiness: the database answers and its schema is at this build's head revision, or
    at a revision this build does not know: a newer one, applied by the next release's
    pre-upgrade migration (migrations only expand), so old pods stay ready while it rolls.
    A ready process still says when its evidence exports are unsigned."""
    try:
        revision = runtime.schema.revision = await schema_revision(runtime.engine)
    except DatabaseUnavailable as exc:
        raise Problem(503, "database-unavailable", "Not ready", str(exc),
                      headers={"Retry-After": "5"}) from None
    if revision != runtime.schema_head and (revision is None or is_known(revision)):
        raise Problem(503, "schema-not-at-head", "Not ready",
                      f"database schema is at {revision or 'nothing'}, this build needs "
                      f"{runtime.schema_head}", headers={"Retry-After": "5"})
    signed = runtime.signer is not None
    return Readiness(status="ready", schema_revision=revision, evidence_signed=signed,
                     warnings=[] if signed else [UNSIGNED_WARNING])
