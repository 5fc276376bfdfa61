"""Broker mode in a drill (SWEEPER_EXECUTION=rabbitmq): RabbitMQ nodes of the drill's own
(drills/rabbitnodes.py), one or a cluster, behind a proxy that stands where a cluster's
Service stands (a new connection goes to the first node that takes it); the environment
that puts a worker process in broker mode; and the leader's relay, which the drill runs
itself as the leader would, handing what the drill publishes to the broker.

The workers' AMQP heartbeat is short (HEARTBEAT_S), so a link cut without a reset is seen
in seconds on both sides, as a deployment that cares about partitions configures it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Final

import aio_pika

from drills.faultproxy import FaultProxy
from drills.rabbitnodes import RabbitNode
from drills.stage import Stage
from service.config.settings import Settings, async_url
from service.db.engine import make_engine
from service.execution.rabbitmq import RabbitBroker, queue_names
from service.execution.relay import Relay
from service.execution.work import Work

HEARTBEAT_S: Final = 5
PREFETCH: Final = 4


class BrokerStage:
    """The drill's broker: `nodes` (the first is where the proxy sends connections first),
    the URL through the proxy, and the relay running until the drill ends."""

    def __init__(self, stage: Stage, nodes: list[RabbitNode]) -> None:
        self.stage = stage
        self.nodes = nodes
        first, *rest = nodes
        self.proxy = FaultProxy("127.0.0.1", first.amqp_port,
                                fallbacks=[("127.0.0.1", n.amqp_port) for n in rest])
        self.url = ""

    @classmethod
    async def open(cls, stage: Stage, nodes: int = 1) -> BrokerStage:
        """Start `nodes` nodes (joined into one cluster), the proxy and the relay; every
        one of them closed when the drill's stage closes."""
        made = [RabbitNode(stage.workdir / "rabbit") for _ in range(nodes)]
        stage.cleanups.append(lambda: _close_all(made))
        await asyncio.gather(*(node.start() for node in made))
        for node in made[1:]:
            await node.join(made[0])
        broker = cls(stage, made)
        await broker.proxy.start()
        stage.cleanups.append(broker.proxy.close)
        broker.url = f"amqp://guest:guest@127.0.0.1:{broker.proxy.port}/?heartbeat={HEARTBEAT_S}"
        broker._start_relay()
        return broker

    @property
    def env(self) -> dict[str, str]:
        """A worker process's settings for broker mode on this broker."""
        return {"SWEEPER_EXECUTION": "rabbitmq", "SWEEPER_BROKER_URL": self.url,
                "SWEEPER_BROKER_PREFETCH": str(PREFETCH)}

    def _start_relay(self) -> None:
        # the drill's own broker clients, as a service process's (observability/logs.py):
        # a killed node is the drill's fault, not an error to print per channel
        for broker_client in ("aiormq", "aio_pika"):
            logging.getLogger(broker_client).setLevel(logging.CRITICAL)
        engine = make_engine(async_url(self.stage.db_url),
                             Settings(database_url=self.stage.db_url, workers=0))
        relay = RabbitBroker(self.url)
        task = asyncio.create_task(Relay(engine, relay, regions=self.regions).run(),
                                   name="drill-relay")

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await relay.close()
            await engine.dispose()
        self.stage.cleanups.append(stop)

    @property
    def regions(self) -> tuple[str | None, ...]:
        """The regions the drill's policies declare, and None (the tenants pinned nowhere)."""
        return self.stage.policies.regions.served if self.stage.policies else (None,)

    def _queues(self) -> list[str]:
        return [name for region in self.regions for name in queue_names(region).values()]

    async def depths(self) -> dict[str, int]:
        """Messages ready in each of the drill's queues that holds any."""
        return await queue_depths(self.url, self._queues())

    async def take_all(self) -> list[Work]:
        """Every message left in any queue, taken (acked) and read."""
        taken: list[Work] = []
        connection = await aio_pika.connect(self.url, timeout=10)
        async with connection:
            channel = await connection.channel()
            for name in self._queues():
                queue = await channel.declare_queue(name, passive=True)
                while (message := await queue.get(fail=False, timeout=10)) is not None:
                    taken.append(Work.decode(message.body))
                    await message.ack()
        return taken


async def queue_depths(url: str, names: Iterable[str]) -> dict[str, int]:
    """Messages ready (not those delivered and unsettled) in each of the queues `names`
    that holds any, on the broker at `url`."""
    found: dict[str, int] = {}
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        for name in names:
            queue = await channel.declare_queue(name, passive=True)
            if queue.declaration_result.message_count:
                found[name] = int(queue.declaration_result.message_count)
    return found


@contextlib.asynccontextmanager
async def scratch_queues(url: str, label: str) -> AsyncIterator[RabbitBroker]:
    """A RabbitBroker on queues of its own (a prefix of `label` and a random part) on the
    broker at `url`, its queues deleted after (every region's it used): a test's or a
    benchmark's."""
    prefix = f"{label}{uuid.uuid4().hex[:12]}"
    broker = RabbitBroker(url, prefix=prefix)
    try:
        yield broker
    finally:
        await broker.close()
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            for name in {*broker.names.values(), *broker.queues}:
                await channel.queue_delete(name)


async def _close_all(nodes: list[RabbitNode]) -> None:
    await asyncio.gather(*(node.close() for node in nodes), return_exceptions=True)
