"""Regions end to end (service/config/regions.py): tenants pinned in the policies file are
written with their region, a worker of one region never calls another region's tenant in
either execution mode, nothing is lost when a region's workers stop and start again, and
the evidence says where each deletion was made. Real database, fake upstream, and (broker
mode) the machine's RabbitMQ on queues of each test's own."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from drills.broker_stage import queue_depths
from service.config.policies import Policies
from service.evidence import deletion_records
from service.execution import outbox
from service.execution.rabbitmq import RabbitBroker
from service.execution.relay import relay_once
from service.ledger import item_selection, region_pins, registration
from service.ledger.item_selection import ItemFilter
from service.upstreams.deletion_api import Upstreams
from service.webhooks import receipts
from service.webhooks.deliveries import Delivery, Hint
from service.worker import database_pool
from service.worker.process import agree_with_policies
from tests.conftest import AMQP_URL, policies_from
from tests.fakes.upstream import FakeUpstream
from tests.integration.test_broker_execution import until
from tests.integration.test_pipeline import PAST, release_all

TENANTS = {"ACME": "eu", "globex": "us", "initech": None}  # as registered: region pinned


def regional_policies(base_url: str, regions: dict[str, list[str]] | None = None
                      ) -> Policies:
    """One policy calling `/carts/{object_id}`, a scope per tenant; acme pinned to eu (in
    another spelling than it is registered in) and globex to us, unless `regions`."""
    return policies_from({
        "upstreams": {"shop": {"base_url": base_url, "timeout_seconds": 2}},
        "policies": {"carts": {
            "version": 1, "upstream": "shop", "path": "/carts/{object_id}",
            "scope": "tenant:{tenant_id}", "rate": {"per_second": 1000, "burst": 1000},
            "lease_seconds": 30, "max_attempts": 3,
            "backoff": {"base_seconds": 0.01, "max_seconds": 0.05}}},
        "regions": {"eu": ["acme."], "us": ["Globex"]} if regions is None else regions})


async def register(engine: AsyncEngine, policies: Policies, n: int) -> None:
    """`n` items per tenant of TENANTS, each object id naming its tenant."""
    policy = policies.policies["carts"]
    await registration.register(engine, [
        registration.Registration(tenant, f"{tenant.lower()}-{i}", policy, PAST)
        for tenant in TENANTS for i in range(n)])


async def by_tenant(engine: AsyncEngine) -> dict[tuple[str, str | None, str], int]:
    """Items by (tenant, region, status)."""
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT tenant_id, region, status, count(*) AS n FROM items GROUP BY 1, 2, 3"
        ))).all()
    return {(r.tenant_id, r.region, r.status): r.n for r in rows}


def succeeded(engine: AsyncEngine, tenant: str, n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        async with engine.connect() as conn:
            return n == (await conn.execute(text(
                "SELECT count(*) FROM items WHERE tenant_id = :t AND status = 'succeeded'"),
                {"t": tenant})).scalar_one()
    return check


def called(upstream: FakeUpstream) -> Counter[str]:
    """Calls by the tenant their object id names."""
    return Counter(call.path.removeprefix("/carts/").rsplit("-", 1)[0]
                   for call in upstream.calls())


async def evidence_regions(engine: AsyncEngine) -> dict[str, set[str | None]]:
    """The regions the evidence log names, by the tenant of each deletion."""
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT records FROM evidence_log"))).all()
    found: dict[str, set[str | None]] = {}
    for row in rows:
        for data in deletion_records.frames(bytes(row.records)):
            record = deletion_records.parse(data)
            found.setdefault(record["tenant_id"], set()).add(record["region"])
    return found


class Workers:
    """A pool of one region running as a worker process runs it (its start-up included)."""

    def __init__(self, engine: AsyncEngine, policies: Policies, region: str | None,
                 broker: RabbitBroker | None = None) -> None:
        self.engine, self.policies = engine, policies
        self.upstreams = Upstreams(policies.upstreams)
        self.broker = broker is not None
        self.pool = database_pool(engine, policies, self.upstreams, concurrency=8,
                                  region=region, prefetch=4,
                                  broker=None if broker is None else broker.routed(region))
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Workers:
        self.task = asyncio.create_task(self.pool.run(first=lambda: agree_with_policies(
            self.engine, self.policies, broker=self.broker)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.pool.stop()
        assert self.task is not None
        await self.task
        await self.upstreams.aclose()



async def test_items_are_written_with_their_tenants_region(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    await register(engine, regional_policies(upstream.base_url), 3)
    assert await by_tenant(engine) == {("ACME", "eu", "pending"): 3,
                                       ("globex", "us", "pending"): 3,
                                       ("initech", None, "pending"): 3}
    page = await item_selection.list_items(engine, status=None, item_filter=ItemFilter(),
                                           after=0, limit=10)
    assert {(item["tenant_id"], item["region"]) for item in page} == set(TENANTS.items())


async def drain_by_region(engine: AsyncEngine, policies: Policies, upstream: FakeUpstream,
                          broker: RabbitBroker | None, n: int) -> None:
    """The us workers, then the unpinned ones, each taking its own tenant's items only;
    then the eu workers stopped part way and started again: every item deleted once."""
    async with Workers(engine, policies, "us", broker):
        await until("globex's items succeeded", succeeded(engine, "globex", n))
    async with Workers(engine, policies, None, broker):
        await until("initech's items succeeded", succeeded(engine, "initech", n))
    assert called(upstream) == {"globex": n, "initech": n}
    assert (await by_tenant(engine))[("ACME", "eu", "pending")] == n  # untouched

    async def some_eu_deleted() -> bool:
        return called(upstream)["acme"] >= 5
    async with Workers(engine, policies, "eu", broker):
        await until("some of acme's items called", some_eu_deleted)
    async with Workers(engine, policies, "eu", broker):
        await until("acme's items succeeded", succeeded(engine, "ACME", n))
    keys = Counter(call.idempotency_key for call in upstream.calls())
    assert len(keys) == 3 * n and set(keys.values()) == {1}
    assert await evidence_regions(engine) == {"ACME": {"eu"}, "globex": {"us"},
                                              "initech": {None}}


async def test_a_worker_takes_only_its_regions_items_in_database_mode(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    policies = regional_policies(upstream.base_url)
    await register(engine, policies, 40)
    await release_all(engine)
    await drain_by_region(engine, policies, upstream, None, 40)


async def test_each_region_has_its_own_queues_in_broker_mode(
        engine: AsyncEngine, broker: RabbitBroker, upstream: FakeUpstream) -> None:
    policies = regional_policies(upstream.base_url)
    await register(engine, policies, 40)
    await release_all(engine)  # batches of 50: the 120 items in 3, each region's apart
    assert await relay_once(engine, broker) == 3
    depths = await queue_depths(AMQP_URL, broker.queues)
    assert {name.removeprefix(broker.names["work"].removesuffix("work"))
            for name in depths} == {"work", "eu.work", "us.work"}
    await drain_by_region(engine, policies, upstream, broker, 40)


async def test_items_pinned_after_their_message_was_sent_go_to_their_region(
        engine: AsyncEngine, broker: RabbitBroker, upstream: FakeUpstream) -> None:
    """Published while their tenant was pinned nowhere, then pinned at a restart: the
    unpinned workers hand them to the relay, which sends them to the eu queues."""
    before = regional_policies(upstream.base_url, regions={})
    await register(engine, before, 10)
    await release_all(engine)
    await relay_once(engine, broker)
    pinned = regional_policies(upstream.base_url)
    async with Workers(engine, pinned, None, broker):  # re-pins at its start
        await until("initech's items succeeded", succeeded(engine, "initech", 10))

        async def rerouted() -> bool:
            return bool(await outbox.waiting(engine))
        await until("the other regions' items handed back", rerouted)
    assert called(upstream) == {"initech": 10}
    await relay_once(engine, broker)
    async with Workers(engine, pinned, "eu", broker), Workers(engine, pinned, "us", broker):
        await until("acme's items succeeded", succeeded(engine, "ACME", 10))
        await until("globex's items succeeded", succeeded(engine, "globex", 10))
    assert called(upstream) == {"initech": 10, "acme": 10, "globex": 10}


async def requeued(engine: AsyncEngine) -> list[list[int]]:
    """The re-drives waiting for the relay, oldest first."""
    async with engine.connect() as conn:
        return [list(r.item_ids) for r in (await conn.execute(text(
            "SELECT item_ids FROM requeues WHERE enqueued_at IS NULL ORDER BY id"))).all()]


async def test_a_changed_pin_moves_every_item_at_start(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    await register(engine, regional_policies(upstream.base_url, regions={}), 2)
    async with engine.begin() as conn:  # deleted already: a re-drive would keep the pin too
        await conn.execute(text(
            "UPDATE items SET status = 'succeeded', completed_at = now() "
            "WHERE object_id = 'acme-0'"))
    moved = regional_policies(upstream.base_url, regions={"eu": ["acme", "INITECH"]})
    assert await region_pins.reconcile(engine, moved.regions, hand_over=True) == 4
    assert await by_tenant(engine) == {("ACME", "eu", "succeeded"): 1,
                                       ("ACME", "eu", "pending"): 1,
                                       ("globex", None, "pending"): 2,
                                       ("initech", "eu", "pending"): 2}
    assert await requeued(engine) == []  # none released: no message waits anywhere
    async with engine.begin() as conn:  # written since by a process with another file
        await conn.execute(text("UPDATE items SET region = NULL WHERE object_id = 'acme-1'"))
    # the same pins again: applied already, nothing read (the claims correct that item)
    assert await region_pins.reconcile(engine, moved.regions, hand_over=True) == 0
    swapped = regional_policies(upstream.base_url, regions={"us": ["acme"]})
    assert await region_pins.reconcile(engine, swapped.regions, hand_over=True) == 4
    assert await by_tenant(engine) == {("ACME", "us", "succeeded"): 1,
                                       ("ACME", "us", "pending"): 1,
                                       ("globex", None, "pending"): 2,
                                       ("initech", None, "pending"): 2}


async def test_a_tenant_of_more_items_than_a_chunk_moves_whole(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    """Items move MOVE_CHUNK a statement (each well inside the statement timeout), until
    a statement moves fewer."""
    policy = regional_policies(upstream.base_url, regions={}).policies["carts"]
    n = region_pins.MOVE_CHUNK + 1
    await registration.register(engine, [registration.Registration(
        "acme", f"acme-{i}", policy, PAST) for i in range(n)])
    moved = regional_policies(upstream.base_url, regions={"eu": ["acme"]})
    assert await region_pins.reconcile(engine, moved.regions, hand_over=False) == n
    assert await by_tenant(engine) == {("acme", "eu", "pending"): n}


async def test_a_worker_never_calls_an_item_its_file_pins_elsewhere(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    """Items written by processes with a file that pinned nothing (a rollout in progress),
    after the new pins were applied: a worker of no region claims them, hands back those
    its own file pins to eu or us, and gives them that region; their region's workers
    delete them."""
    await register(engine, regional_policies(upstream.base_url, regions={}), 10)
    await release_all(engine)
    pinned = regional_policies(upstream.base_url)
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO region_pins VALUES (1, :digest, now())"),
                           {"digest": pinned.regions.digest})
    async with Workers(engine, pinned, None):
        await until("initech's items succeeded", succeeded(engine, "initech", 10))

        async def corrected() -> bool:
            found = await by_tenant(engine)
            return found.get(("ACME", "eu", "pending")) == found.get(
                ("globex", "us", "pending")) == 10
        await until("the others' items given their regions", corrected)
    assert called(upstream) == {"initech": 10}
    async with Workers(engine, pinned, "eu"), Workers(engine, pinned, "us"):
        await until("acme's items succeeded", succeeded(engine, "ACME", 10))
        await until("globex's items succeeded", succeeded(engine, "globex", 10))
    assert called(upstream) == {"initech": 10, "acme": 10, "globex": 10}


async def test_a_webhook_writes_its_items_with_their_region(
        engine: AsyncEngine, db_url: str, upstream: FakeUpstream) -> None:
    policy = regional_policies(upstream.base_url).policies["carts"]
    delivery = Delivery("shopify", "w-1", "carts/delete", None, tuple(
        Hint(policy, tenant, f"{tenant.lower()}-hook", None) for tenant in TENANTS))
    conn = await asyncpg.connect(db_url)
    try:
        await receipts.record(conn, receipts.delivery_params(delivery))
    finally:
        await conn.close()
    assert await by_tenant(engine) == {("ACME", "eu", "pending"): 1,
                                       ("globex", "us", "pending"): 1,
                                       ("initech", None, "pending"): 1}


async def test_a_regions_items_are_handed_on_when_it_is_dropped_from_the_file(
        engine: AsyncEngine, broker: RabbitBroker, upstream: FakeUpstream) -> None:
    """Published to eu's queues, then eu dropped from the file and no eu worker left to
    read them: the start-up that unpins the items hands them to the relay, which sends
    them to the unpinned tenants' queues."""
    pinned = regional_policies(upstream.base_url, regions={"eu": ["acme"]})
    await register(engine, pinned, 10)
    await release_all(engine)
    await relay_once(engine, broker)
    assert (await queue_depths(AMQP_URL, [broker.routed("eu").names["work"]])) == {
        broker.routed("eu").names["work"]: 1}
    dropped = regional_policies(upstream.base_url, regions={})
    assert await region_pins.reconcile(engine, dropped.regions, hand_over=True) == 10
    assert len(await requeued(engine)) == 1
    await relay_once(engine, broker)
    async with Workers(engine, dropped, None, broker):
        await until("acme's items succeeded", succeeded(engine, "ACME", 10))
        await until("initech's items succeeded", succeeded(engine, "initech", 10))
        await until("globex's items succeeded", succeeded(engine, "globex", 10))
    assert called(upstream) == {"acme": 10, "globex": 10, "initech": 10}
