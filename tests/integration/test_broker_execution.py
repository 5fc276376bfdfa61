"""Broker mode end to end (SWEEPER_EXECUTION=rabbitmq) on the machine's RabbitMQ, a real
database and the fake upstream: the relay hands the outbox to quorum queues, workers
consume, and the ledger fences every claim and outcome, so a message published or
delivered twice calls nothing twice, and a poison message ends its items dead in the
ledger. Each test has queues of its own (the `broker` fixture's region)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import aio_pika
import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from drills.broker_stage import queue_depths
from drills.faultproxy import FaultProxy
from drills.stage import free_port
from service.config.policies import Policies
from service.execution import outbox
from service.execution.rabbitmq import REDELIVERIES, RabbitBroker, queue_names
from service.execution.relay import Relay, relay_once, works_of
from service.execution.work import Work
from service.ledger import item_selection
from service.ledger.registration import operation_key
from service.observability.metrics import REGISTRY, BrokerEvent
from service.upstreams.deletion_api import Upstreams
from service.webhooks import intake
from service.worker import WorkerPool, database_pool
from tests.conftest import AMQP_URL, LiveServer, test_settings
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.test_pipeline import make_policies, register, release_all, statuses
from tests.integration.test_webhooks import make_policies as webhook_policies
from tests.integration.test_webhooks import shopify, verified

WAIT_S = 30.0


async def until(what: str, check: Callable[[], Awaitable[bool]], seconds: float = WAIT_S
                ) -> None:
    """Wait for `check` to hold (polled), failing with `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def queue_depth(broker: RabbitBroker, role: str = "work") -> int:
    """Messages ready in one of the broker's queues (not those delivered and unsettled)."""
    name = broker.names[role]
    return (await queue_depths(AMQP_URL, [name])).get(name, 0)



class Running:
    """A pool in broker mode, running as the worker process runs it."""

    def __init__(self, engine: AsyncEngine, policies: Policies, broker: RabbitBroker) -> None:
        self.upstreams = Upstreams(policies.upstreams)
        self.pool: WorkerPool = database_pool(engine, policies, self.upstreams,
                                              concurrency=8, broker=broker, prefetch=4)
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> WorkerPool:
        self.task = asyncio.create_task(self.pool.run())
        return self.pool

    async def __aexit__(self, *exc: object) -> None:
        self.pool.stop()
        assert self.task is not None
        await self.task
        await self.upstreams.aclose()


def all_succeeded(engine: AsyncEngine, n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await statuses(engine) == {"succeeded": n}
    return check


async def test_a_run_drains_through_the_broker_each_item_once(
        engine: AsyncEngine, broker: RabbitBroker, upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url)
    await register(engine, policies, 120)
    await release_all(engine)  # three batches of 50, 50 and 20
    before = {e: _messages(e) for e in BrokerEvent}
    assert await relay_once(engine, broker) == 3
    assert await outbox.waiting(engine) == []  # marked once confirmed
    assert await queue_depth(broker) == 3
    async with Running(engine, policies, broker):
        await until("every item succeeded", all_succeeded(engine, 120))
    keys = [c.idempotency_key for c in upstream.calls()]
    assert len(keys) == 120 and len(set(keys)) == 120
    assert await queue_depth(broker) == 0  # every message settled, none dead-lettered
    assert await queue_depth(broker, "dead") == 0
    assert {e: _messages(e) - before[e] for e in BrokerEvent} == {
        BrokerEvent.PUBLISHED: 3, BrokerEvent.SETTLED: 3, BrokerEvent.DEFERRED: 0,
        BrokerEvent.DEAD: 0, BrokerEvent.REROUTED: 0}


def _messages(event: BrokerEvent) -> float:
    value = REGISTRY.get_sample_value("sweeper_broker_messages_total", {"event": event})
    return value or 0.0


async def test_a_message_carries_ledger_ids_and_its_batch_only(
        engine: AsyncEngine, broker: RabbitBroker, upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url)
    await register(engine, policies, 5, tenant="acme-secret-tenant")
    await release_all(engine)
    await relay_once(engine, broker)
    async with engine.connect() as conn:
        batch, ids = (await conn.execute(text(
            "SELECT min(batch_id), array_agg(id ORDER BY id) FROM items"))).one()
    async with _taken(broker) as message:
        await message.reject(requeue=True)
    assert message.message_id == f"batch:{batch}"
    assert Work.decode(message.body) == Work(f"batch:{batch}", tuple(ids))
    body = message.body.decode()
    assert "acme" not in body and "cart" not in body  # no tenant, no object id
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT


async def test_a_batch_published_twice_is_called_once(
        engine: AsyncEngine, broker: RabbitBroker, upstream: FakeUpstream) -> None:
    """The relay crashed between the broker's confirm and its mark: the next pass publishes
    the same batches again, and the ledger's fencing calls each item once."""
    policies = make_policies(upstream.base_url)
    await register(engine, policies, 60)
    await release_all(engine)
    waiting = await outbox.waiting(engine)
    await broker.publish([w for row in waiting for ids in row.by_region.values()
                          for w in works_of(row.kind, row.row_id, ids)])
    assert await relay_once(engine, broker) == 2  # unmarked: handed over again
    assert await queue_depth(broker) == 4
    async with Running(engine, policies, broker) as pool:
        await until("every item succeeded", all_succeeded(engine, 60))

        async def four_settled() -> bool:
            return pool.ports.completion.settled == 4  # type: ignore[attr-defined]
        await until("every message settled", four_settled)
    keys = [c.idempotency_key for c in upstream.calls()]
    assert len(keys) == 60 and len(set(keys)) == 60
    assert await queue_depth(broker) == 0  # nothing went back unsettled at the stop


async def test_a_message_of_finished_items_calls_nothing(
        engine: AsyncEngine, broker: RabbitBroker, upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url)
    await register(engine, policies, 10)
    await release_all(engine)
    await relay_once(engine, broker)
    async with Running(engine, policies, broker) as pool:
        await until("every item succeeded", all_succeeded(engine, 10))
        calls = len(upstream.calls())
        settled = pool.ports.completion.settled  # type: ignore[attr-defined]
        async with engine.connect() as conn:
            ids = (await conn.execute(text("SELECT array_agg(id ORDER BY id) FROM items"))
                   ).scalar_one()
        await broker.publish([Work.of("batch:1", ids)])  # a stray copy, delivered again

        async def copy_settled() -> bool:
            return pool.ports.completion.settled > settled  # type: ignore[attr-defined]
        await until("the copy settled", copy_settled)
    assert len(upstream.calls()) == calls == 10
    assert await queue_depth(broker) == 0


async def test_a_message_past_its_delivery_limit_ends_its_items_dead_and_a_redrive_calls_them(
        engine: AsyncEngine, broker: RabbitBroker, upstream: FakeUpstream) -> None:
    """Every consumer that took the message died with it: on its last allowed delivery its
    items end `dead` with the reason, uncalled, and the message is settled. An operator's
    re-drive reaches the broker (the outbox's requeues) and they are called."""
    policies = make_policies(upstream.base_url)
    await register(engine, policies, 3)
    await release_all(engine)
    await relay_once(engine, broker)
    for _ in range(REDELIVERIES):  # a consumer takes it and its channel dies
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(broker.names["work"], passive=True)
            assert await queue.get(timeout=5) is not None
    async with Running(engine, policies, broker):
        async def ended() -> bool:
            return await statuses(engine) == {"dead": 3}
        await until("the items ended dead", ended)
    assert await queue_depth(broker) == 0  # settled, not handed back at the stop
    async with engine.connect() as conn:
        reasons = (await conn.execute(text("SELECT DISTINCT dead_reason FROM items"))).all()
    assert reasons == [("broker_delivery_limit",)]
    assert upstream.calls() == []
    # an operator re-drives them: the re-drive is handed to the broker, and they are called
    redriven = await item_selection.redrive(engine, item_selection.ItemFilter(
        reason="broker_delivery_limit"), actor="test", reason="after the fix", limit=10)
    assert len(redriven) == 3
    assert await relay_once(engine, broker) == 1
    async with Running(engine, policies, broker):
        await until("the re-driven items succeeded", all_succeeded(engine, 3))
    assert len({c.idempotency_key for c in upstream.calls()}) == 3


async def test_the_relay_hands_over_webhook_releases_and_ends_dead_letters(
        db_url: str, engine: AsyncEngine, broker: RabbitBroker) -> None:
    """The relay as the leader runs it: a webhook delivery that released an item reaches
    the broker (its receipt marked), and a message the broker dead-lettered ends its items
    dead in the ledger."""
    policies = webhook_policies()
    box = intake.Intake()
    try:
        receipt = await box.apply(engine.url, test_settings(db_url), verified(
            policies, shopify("orders/cancelled", {"id": 5})))
    finally:
        await box.aclose()
    assert receipt.released == 1
    relay = asyncio.create_task(Relay(engine, broker, poll_s=0.01).run())
    try:
        async def handed() -> bool:
            return await outbox.waiting(engine) == []
        await until("the outbox handed over", handed)
        async with _taken(broker) as message:
            assert message.message_id == f"receipt:{await _receipt_id(engine)}"
            assert Work.decode(message.body).item_ids == receipt.item_ids
            await message.reject(requeue=False)  # dead-lettered, as past the delivery limit

        async def ended() -> bool:
            return await statuses(engine) == {"dead": 1}
        await until("the dead letter's item ended", ended)
    finally:
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
    assert await queue_depth(broker, "dead") == 0


@contextlib.asynccontextmanager
async def _taken(broker: RabbitBroker) -> AsyncIterator[aio_pika.abc.AbstractIncomingMessage]:
    """The next message of the work queue, its channel open until the block ends."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(broker.names["work"], passive=True)
        message = await queue.get(timeout=5)
        assert message is not None
        yield message


async def _receipt_id(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT id FROM webhook_receipts"))).scalar_one())


# -- the service as deployed: `sweeper serve` with SWEEPER_EXECUTION=rabbitmq -------------

def _carts(tenants: tuple[str, ...], n: int) -> list[dict[str, str]]:
    return [{"tenant_id": t, "object_id": f"o{i}", "policy": "carts",
             "due_at": "2026-01-01T00:00:00Z"} for t in tenants for i in range(n)]


async def _run_items(api: httpx.AsyncClient, run_id: int) -> dict[str, int]:
    response = await api.get(f"/v1/runs/{run_id}")
    assert response.status_code == 200, response.text
    items: dict[str, int] = response.json()["items"]
    return items


async def test_the_service_runs_a_run_through_the_broker(
        db_url: str, broker_url: str, upstream: FakeUpstream) -> None:
    """Items registered and a run triggered over the API: the leader's relay hands the
    batches to the broker, the replica's workers consume them, each item is called once,
    and the queues are empty after."""
    policies = make_policies(upstream.base_url)
    settings = test_settings(db_url, workers=8, execution="rabbitmq", broker_url=broker_url)
    async with LiveServer(settings, policies, db_url) as live, live.client() as api:
        live.count_progress_afresh()
        assert (await api.post("/v1/items", json={"items": _carts(("a", "b"), 40)})
                ).status_code == 200
        run = (await api.post("/v1/runs", json={})).json()

        async def drained() -> bool:
            return await _run_items(api, run["id"]) == {"succeeded": 80}
        await until("the run drained", drained)
    keys = [c.idempotency_key for c in upstream.calls()]
    assert len(keys) == 80 and len(set(keys)) == 80
    assert await _depths(broker_url) == {}


async def _depths(url: str) -> dict[str, int]:
    """Messages ready in each of the vhost's sweeper queues, those not empty."""
    return await queue_depths(url, queue_names(None).values())


@pytest.mark.slow
async def test_a_paused_scope_waits_in_the_broker_and_others_go_on(
        db_url: str, broker_url: str) -> None:
    """A tenant whose upstream answers 401 is paused: its items go back to the broker to
    wait (never blocking the other tenant's, which finish), and once the scope is resumed
    they come back and finish too, each item called at most twice (its 401, then its
    success)."""
    async with FakeUpstream(scope_fn=lambda _m, path, _h: path.split("/")[2]) as upstream:
        policies = make_policies(upstream.base_url, path="/t/{tenant_id}/{object_id}")
        upstream.inject(Fault.STATUS, status=401, times=None,
                        match=lambda c: c.scope == "bad")
        settings = test_settings(db_url, workers=4, execution="rabbitmq",
                                 broker_url=broker_url, broker_prefetch=2)
        async with LiveServer(settings, policies, db_url) as live, live.client() as api:
            live.count_progress_afresh()
            await api.post("/v1/items", json={"items": _carts(("bad", "good"), 5)})
            run = (await api.post("/v1/runs", json={})).json()

            async def good_done() -> bool:
                return (await _run_items(api, run["id"])).get("succeeded") == 5
            await until("the good tenant's items finished", good_done)
            scopes = {s["name"]: s for s in (await api.get("/v1/scopes")).json()["scopes"]}
            assert scopes["tenant:bad"]["paused"] is True
            upstream.clear_faults()
            assert (await api.post("/v1/scopes/tenant:bad/resume", json={
                "reason": "credential rotated"})).status_code == 200

            async def all_done() -> bool:
                return await _run_items(api, run["id"]) == {"succeeded": 10}
            await until("the paused tenant's items finished after the resume", all_done)
    per_key = Counter(c.idempotency_key for c in upstream.calls())
    assert len(per_key) == 10 and max(per_key.values()) <= 2
    assert await _depths(broker_url) == {}


async def test_a_held_tenant_is_never_called_and_its_release_hands_it_over_at_once(
        db_url: str, broker_url: str, upstream: FakeUpstream) -> None:
    """A legal hold on one tenant: its items are never called while the hold stands (their
    message goes back to the broker for minutes), the other tenant's finish; releasing the
    hold hands its items to the broker at once (the relay's outbox), not minutes later."""
    policies = make_policies(upstream.base_url)
    settings = test_settings(db_url, workers=4, execution="rabbitmq", broker_url=broker_url)
    async with LiveServer(settings, policies, db_url) as live, live.client() as api:
        live.count_progress_afresh()
        hold = (await api.post("/v1/holds", json={"tenant_id": "held", "reason": "litigation",
                                                   "reference": "CASE-7"})).json()
        await api.post("/v1/items", json={"items": _carts(("held", "free"), 6)})
        run = (await api.post("/v1/runs", json={})).json()

        async def free_done() -> bool:
            return (await _run_items(api, run["id"])).get("succeeded") == 6
        await until("the free tenant's items finished", free_done)

        async def held_deferred() -> bool:  # the held items' message waits in the broker
            return sum(n for name, n in (await _depths(broker_url)).items()
                       if ".wait." in name) == 1
        await until("the held items deferred", held_deferred)
        held_keys = {operation_key("held", f"o{i}", "carts", 1) for i in range(6)}
        assert not [c for c in upstream.calls() if c.idempotency_key in held_keys]
        released = await api.post(f"/v1/holds/{hold['id']}/release", json={"why": "settled"})
        assert released.status_code == 200, released.text

        async def all_done() -> bool:
            return await _run_items(api, run["id"]) == {"succeeded": 12}
        await until("the released tenant's items finished", all_done, seconds=20)
    assert len({c.idempotency_key for c in upstream.calls()}) == 12


async def test_a_worker_started_while_the_broker_is_out_of_reach_consumes_once_it_is_back(
        engine: AsyncEngine, broker_url: str, upstream: FakeUpstream,
        caplog: pytest.LogCaptureFixture) -> None:
    """Consuming retries until the broker answers (the robust connection alone recovers
    only a connection it once had): the items are called once it is back."""
    dead_end = FaultProxy("127.0.0.1", free_port())  # refuses: nothing listens there
    await dead_end.start()
    try:
        url = broker_url.replace(":5672/", f":{dead_end.port}/")
        policies = make_policies(upstream.base_url)
        await register(engine, policies, 20)
        await release_all(engine)
        async with contextlib.AsyncExitStack() as stack:
            worker = RabbitBroker(url)
            stack.push_async_callback(worker.close)
            running = Running(engine, policies, worker)
            await stack.enter_async_context(running)

            async def warned() -> bool:
                return "broker: cannot consume; retrying" in caplog.text
            await until("the worker's warning", warned)
            relay = RabbitBroker(broker_url)  # the leader reaches the broker
            stack.push_async_callback(relay.close)
            assert await relay_once(engine, relay) == 1
            dead_end.target = ("127.0.0.1", 5672)  # the broker is back
            await until("every item succeeded", all_succeeded(engine, 20))
    finally:
        await dead_end.close()
    assert len({c.idempotency_key for c in upstream.calls()}) == 20
