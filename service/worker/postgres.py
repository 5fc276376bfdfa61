"""The worker's ledger ports on PostgreSQL, and the LISTEN wake-ups.

While a pool runs, admissions use one held connection and completions another (a pooled
checkout per statement cost more than the statement: bench/reports/design-notes.md, "The
worker pool"); outside a running loop (tests driving single rounds) each statement checks
out a pooled connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Final

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import buckets
from service.budget.credential_waits import Credentials
from service.budget.rules import Closure
from service.config.policies import Policies
from service.db import wakeups
from service.db.statements import Database, HeldConnection
from service.execution import outbox, sorting
from service.execution.sorting import Sorted
from service.history import minutes
from service.history.tally import Tally
from service.ledger import claims, completions, hold_acks, region_pins
from service.ledger.claims import Admission, Lease
from service.ledger.completions import Completion
from service.observability.failures import InternalErrors, expected
from service.observability.metrics import Where
from service.sweeps.store_databases import Stores
from service.sweeps.store_targets import StoreTargets
from service.upstreams.deletion_api import Upstreams
from service.worker.hold_gate import HoldCover
from service.worker.local_ports import NoWakeups, SystemClock
from service.worker.ports import Ports
from service.worker.upstream_calls import UpstreamCalls

LISTEN_PROBE_INTERVAL_S: Final = 10.0
LISTEN_RETRY_S: Final = 1.0  # between attempts to connect the LISTEN connection again

log = logging.getLogger("service.worker")


class PostgresLedger:
    """Admission, completion and scope signals for one pool (`owner`) on `engine`."""

    def __init__(self, engine: AsyncEngine, policies: Policies, *, owner: str,
                 rng: random.Random | None = None, region: str | None = None) -> None:
        self.engine = engine
        self.owner = owner
        self.region = region  # it claims only this region's items (None: the unpinned)
        self._regions = policies.regions
        self._rng = rng or random.Random()
        self._lease_seconds = {n: p.config.lease_seconds for n, p in policies.policies.items()}
        self._max_attempts = {n: p.config.max_attempts for n, p in policies.policies.items()}
        self._admitting: HeldConnection | None = None
        self._completing: HeldConnection | None = None

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold one connection for admissions and one for completions until the block ends."""
        self._admitting = HeldConnection(self.engine)
        self._completing = HeldConnection(self.engine)
        try:
            yield
        finally:
            for held in (self._admitting, self._completing):
                await held.close()
            self._admitting = self._completing = None

    @contextlib.asynccontextmanager
    async def _on(self, held: HeldConnection | None) -> AsyncIterator[Database]:
        if held is None:
            yield self.engine
        else:
            async with held.use() as conn:
                yield conn

    # -- admission -------------------------------------------------------------------

    async def eligible_scopes(self, cursor: str, limit: int) -> list[tuple[str, int]]:
        async with self._on(self._admitting) as db:
            return await buckets.eligible_scopes(db, cursor=cursor, limit=limit,
                                                 region=self.region)

    async def admit(self, wants: Mapping[str, int]) -> Admission:
        async with self._on(self._admitting) as db:
            return await self._in_region(db, await claims.admit(
                db, owner=self.owner, wants=wants, lease_seconds=self._lease_seconds,
                max_attempts=self._max_attempts, region=self.region))

    async def _in_region(self, db: Database, admitted: Admission) -> Admission:
        """The admission less the leases whose tenant this process's file pins to another
        region than its own (an item written under another file): handed back, their
        region corrected (service/ledger/region_pins.py). Never called here."""
        if not admitted.leases or (self.region is None and not self._regions.pins):
            return admitted
        misplaced = [(lease, region) for lease in admitted.leases
                     if (region := self._regions.of_tenant(lease.tenant_id)) != self.region]
        if not misplaced:
            return admitted
        await region_pins.correct(db, misplaced)
        await claims.hand_back(db, [lease for lease, _ in misplaced])
        gone = {lease.item_id for lease, _ in misplaced}
        return dataclasses.replace(admitted, leases=[
            lease for lease in admitted.leases if lease.item_id not in gone])

    async def database_time(self) -> float:
        return await buckets.database_time(self.engine)

    # -- admission in broker mode (service/execution/deliveries.py) --------------------

    async def admit_delivered(self, wants: Mapping[str, int],
                              only: Sequence[tuple[int, str]]) -> Admission:
        async with self._on(self._admitting) as db:
            return await self._in_region(db, await claims.admit(
                db, owner=self.owner, wants=wants, lease_seconds=self._lease_seconds,
                max_attempts=self._max_attempts, only=only, region=self.region))

    async def sort_delivered(self, item_ids: Sequence[int]) -> dict[int, Sorted]:
        async with self._on(self._admitting) as db:
            return await sorting.sort(db, item_ids, self.region)

    async def reroute(self, item_ids: Sequence[int]) -> None:
        async with self._on(self._admitting) as db:
            await outbox.reroute(db, item_ids)

    async def end_dead(self, item_ids: Sequence[int], reason: str) -> list[int]:
        async with self._on(self._completing) as db:
            return await outbox.end_dead(db, item_ids, reason)

    # -- completion ------------------------------------------------------------------

    async def complete(self, batch: Sequence[Completion]) -> list[int]:
        async with self._on(self._completing) as db:
            return await completions.complete(db, batch, region=self.region)

    async def hand_back(self, leases: Sequence[Lease], tokens: Sequence[int] | None = None
                        ) -> None:
        async with self._on(self._completing) as db:
            await claims.hand_back(db, leases, tokens)

    # -- legal holds (hold_gate.py) --------------------------------------------------

    async def latest_hold(self) -> int:
        return await hold_acks.latest(self.engine)

    async def holds_since(self, after: int) -> list[HoldCover]:
        return [HoldCover(h["id"], h["tenant_id"], h["policy"],
                          None if h["object_ids"] is None else frozenset(h["object_ids"]),
                          h["object_id_prefix"])
                for h in await hold_acks.since(self.engine, after)]

    async def acknowledge(self, revoked: Mapping[int, Sequence[int]]) -> None:
        await hold_acks.acknowledge(self.engine, self.owner, revoked)

    # -- scope signals ---------------------------------------------------------------

    async def add_minutes(self, tally: Tally) -> None:
        await minutes.add(self.engine, tally)

    async def close(self, closures: Mapping[str, Closure]) -> None:
        await buckets.close(self.engine, closures, self._rng)

    async def pause(self, scopes: Sequence[str], reason: str) -> list[str]:
        return await buckets.pause(self.engine, list(scopes), reason)

    async def recovered(self, scopes: Sequence[str]) -> None:
        await buckets.recovered(self.engine, list(scopes))

    async def adjust(self, refunds: Mapping[str, float], caps: Mapping[str, float]) -> None:
        await buckets.adjust(self.engine, refunds, caps)


class Listener:
    """LISTEN for releases on a connection of its own; reconnects after outages (polling
    covers any gap). Anything but an outage (bad credentials, a bug) is an internal error,
    logged once per kind and counted; an outage is a warning when it begins."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._errors = InternalErrors(log)

    async def listen(self, wake: Callable[[], None],
                     held: Callable[[], None] | None = None) -> None:
        outage = ""  # the class of the outage logged last ("": none)
        while True:
            try:
                await self._listen_once(wake, held)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                outage = self._lost(exc, outage)
                await asyncio.sleep(LISTEN_RETRY_S)
                continue
            outage = ""

    async def _listen_once(self, wake: Callable[[], None],
                           held: Callable[[], None] | None) -> None:
        """Listen on one connection until it is lost (raises) or closed (returns)."""
        conn = await asyncpg.connect(self.url, timeout=5)
        closed = asyncio.Event()
        conn.add_termination_listener(lambda _c, ev=closed: ev.set())
        try:
            await conn.add_listener(wakeups.RELEASED_CHANNEL, lambda *_args: wake())
            await conn.add_listener(wakeups.HOLDS_CHANNEL,
                                    lambda *_args: held() if held is not None else None)
            if held is not None:
                held()  # a hold placed while this was not listening is learned now
            while not closed.is_set():
                # a silent network loss is only seen on use: probe now and then
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LISTEN_PROBE_INTERVAL_S):
                        await closed.wait()
                await conn.execute("SELECT 1", timeout=5)
        finally:
            await conn.close(timeout=1)

    def _lost(self, exc: Exception, outage: str) -> str:
        """Report a lost or refused connection: an outage once per outage and kind (refused
        credentials say so by their class), anything else as an internal error. The
        outage now logged ("": none)."""
        if not expected(exc):
            self._errors.caught(Where.LISTEN, exc)
            return ""
        if outage != type(exc).__name__:
            log.warning("listen: cannot connect; workers poll until it can",
                        extra={"error_type": type(exc).__name__})
        return type(exc).__name__


def database_ports(engine: AsyncEngine, policies: Policies, upstreams: Upstreams, *,
                   owner: str, listen_url: str | None = None,
                   rng: random.Random | None = None,
                   credentials: Credentials | None = None, stores: Stores | None = None,
                   region: str | None = None) -> Ports:
    """The ports of a pool on this database, calling these upstreams with these tenants'
    credentials and running store targets' statements on `stores`, on the real clock,
    claiming `region`'s items (None: those of tenants pinned nowhere)."""
    ledger = PostgresLedger(engine, policies, owner=owner, rng=rng, region=region)
    return Ports(admission=ledger, completion=ledger, signals=ledger,
                 calls=UpstreamCalls(upstreams, credentials, StoreTargets(stores, engine)
                                     if stores is not None else None), clock=SystemClock(),
                 wakeups=Listener(listen_url) if listen_url else NoWakeups(),
                 hold=ledger.hold, holds=ledger, minutes=ledger)
