"""The pool's ports in broker mode (SWEEPER_EXECUTION=rabbitmq): admission, completion and
wake-ups over a broker's deliveries (service/execution/deliveries.py), every other port as
in database mode (postgres.py). The pool itself does not know which mode it runs in."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget.credential_waits import Credentials
from service.config.execution import Execution
from service.config.policies import Policies
from service.config.settings import Settings
from service.execution.deliveries import DeliveredWork
from service.execution.ports import Broker
from service.execution.rabbitmq import RabbitBroker
from service.sweeps.store_databases import Stores
from service.upstreams.deletion_api import Upstreams
from service.worker.ports import Ports
from service.worker.postgres import Listener, PostgresLedger, database_ports


def broker_ports(engine: AsyncEngine, policies: Policies, upstreams: Upstreams,
                 broker: Broker, *, owner: str, prefetch: int, listen_url: str | None = None,
                 rng: random.Random | None = None, credentials: Credentials | None = None,
                 stores: Stores | None = None) -> Ports:
    """The ports of a pool taking its items from `broker`'s deliveries (its region's)."""
    ports = database_ports(engine, policies, upstreams, owner=owner, listen_url=None, rng=rng,
                           credentials=credentials, stores=stores, region=broker.region)
    ledger = ports.completion
    assert isinstance(ledger, PostgresLedger)
    delivered = DeliveredWork(broker, ledger, prefetch=prefetch, monotonic=ports.clock.monotonic,
                              holds=Listener(listen_url) if listen_url else None)
    @contextlib.asynccontextmanager
    async def hold() -> AsyncIterator[None]:
        """The ledger's connections while the pool runs; at its end (its last outcomes
        written), the messages still in hand go back to the broker whole."""
        try:
            async with ledger.hold():
                yield
        finally:
            await delivered.hand_over()

    return dataclasses.replace(ports, admission=delivered, completion=delivered,
                               wakeups=delivered, hold=hold)


def open_broker(settings: Settings) -> Broker | None:
    """The broker of SWEEPER_EXECUTION (None: database mode); it connects on first use."""
    if settings.execution is not Execution.RABBITMQ or settings.broker_url is None:
        return None
    return RabbitBroker(settings.broker_url.get_secret_value(), region=settings.region)
