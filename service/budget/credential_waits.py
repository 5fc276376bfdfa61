"""Which source serves each upstream's per-tenant credentials, and the scopes waiting for one.

A call whose tenant has no credential is never sent: the item goes back unpunished and its
scope pauses with reason `no-credential` (service/budget/answer_effects.py). A scope so paused
resumes when the credential arrives: at once for a PUT through the API (on the replica that
took it), and within `service.worker.scope_resumption.WAIT_CHECK_S` for a file that appears in a
credentials directory or a PUT on another replica (every worker process looks). Only that reason is
lifted: an operator's pause, or an `unauthorized` one, stays for an operator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import scope_controls
from service.budget.answer_effects import NO_CREDENTIAL
from service.config.policies import Policies
from service.credentials.crypto import Keyring
from service.credentials.directory import DirectorySource
from service.credentials.source import CredentialSource
from service.credentials.store import CredentialStore

log = logging.getLogger(__name__)

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


async def resume_arrived(engine: AsyncEngine, policies: Policies, credentials: Credentials,
                         *, tenant_id: str | None = None) -> list[str]:
    """Resume the scopes paused `no-credential` that wait for nothing any more (only
    `tenant_id`'s, when given): their tenant's credential arrived, or no item waits, or the
    policies file no longer asks for one (the policy or its credentials were removed).
    Returns them; each resume leaves an audit row. Per-tenant credentials require a scope
    per tenant (policies.py), so one waiting item names the scope's tenant."""
    arrived = [w.name for w in await scope_controls.waiting(engine, NO_CREDENTIAL,
                                                            tenant_id=tenant_id)
               if await _waits_for_nothing(w.tenant_id, w.policy, policies, credentials)]
    resumed = await scope_controls.resume_waiting(engine, arrived, NO_CREDENTIAL,
                                                  actor=SYSTEM_ACTOR,
                                                  why="its tenant's credential arrived")
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
