"""The executor port: what Sweeper needs of a message broker to run its items there, so a
second broker (NATS JetStream, SQS) is one module implementing `Broker` and `Delivery`
beside rabbitmq.py, and nothing else changes.

The ledger stays the truth: a message only says "these items may be ready"; every claim is
the ledger's admission (tokens taken, items leased and fenced), and every outcome is
committed there before its message is settled. A broker must give at-least-once delivery
(redelivery of what was not settled when a consumer goes), confirmed publishing, delayed
delivery, and a count of a message's deliveries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from service.execution.work import Work


class DeliveryGone(Exception):
    """The delivery's channel closed before it was settled: the broker delivers the message
    again (to this consumer or another), so there is nothing left to settle."""


class Delivery(Protocol):
    """One delivery of a message to this consumer, until settled."""

    @property
    def work(self) -> Work: ...

    @property
    def live(self) -> bool:
        """Whether it can still be settled (its channel is open)."""
        ...

    @property
    def delivered_before(self) -> int:
        """How many times the broker delivered this message before (0: the first time)."""
        ...

    async def settle(self) -> None:
        """Done with it: the broker forgets the message (AMQP ack). Called only once its
        items' outcomes are committed, or the rest handed on by `Broker.defer`. Raises
        DeliveryGone when the delivery's channel closed meanwhile."""
        ...


class Broker(Protocol):
    """A broker's queues for one ledger and one region (service/config/regions.py): each
    region has queues of its own, and the tenants pinned nowhere theirs."""

    @property
    def region(self) -> str | None:
        """The region whose queues these are (None: the tenants pinned nowhere)."""
        ...

    def routed(self, region: str | None) -> Broker:
        """The same broker on `region`'s queues (the relay publishes to every region's),
        sharing this one's connection; closed with it."""
        ...

    @property
    def delivery_limit(self) -> int:
        """Deliveries of one message the broker allows; the last one ends its items in the
        ledger as dead (never only in a dead-letter queue)."""
        ...

    def delay_for(self, seconds: float) -> float:
        """The delay `defer` gives a wait of `seconds` (a broker may have fixed delays):
        items handed back together with one delay go as one message."""
        ...

    async def publish(self, works: Sequence[Work]) -> None:
        """Publish each, returning once the broker confirmed them all (raises otherwise)."""
        ...

    async def defer(self, works: Sequence[Work], seconds: float) -> None:
        """Publish each to come back to the consumers after about `seconds` (at least that,
        at most a few times that, up to the broker's longest delay: a longer wait comes
        back sooner and is deferred again), confirmed like `publish`."""
        ...

    async def consume(self, prefetch: int, deliver: Callable[[Delivery], None]) -> None:
        """Deliver messages to `deliver` (at most `prefetch` unsettled at once) until
        cancelled; consuming again after the connection is lost and regained."""
        ...

    async def consume_dead(self, deliver: Callable[[Delivery], None]) -> None:
        """Deliver, as `consume` does, the messages the broker gave up on (delivered
        `delivery_limit` times), for the ledger to end their items."""
        ...

    async def close(self) -> None:
        """Close the connection (unsettled deliveries go back to the broker)."""
        ...
