"""What a running process holds: settings, policies, the engine. Built by the lifespan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget.credential_waits import Credentials
from service.config.policies import Policies
from service.config.settings import Settings
from service.config.signing_keys import Signer
from service.config.tokens import TokenSet
from service.credentials import CredentialStore, Keyring
from service.execution.ports import Broker
from service.ledger.gauges import Exporter
from service.runs.progress import ProgressCache
from service.sweeps.store_databases import Stores


@dataclass
class SchemaSeen:
    """The schema revision last read from the database (at start, then by each /readyz):
    what /healthz reports, never touching the database itself."""

    revision: str | None = None


@dataclass(frozen=True)
class Runtime:
    """Process state shared by requests and workers."""

    settings: Settings
    policies: Policies
    engine: AsyncEngine
    tokens: TokenSet
    schema_head: str
    exporter: Exporter
    publisher_wake: asyncio.Event = field(default_factory=asyncio.Event)
    run_progress: ProgressCache = field(default_factory=ProgressCache)
    # SWEEPER_CREDENTIALS_KEY's keyring and this replica's cached read side over it; both
    # None when no key is configured (the API refuses to store credentials)
    keyring: Keyring | None = None
    credentials: CredentialStore | None = None
    # every upstream's per-tenant credential source, the store above among them
    tenant_credentials: Credentials = field(default_factory=lambda: Credentials({}))
    # signs each run's evidence export; None: exports are unsigned (no key configured)
    signer: Signer | None = None
    # the stores' databases: discovery reads their sources, the workers run their targets
    stores: Stores = field(default_factory=lambda: Stores({}))
    schema: SchemaSeen = field(default_factory=SchemaSeen)
    # SWEEPER_EXECUTION=rabbitmq: the broker the relay publishes to and workers consume
    broker: Broker | None = None

    def credential_upstreams(self) -> frozenset[str]:
        """The upstreams whose credentials operators may store through the API: those the
        policies file gives `credentials = { api = true }`."""
        return frozenset(name for name, up in self.policies.upstreams.items()
                         if up.config.credentials is not None and up.config.credentials.api)

    def wake_publisher(self) -> None:
        """Ask this process's publisher to look for runs now rather than at its next poll."""
        self.publisher_wake.set()
