"""The executor port on RabbitMQ (aio-pika): quorum queues, publisher confirms, manual acks.

Queues, per region (`sweeper.work`, or `sweeper.<region>.work`):
- `work`: what consumers take. A quorum queue (replicated, survives a node's loss) with a
  delivery limit: a message delivered more times than that is dead-lettered to `dead`,
  at least once (the source queue rejects publishes when full rather than dropping).
- `wait.<n>s`: deferred work. Each holds its messages n seconds (a queue TTL), then
  dead-letters them back to `work`, at least once. RabbitMQ 3.10 has no delayed delivery
  of its own; a few fixed delays keep each queue's messages in TTL order (a per-message
  TTL expires only at a queue's head).
- `dead`: messages past the delivery limit, which the relay ends in the ledger as dead
  (service/execution/relay.py): never only here.

A message's body is `Work` (work.py); its message id is the work's origin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from aio_pika.exceptions import (
    AMQPError,
    AuthenticationError,
    ChannelClosed,
    ChannelInvalidStateError,
    ProbableAuthenticationError,
)
from pamqp.commands import Basic

from service.execution.ports import Delivery, DeliveryGone
from service.execution.work import BadWork, Work

log = logging.getLogger("service.execution")

WAITS_S: Final = (1, 2, 5, 10, 30, 60, 300)  # the delays `defer` rounds up to (longer: 300)
# Redeliveries allowed after the first delivery: a message whose consumer died this many
# times with it is poison, and its items end dead in the ledger.
REDELIVERIES: Final = 10
CONNECT_TIMEOUT_S: Final = 10.0
RETRY_MIN_S: Final = 0.5  # between tries to start consuming, doubling to RETRY_MAX_S
RETRY_MAX_S: Final = 10.0
PUBLISH_TIMEOUT_S: Final = 30.0


def queue_names(region: str | None, prefix: str = "sweeper") -> dict[str, str]:
    """The queues of a region (None: the tenants pinned nowhere), by role; under `prefix`
    (a ledger's: tests and benchmarks use throw-away ones)."""
    prefix = prefix if region is None else f"{prefix}.{region}"
    return {"work": f"{prefix}.work", "dead": f"{prefix}.dead",
            **{f"wait.{s}": f"{prefix}.wait.{s}s" for s in WAITS_S}}


def wait_for(seconds: float) -> int:
    """The shortest fixed delay at least `seconds` long (the longest when none is)."""
    return next((s for s in WAITS_S if s >= seconds), WAITS_S[-1])


class RabbitDelivery:
    """A message delivered to this consumer (the `Delivery` of ports.py)."""

    def __init__(self, message: AbstractIncomingMessage, work: Work) -> None:
        self._message = message
        self._work = work

    @property
    def work(self) -> Work:
        return self._work

    @property
    def live(self) -> bool:
        try:
            return not self._message.channel.is_closed
        except ChannelInvalidStateError:  # aio-pika's way of saying it is closed
            return False

    @property
    def delivered_before(self) -> int:
        count = (self._message.headers or {}).get("x-delivery-count", 0)
        return count if isinstance(count, int) else 0

    async def settle(self) -> None:
        try:
            if self._message.channel.is_closed:  # raises too, once closed
                raise DeliveryGone(self._work.origin)
            await self._message.ack()
        except (ChannelInvalidStateError, ChannelClosed) as exc:
            raise DeliveryGone(self._work.origin) from exc


class _Link:
    """One connection to RabbitMQ and its publishing channel, shared by the region views
    of one RabbitBroker (`routed`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.connection: AbstractRobustConnection | None = None
        self.publishing: AbstractChannel | None = None
        self.declared: set[str | None] = set()  # regions whose queues `publishing` declared
        self.regions: set[str | None] = set()  # every region whose queues were declared
        self.consuming: list[AbstractChannel] = []  # closed by close(), not by a cancel
        self.lock = asyncio.Lock()


class RabbitBroker:
    """The `Broker` of ports.py on one RabbitMQ (a cluster's URL), for one region."""

    def __init__(self, url: str, *, region: str | None = None, prefix: str = "sweeper",
                 link: _Link | None = None) -> None:
        self._link = link or _Link(url)
        self._region, self._prefix = region, prefix
        self.names = queue_names(region, prefix)

    @property
    def region(self) -> str | None:
        return self._region

    def routed(self, region: str | None) -> RabbitBroker:
        if region == self._region:
            return self
        return RabbitBroker(self._link.url, region=region, prefix=self._prefix,
                            link=self._link)

    @property
    def delivery_limit(self) -> int:
        return REDELIVERIES + 1

    @property
    def queues(self) -> list[str]:
        """Every queue this broker (and its region views) declared, by name."""
        return [name for region in self._link.regions
                for name in queue_names(region, self._prefix).values()]

    async def _channel(self) -> AbstractChannel:
        """The publishing channel (confirms on), this region's queues declared on it."""
        link = self._link
        async with link.lock:
            if link.connection is None or link.connection.is_closed:
                link.connection = await aio_pika.connect_robust(
                    link.url, timeout=CONNECT_TIMEOUT_S,
                    client_properties={"connection_name": "sweeper"})
                link.publishing = None
            if link.publishing is None or link.publishing.is_closed:
                # a message no queue took is returned: raise, never count it confirmed
                link.publishing = await link.connection.channel(publisher_confirms=True,
                                                                on_return_raises=True)
                link.declared.clear()
            if self._region not in link.declared:
                await declare(link.publishing, self.names)
                link.declared.add(self._region)
                link.regions.add(self._region)
            return link.publishing

    def delay_for(self, seconds: float) -> float:
        return float(wait_for(seconds))

    async def publish(self, works: Sequence[Work]) -> None:
        await self._send(works, self.names["work"])

    async def defer(self, works: Sequence[Work], seconds: float) -> None:
        await self._send(works, self.names[f"wait.{wait_for(seconds)}"])

    async def _send(self, works: Sequence[Work], queue: str) -> None:
        """Publish each to `queue`, all in flight at once; returns when every one is
        confirmed, raises if any is refused (unroutable, nacked) or not confirmed in time."""
        if not works:
            return
        exchange = (await self._channel()).default_exchange
        answers = await asyncio.gather(*(exchange.publish(
            aio_pika.Message(w.encode(), message_id=w.origin, content_type="application/json",
                             delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=queue, mandatory=True, timeout=PUBLISH_TIMEOUT_S) for w in works))
        refused = [a for a in answers if not isinstance(a, Basic.Ack)]
        if refused:
            raise RuntimeError(f"the broker did not confirm {len(refused)} of {len(works)} "
                               f"messages to {queue}")

    async def consume(self, prefetch: int, deliver: Callable[[Delivery], None]) -> None:
        await self._consume(self.names["work"], prefetch, deliver)

    async def consume_dead(self, deliver: Callable[[Delivery], None]) -> None:
        """The dead-lettered messages, as `consume` delivers work (relay.py ends them)."""
        await self._consume(self.names["dead"], 16, deliver)

    async def _consume(self, queue_name: str, prefetch: int,
                       deliver: Callable[[Delivery], None]) -> None:
        """Consume until cancelled. A broker out of reach when consuming starts (the robust
        connection recovers only connections it once had) is tried again with backoff, a
        warning once per outage; refused credentials are an error each time they are."""
        backoff, outage = RETRY_MIN_S, ""
        while True:
            try:
                await self._consume_once(queue_name, prefetch, deliver)
            except asyncio.CancelledError:
                raise
            except (AuthenticationError, ProbableAuthenticationError) as exc:
                log.error("broker: credentials refused; consuming stops until they are "
                          "accepted", extra={"error_type": type(exc).__name__})
            except (AMQPError, OSError, TimeoutError) as exc:
                if outage != type(exc).__name__:
                    log.warning("broker: cannot consume; retrying",
                                extra={"error_type": type(exc).__name__, "queue": queue_name})
                outage = type(exc).__name__
            await asyncio.sleep(backoff)
            backoff = min(RETRY_MAX_S, backoff * 2)

    async def _consume_once(self, queue_name: str, prefetch: int,
                            deliver: Callable[[Delivery], None]) -> None:
        """Consume on a channel of its own. Cancelled, it stops the deliveries but leaves
        the channel open until `close()`, so what is in hand can still be settled (acks
        travel on the channel that delivered)."""
        await self._channel()
        assert self._link.connection is not None
        channel = await self._link.connection.channel()
        try:
            await channel.set_qos(prefetch_count=prefetch)
            queue = await channel.get_queue(queue_name, ensure=True)
            tag = await queue.consume(_receiver(deliver))
        except BaseException:
            await _closed(channel)
            raise
        try:
            await asyncio.Future()  # until cancelled; the robust channel consumes again
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await queue.cancel(tag)
            raise
        finally:
            self._link.consuming.append(channel)

    async def close(self) -> None:
        """Close the connection, with every region view's channels."""
        link = self._link
        for channel in link.consuming:
            await _closed(channel)
        link.consuming.clear()
        connection, link.connection = link.connection, None
        if connection is not None and not connection.is_closed:
            await connection.close()


async def _closed(channel: AbstractChannel) -> None:
    if not channel.is_closed:
        with contextlib.suppress(Exception):
            await channel.close()


def _receiver(deliver: Callable[[Delivery], None]
              ) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
    async def receive(message: AbstractIncomingMessage) -> None:
        try:
            work = Work.decode(message.body)
        except BadWork as exc:
            # not ours (we publish only Work): nothing in the ledger to end; dropped loudly
            log.error("broker: a message that is not work was dropped",
                      extra={"reason": str(exc), "message_id": message.message_id})
            await message.reject(requeue=False)
            return
        deliver(RabbitDelivery(message, work))
    return receive


async def declare(channel: AbstractChannel, names: dict[str, str]) -> dict[str, AbstractQueue]:
    """Declare a region's queues (idempotent; the same arguments every time, or RabbitMQ
    refuses the declaration)."""
    at_least_once: dict[str, Any] = {"x-queue-type": "quorum",
                                     "x-dead-letter-strategy": "at-least-once",
                                     "x-overflow": "reject-publish",
                                     "x-dead-letter-exchange": ""}
    queues = {"dead": await channel.declare_queue(
        names["dead"], durable=True, arguments={"x-queue-type": "quorum"})}
    queues["work"] = await channel.declare_queue(names["work"], durable=True, arguments={
        **at_least_once, "x-delivery-limit": REDELIVERIES,
        "x-dead-letter-routing-key": names["dead"]})
    for s in WAITS_S:
        queues[f"wait.{s}"] = await channel.declare_queue(
            names[f"wait.{s}"], durable=True, arguments={
                **at_least_once, "x-message-ttl": s * 1000,
                "x-dead-letter-routing-key": names["work"]})
    return queues
