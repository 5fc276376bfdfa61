"""Scopes paused for a reason that ends by itself, resumed when it has.

Two pauses wait for something outside Sweeper rather than for an operator:

    no-credential       its tenant's credential arrives (service/budget/credential_waits.py)
    store-unreachable   the store its policy deletes on accepts a connection again

Every worker process (and `serve` with workers) looks every `WAIT_CHECK_S`, so a store's
failover or a network partition costs its scopes the outage and a few seconds, not an
operator's resume. A resume is audited as the system's, and lifts only the reason it waited
on: an operator's pause, `unauthorized` and `store-permission-denied` (a role's grants do not
come back by themselves) stay for an operator.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import scope_controls
from service.budget.answer_effects import PAUSE_REASONS
from service.budget.credential_waits import Credentials, resume_arrived
from service.config.policies import Policies
from service.observability.failures import InternalErrors, expected
from service.observability.metrics import Where
from service.outcomes import Failure
from service.sweeps.store_databases import StoreError, Stores

log = logging.getLogger(__name__)

WAIT_CHECK_S: Final = 5.0
STORE_UNREACHABLE: Final = PAUSE_REASONS[Failure.STORE_UNREACHABLE]
SYSTEM_ACTOR: Final = "sweeper:stores"


async def resume_reachable(engine: AsyncEngine, policies: Policies, stores: Stores) -> list[str]:
    """Resume the scopes paused `store-unreachable` whose store accepts a connection again
    (each store is tried once), or that wait for no store any more: no item waits, or the
    policy is gone or no longer deletes on a store. Returns them."""
    answered: dict[str, bool] = {}
    ready: list[str] = []
    for scope in await scope_controls.waiting(engine, STORE_UNREACHABLE):
        policy = policies.policy(scope.policy) if scope.policy is not None else None
        target = policy.config.target if policy is not None else None
        if target is None:
            ready.append(scope.name)
            continue
        if target.store not in answered:
            answered[target.store] = await _answers(stores, target.store)
        if answered[target.store]:
            ready.append(scope.name)
    resumed = await scope_controls.resume_waiting(engine, ready, STORE_UNREACHABLE,
                                                  actor=SYSTEM_ACTOR,
                                                  why="its store answers again")
    for scope_name in resumed:
        log.info("scope resumed: its store answers again", extra={"scope": scope_name})
    return resumed


async def _answers(stores: Stores, store: str) -> bool:
    """Whether the store accepts a connection (the pool pings one it already holds)."""
    if store not in stores.stores:
        return True  # the policies file no longer names it: nothing to wait for
    try:
        conn = await stores.connect(store)
    except StoreError:
        return False
    await conn.close()
    return True


async def waiting_loop(engine: AsyncEngine, policies: Policies, credentials: Credentials,
                       stores: Stores, interval_s: float = WAIT_CHECK_S) -> None:
    """Resume waiting scopes as what they wait for arrives, until cancelled."""
    errors = InternalErrors(log)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await resume_arrived(engine, policies, credentials)
        except Exception as exc:
            if not expected(exc):
                errors.caught(Where.WAITS, exc, check="credentials")
        try:
            await resume_reachable(engine, policies, stores)
        except Exception as exc:
            if not expected(exc):
                errors.caught(Where.WAITS, exc, check="stores")
