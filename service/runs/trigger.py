"""A run's start: a cron trigger (or an operator) records a run with its cutoff, once per
trigger key (`create_run`); publication (service/runs/publication.py) takes it from there."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import Statement, fetch
from service.db.statements import run as run_statement
from service.errors import SweeperError
from service.evidence import audit_trail
from service.observability import metrics, tracing

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class TriggerKeyReused(SweeperError):
    """A trigger key that already started a run with a different request."""

    def __init__(self, run_id: int) -> None:
        super().__init__(f"the trigger key started run {run_id} with a different request")
        self.run_id = run_id


@dataclass(frozen=True)
class RunRequest:
    """What a trigger asks for."""

    policy: str | None
    tenant_id: str | None
    cutoff: datetime | None
    dry_run: bool
    max_items: int | None

    def described(self) -> dict[str, object]:
        """The request as plain JSON values (its digest's input, the audit row's details)."""
        return {"policy": self.policy, "tenant_id": self.tenant_id, "dry_run": self.dry_run,
                "cutoff": self.cutoff.isoformat() if self.cutoff else None,
                "max_items": self.max_items}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.described(), sort_keys=True).encode()
                              ).hexdigest()


_INSERT_RUN = Statement("trigger.insert", (
    "Record a triggered run, or nothing when its trigger key already started one."), """
    INSERT INTO runs (trigger_key, request_digest, policy, tenant_id, cutoff, dry_run, max_items,
                      trace_parent)
    VALUES (:key, :digest, :policy, :tenant, coalesce(CAST(:cutoff AS timestamptz), now()),
            :dry_run, :max_items, :trace)
    ON CONFLICT (trigger_key) DO NOTHING
    RETURNING id
""")


_BY_TRIGGER_KEY = Statement("trigger.by_trigger_key", (
    "The run a trigger key started and its request's digest, to tell a retry from a reuse."),
    "SELECT id, request_digest FROM runs WHERE trigger_key = :key")


async def create_run(engine: AsyncEngine, request: RunRequest, trigger_key: str | None, *,
                     actor: str | None = None, reason: str | None = None,
                     details: dict[str, object] | None = None) -> tuple[int, bool]:
    """Record a run; returns (run id, created). The same trigger key returns the same run;
    the same key with a different request raises TriggerKeyReused. Replicas find a new run
    on their publisher's next poll; this one's is woken by the caller. The run keeps the
    caller's trace context (tracing on): its publication continues that trace. A run an
    operator or a token started (`actor`) is in the audit trail, with `reason` and
    `details`, in the transaction that records it (a repeated trigger key adds nothing)."""
    digest = request.digest()
    params = {"key": trigger_key, "digest": digest, "policy": request.policy,
              "tenant": request.tenant_id, "cutoff": request.cutoff,
              "dry_run": request.dry_run, "max_items": request.max_items,
              "trace": tracing.traceparent()}
    async with engine.begin() as conn:
        run_id = (await run_statement(conn, _INSERT_RUN, params)).scalar()
        if run_id is not None and actor is not None:
            await audit_trail.record(conn, actor=actor, action="run.trigger", reason=reason,
                                     details={**request.described(), "run_id": int(run_id),
                                              "trigger_key": trigger_key, **(details or {})})
    if run_id is not None:
        metrics.RUNS_CREATED.labels(str(request.dry_run).lower()).inc()
        return int(run_id), True
    [row] = await fetch(engine, _BY_TRIGGER_KEY, {"key": trigger_key})
    if row.request_digest != digest:
        raise TriggerKeyReused(int(row.id))
    return int(row.id), False
