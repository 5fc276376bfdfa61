"""The item life cycle as a Hypothesis state machine against a model, on a real database.

Rules drive the real operations (register, publish a run, claim, complete, complete with a
stale lease, hand a lease back, let leases expire, re-drive, cancel) in random orders; after
every step each item's row must match the model: status, attempts, released or not. The
claim's clock is pinned (`now=`) to a virtual time a day ahead of the database's, so leases
expire when the machine says so, and items a completion sends back with no delay are
claimable at once.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service import claims, ledger, runs
from service.claims import Completion, Lease
from service.db.engine import make_engine
from service.settings import async_url
from tests.conftest import test_settings
from tests.integration.test_pipeline import make_policies

N_ITEMS = 5
LEASE_S = 30
MAX_ATTEMPTS = 3
SCOPE = "tenant:acme"
POLICIES = make_policies("http://127.0.0.1:9", lease_seconds=LEASE_S, max_attempts=MAX_ATTEMPTS)
POLICY = POLICIES.policies["carts"]


@dataclass
class Item:
    """What the model believes about one item."""

    status: str = "absent"          # absent | pending | leased | succeeded | dead | cancelled
    due: datetime | None = None
    released: bool = False
    attempts: int = 0
    lease: Lease | None = None
    lease_expires: datetime | None = None
    old_leases: list[Lease] = field(default_factory=list)


class ItemLifeCycle(RuleBasedStateMachine):
    url: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engine: AsyncEngine = make_engine(async_url(self.url), test_settings(self.url))
        self.run(self._reset())
        db_now = self.run(self._db_now())
        self.now = db_now + timedelta(days=1)
        self.items = [Item() for _ in range(N_ITEMS)]
        self.ids: dict[int, int] = {}  # model index -> item id

    # -- plumbing ----------------------------------------------------------------------
    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.engine.dispose())
        self.loop.close()

    async def _reset(self) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(text("TRUNCATE items, attempts, batches, runs, "
                                    "operator_actions RESTART IDENTITY CASCADE"))

    async def _db_now(self) -> datetime:
        async with self.engine.connect() as conn:
            value: datetime = (await conn.execute(text("SELECT now()"))).scalar_one()
            return value

    def completion(self, lease: Lease, outcome: str, status: str) -> Completion:
        return Completion(lease=lease, worker="machine", outcome=outcome, status=status,
                          reason=outcome, http_status=204 if outcome == "succeeded" else 500,
                          retry_after_seconds=None, retry_in_seconds=0.0,
                          refund_attempt=False, started_at=self.now, finished_at=self.now,
                          latency_ms=1.0)

    # -- rules -------------------------------------------------------------------------
    @rule(i=st.integers(0, N_ITEMS - 1), minutes=st.integers(-120, 120))
    def register(self, i: int, minutes: int) -> None:
        due = self.now + timedelta(minutes=minutes)
        result = self.run(ledger.register(self.engine, [
            ledger.Registration("acme", f"o{i}", POLICY, due)]))
        item = self.items[i]
        if item.status == "absent":
            assert (result.inserted, result.advanced) == (1, 0)
            item.status, item.due = "pending", due
        elif item.status == "pending" and item.due is not None and due < item.due:
            assert (result.inserted, result.advanced) == (0, 1)
            item.due = due  # moves earlier, never later
        else:
            assert (result.inserted, result.advanced, result.unchanged) == (0, 0, 1)
        if i not in self.ids:
            self.ids[i] = self.run(self._id_of(i))

    async def _id_of(self, i: int) -> int:
        async with self.engine.connect() as conn:
            return int((await conn.execute(text("SELECT id FROM items WHERE object_id = :o"),
                                           {"o": f"o{i}"})).scalar_one())

    @rule()
    def publish(self) -> None:
        run_id, _ = self.run(runs.create_run(
            self.engine, runs.RunRequest(None, None, self.now, False, None), None))
        assert self.run(runs.publish(self.engine, run_id, batch_size=2))
        for item in self.items:
            if (item.status == "pending" and not item.released and item.due is not None
                    and item.due <= self.now):
                item.released = True

    def claimable(self) -> list[int]:
        def ready(item: Item) -> bool:
            return item.status == "pending" and item.released

        def expired(item: Item) -> bool:
            return (item.status == "leased" and item.lease_expires is not None
                    and item.lease_expires <= self.now)

        return [i for i, item in enumerate(self.items) if ready(item) or expired(item)]

    @rule(n=st.integers(1, N_ITEMS))
    def claim(self, n: int) -> None:
        expected = self.claimable()
        expired = [i for i in expected if self.items[i].status == "leased"]
        got = self.run(claims.claim(self.engine, owner="machine", grants={SCOPE: n},
                                    lease_seconds={POLICY.name: LEASE_S}, now=self.now))
        by_id = {v: k for k, v in self.ids.items()}
        claimed = [by_id[lease.item_id] for lease in got.leases]
        assert len(claimed) == min(n, len(expected)), (claimed, expected)
        assert set(claimed) <= set(expected)
        # expired leases are taken over before fresh work
        assert set(expired[:n]) <= set(claimed) or len(expired) > n
        assert got.reclaimed == len(set(claimed) & set(expired))
        for lease in got.leases:
            item = self.items[by_id[lease.item_id]]
            if item.lease is not None:
                item.old_leases.append(item.lease)
            item.status, item.lease, item.attempts = "leased", lease, item.attempts + 1
            item.lease_expires = self.now + timedelta(seconds=LEASE_S)
            assert lease.lease_expires_at == item.lease_expires
            assert lease.attempt == item.attempts

    def leased(self) -> list[int]:
        return [i for i, item in enumerate(self.items) if item.status == "leased"]

    @rule(data=st.data(), outcome=st.sampled_from(["succeeded", "transient", "permanent"]))
    def complete(self, data: st.DataObject, outcome: str) -> None:
        leased = self.leased()
        if not leased:
            return
        i = data.draw(st.sampled_from(leased))
        item = self.items[i]
        assert item.lease is not None
        if outcome == "succeeded":
            status = "succeeded"
        elif outcome == "permanent" or item.attempts >= MAX_ATTEMPTS:
            status = "dead"
        else:
            status = "pending"
        fenced = self.run(claims.complete(self.engine, [
            self.completion(item.lease, outcome, status)]))
        assert fenced == []
        item.old_leases.append(item.lease)
        item.status, item.lease, item.lease_expires = status, None, None

    @rule(data=st.data())
    def complete_with_a_stale_lease(self, data: st.DataObject) -> None:
        stale = [i for i, item in enumerate(self.items) if item.old_leases]
        if not stale:
            return
        i = data.draw(st.sampled_from(stale))
        old = data.draw(st.sampled_from(self.items[i].old_leases))
        fenced = self.run(claims.complete(self.engine, [
            self.completion(old, "succeeded", "succeeded")]))
        assert fenced == [old.item_id]  # attempt recorded, item untouched

    @rule(data=st.data())
    def hand_back(self, data: st.DataObject) -> None:
        leased = self.leased()
        if not leased:
            return
        i = data.draw(st.sampled_from(leased))
        item = self.items[i]
        assert item.lease is not None
        self.run(claims.release(self.engine, [item.lease]))
        item.old_leases.append(item.lease)
        item.status, item.lease, item.lease_expires = "pending", None, None
        item.attempts = max(item.attempts - 1, 0)

    @rule(seconds=st.sampled_from([1, LEASE_S - 1, LEASE_S, LEASE_S + 1, 3600]))
    def time_passes(self, seconds: int) -> None:
        self.now += timedelta(seconds=seconds)

    @rule()
    def redrive_dead(self) -> None:
        dead = [self.ids[i] for i, item in enumerate(self.items) if item.status == "dead"]
        got = self.run(ledger.redrive(self.engine, ledger.ItemFilter(ids=list(self.ids.values())),
                                      actor="machine", reason="test", limit=100))
        assert sorted(got) == sorted(dead)
        for item in self.items:
            if item.status == "dead":
                item.status, item.attempts = "pending", 0

    @rule(i=st.integers(0, N_ITEMS - 1))
    def cancel(self, i: int) -> None:
        if i not in self.ids:
            return
        got = self.run(ledger.cancel(self.engine, ledger.ItemFilter(ids=[self.ids[i]]),
                                     actor="machine", reason="test", limit=10))
        item = self.items[i]
        if item.status == "pending":
            assert got == [self.ids[i]]
            item.status = "cancelled"
        else:
            assert got == []  # in flight or finished: cannot be withdrawn

    # -- the ledger matches the model after every step ------------------------------------
    @invariant()
    def ledger_matches_model(self) -> None:
        rows = self.run(self._rows())
        for i, item in enumerate(self.items):
            row = rows.get(f"o{i}")
            if item.status == "absent":
                assert row is None
                continue
            assert row is not None
            status, attempts, released, token = row
            assert status == item.status, (i, row, item)
            assert attempts == item.attempts, (i, row, item)
            assert released == item.released, (i, row, item)
            expected_token = item.lease.lease_token if item.lease else None
            assert token == expected_token

    async def _rows(self) -> dict[str, tuple[str, int, bool, uuid.UUID | None]]:
        async with self.engine.connect() as conn:
            result = await conn.execute(text(
                "SELECT object_id, status, attempts, released_at IS NOT NULL AS released, "
                "lease_token FROM items"))
            return {r.object_id: (r.status, r.attempts, r.released, r.lease_token)
                    for r in result}


@pytest.mark.slow
def test_item_life_cycle_matches_the_model(db_url: str) -> None:
    ItemLifeCycle.url = db_url
    run_state_machine_as_test(ItemLifeCycle, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]))
