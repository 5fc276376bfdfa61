"""Which source serves each upstream's per-tenant credentials, and the scopes waiting for one.

A call whose tenant has no credential is never sent: the item goes back unpunished and its
scope pauses with reason `no-credential` (service/scope_signals.py). A scope so paused
resumes when the credential arrives: at once for a PUT through the API (on the replica that
took it), and within `WAIT_CHECK_S` for a file that appears in a credentials directory or a
PUT on another replica (every worker process looks). Only that reason is lifted: an
operator's pause, or an `unauthorized` one, stays for an operator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service import audit
from service.credentials.crypto import Keyring
from service.credentials.directory import DirectorySource
from service.credentials.source import CredentialSource
from service.credentials.store import CredentialStore
from service.db.engine import is_unavailable
from service.db.statements import Statement, fetch, run
from service.policies import Policies
from service.scope_signals import NO_CREDENTIAL

log = logging.getLogger(__name__)

WAIT_CHECK_S: Final = 5.0
WAITING_PAGE: Final = 500
SYSTEM_ACTOR: Final = "sweeper:credentials"


class Credentials:
    """Each upstream's credential source (upstreams without per-tenant credentials have
    none). One CredentialStore serves every `api = true` upstream."""

    def __init__(self, sources: Mapping[str, CredentialSource]) -> None:
        self._sources = dict(sources)
        self._upstreams = frozenset(self._sources)  # asked on every call

    @classmethod
    def of(cls, policies: Policies, engine: AsyncEngine, keyring: Keyring | None,
           store: CredentialStore | None = None) -> Credentials:
        """The sources the policies file names. An `api = true` upstream needs the keyring
        (checked at start-up: `missing_key`)."""
        sources: dict[str, CredentialSource] = {}
        for name, upstream in policies.upstreams.items():
            cfg = upstream.config.credentials
            if cfg is None:
                continue
            if cfg.directory is not None:
                sources[name] = DirectorySource(cfg.directory)
            elif keyring is not None:
                store = store or CredentialStore(engine, keyring)
                sources[name] = store
        return cls(sources)

    @property
    def upstreams(self) -> frozenset[str]:
        return self._upstreams

    async def get(self, tenant_id: str, upstream: str) -> str | None:
        """The tenant's credential for `upstream`; None when it has none (or the upstream
        takes none)."""
        source = self._sources.get(upstream)
        return None if source is None else await source.get(tenant_id, upstream)


def missing_key(policies: Policies, keyring: Keyring | None) -> list[str]:
    """Start-up problems: upstreams storing credentials through the API without a key."""
    if keyring is not None:
        return []
    return [f"policies file {policies.source}: upstreams.{name}.credentials: api = true needs "
            "SWEEPER_CREDENTIALS_KEY (32 random bytes, base64) to store them encrypted"
            for name, up in policies.upstreams.items()
            if up.config.credentials is not None and up.config.credentials.api]


# Scopes paused for want of a credential, a page at a time after :after, each with one of
# its waiting items' tenant and policy (NULL when none waits any more): per-tenant
# credentials require a scope per tenant (policies.py), so one item names the scope's
# tenant. The items_ready index (scope first, pending, released, unheld) serves the lateral
# read.
_WAITING = Statement("waits.waiting", (
    "Scopes paused for want of a credential, a page after a name, each with one waiting "
    "item's tenant and policy."), f"""
    SELECT s.name, i.tenant_id, i.policy
    FROM scopes s LEFT JOIN LATERAL (
        SELECT tenant_id, policy FROM items
        WHERE scope = s.name AND status = 'pending' AND released_at IS NOT NULL
          AND hold_id IS NULL
        LIMIT 1
    ) i ON true
    WHERE s.paused AND s.paused_reason = '{NO_CREDENTIAL}' AND s.name > :after
      AND (CAST(:tenant AS text) IS NULL OR i.tenant_id = CAST(:tenant AS text))
    ORDER BY s.name
    LIMIT :limit
""")  # noqa: S608 - a constant

_RESUME = Statement("waits.resume", (
    "Resume scopes paused for want of a credential (no other pause)."), f"""
    UPDATE scopes SET paused = false, paused_reason = NULL, updated_at = now()
    WHERE name = ANY(CAST(:names AS text[])) AND paused AND paused_reason = '{NO_CREDENTIAL}'
    RETURNING name
""")  # noqa: S608 - a constant


async def resume_arrived(engine: AsyncEngine, policies: Policies, credentials: Credentials,
                         *, tenant_id: str | None = None) -> list[str]:
    """Resume the scopes paused `no-credential` that wait for nothing any more (only
    `tenant_id`'s, when given): their tenant's credential arrived, or no item waits, or the
    policies file no longer asks for one (the policy or its credentials were removed).
    Returns them; each resume leaves an audit row."""
    arrived: list[str] = []
    after = ""
    while True:
        rows = await fetch(engine, _WAITING, {"after": after, "tenant": tenant_id,
                                              "limit": WAITING_PAGE})
        for row in rows:
            if await _waits_for_nothing(row.tenant_id, row.policy, policies, credentials):
                arrived.append(row.name)
        if len(rows) < WAITING_PAGE:
            break
        after = rows[-1].name
    if not arrived:
        return []
    async with engine.begin() as conn:
        resumed = [r.name for r in await run(conn, _RESUME, {"names": arrived})]
        for scope in resumed:
            await audit.record(conn, actor=SYSTEM_ACTOR, action="scope.resume",
                               reason="its tenant's credential arrived",
                               details={"scope": scope, "paused_reason": NO_CREDENTIAL})
    for scope in resumed:
        log.info("scope resumed: its tenant's credential arrived", extra={"scope": scope})
    return resumed


async def _waits_for_nothing(tenant_id: str | None, policy_name: str | None,
                             policies: Policies, credentials: Credentials) -> bool:
    policy = policies.policy(policy_name) if policy_name is not None else None
    if tenant_id is None or policy is None:
        return True  # nothing waits, or nothing that can still be called
    upstream = policy.config.upstream
    if upstream not in credentials.upstreams:
        return True  # the upstream takes no per-tenant credential (any more)
    return await credentials.get(tenant_id, upstream) is not None


async def waiting_loop(engine: AsyncEngine, policies: Policies, credentials: Credentials,
                       interval_s: float = WAIT_CHECK_S) -> None:
    """Resume waiting scopes as their credentials arrive, until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await resume_arrived(engine, policies, credentials)
        except Exception as exc:
            if not is_unavailable(exc):
                log.exception("credential wait check failed")
