"""A worker's admissions from a broker's deliveries (service/execution/deliveries.py), on
an in-memory ledger and broker: what it does with each item's standing, and that a message
is never lost from its books when the ledger or the broker fails mid-way."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from service.budget.rules import Grant
from service.execution.deliveries import (
    CLOSED_RECHECK_S,
    HELD_RECHECK_S,
    LEDGER_LOST_S,
    DeliveredWork,
)
from service.execution.in_hand import STARVED_DEFER_S
from service.execution.ports import Delivery, DeliveryGone
from service.execution.sorting import Sorted, Standing
from service.execution.work import Work
from service.ledger.claims import Admission, Lease
from service.ledger.completions import Completion

NOW = datetime(2026, 12, 5, tzinfo=UTC)


@dataclass(eq=False)
class Message:
    work: Work
    delivered_before: int = 0
    settled: bool = False
    gone: bool = False
    fail_settles: int = 0

    @property
    def live(self) -> bool:
        return not self.gone

    async def settle(self) -> None:
        if self.gone:
            raise DeliveryGone(self.work.origin)
        if self.fail_settles:
            self.fail_settles -= 1
            raise ConnectionError("broker busy")
        self.settled = True


@dataclass
class Broker:
    deferred: list[tuple[Work, float]] = field(default_factory=list)
    published: list[Work] = field(default_factory=list)
    delivery_limit: int = 11
    fail_defers: int = 0
    region: str | None = None

    def routed(self, region: str | None) -> Broker:
        raise AssertionError("a worker publishes to its own region's queues only")

    def delay_for(self, seconds: float) -> float:
        return seconds

    async def publish(self, works: Sequence[Work]) -> None:
        self.published += works

    async def defer(self, works: Sequence[Work], seconds: float) -> None:
        if self.fail_defers:
            self.fail_defers -= 1
            raise ConnectionError("broker busy")
        self.deferred += [(w, seconds) for w in works]

    async def consume(self, prefetch: int, deliver: Callable[[Delivery], None]) -> None: ...

    async def consume_dead(self, deliver: Callable[[Delivery], None]) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Ledger:
    """Items by id: (scope, standing, wait); grants per scope (None: closed)."""

    items: dict[int, tuple[str, Standing, float]]
    tokens: dict[str, int | None] = field(default_factory=dict)
    down: bool = False
    completed: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    fence: set[int] = field(default_factory=set)  # completions refused (lease not theirs)
    rerouted: list[int] = field(default_factory=list)

    async def sort_delivered(self, item_ids: Sequence[int]) -> dict[int, Sorted]:
        if self.down:
            raise OSError("database unavailable")
        return {i: Sorted(i, self.items[i][0], 1, self.items[i][1], self.items[i][2])
                for i in item_ids if i in self.items}

    async def admit_delivered(self, wants: Mapping[str, int],
                              only: Sequence[tuple[int, str]]) -> Admission:
        grants, leases = [], []
        for scope, n in wants.items():
            granted = self.tokens.get(scope, n)
            if granted is None:
                continue
            granted = min(granted, n)
            grants.append(Grant(scope, granted, 0.5, rate=10.0))
            ready = [i for i, s in only if s == scope and self.items[i][1] is Standing.READY]
            leases += [_lease(i, scope) for i in ready[:granted]]
        return Admission(grants, leases)

    async def end_dead(self, item_ids: Sequence[int], reason: str) -> list[int]:
        self.dead += item_ids
        return []

    async def reroute(self, item_ids: Sequence[int]) -> None:
        if self.down:
            raise OSError("database unavailable")
        self.rerouted += item_ids

    async def complete(self, batch: Sequence[Completion]) -> list[int]:
        self.completed += [c.lease.item_id for c in batch]
        return [c.lease.item_id for c in batch if c.lease.item_id in self.fence]

    async def hand_back(self, leases: Sequence[Lease], tokens: Sequence[int] | None = None
                        ) -> None: ...

    async def database_time(self) -> float:
        return 0.0


def _lease(item_id: int, scope: str) -> Lease:
    return Lease(item_id, "t", f"o{item_id}", "p", 1, f"k{item_id}", scope, uuid.uuid4(), 1,
                 NOW)


def _done(lease: Lease, status: str = "succeeded", retry_in: float = 0.0) -> Completion:
    return Completion(lease, "w", "x", status, "r", 204, None, retry_in, False, NOW, NOW, 1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _work(ledger: Ledger, broker: Broker, prefetch: int = 8) -> tuple[DeliveredWork, Clock]:
    clock = Clock()
    return DeliveredWork(broker, ledger, prefetch=prefetch, monotonic=clock), clock


async def test_a_message_is_settled_once_its_items_are_committed() -> None:
    ledger = Ledger({1: ("s", Standing.READY, 0), 2: ("s", Standing.READY, 0)})
    work, _ = _work(ledger, Broker())
    message = Message(Work.of("batch:1", [1, 2]))
    work._deliver(message)
    assert await work.eligible_scopes("", 10) == [("s", 1)]
    admitted = await work.admit({"s": 2})
    assert [x.item_id for x in admitted.leases] == [1, 2]
    await work.complete([_done(admitted.leases[0])])
    await work.settle_pending()
    assert not message.settled  # item 2 is still in flight
    await work.complete([_done(admitted.leases[1])])
    await work.settle_pending()
    assert message.settled and work.settled == 1 and not work.books.hands


async def test_the_ledger_down_while_messages_arrive_loses_none() -> None:
    ledger = Ledger({1: ("s", Standing.READY, 0)}, down=True)
    work, _ = _work(ledger, Broker())
    message = Message(Work.of("batch:1", [1]))
    work._deliver(message)
    with pytest.raises(OSError, match="database unavailable"):
        await work.eligible_scopes("", 10)
    ledger.down = False
    assert await work.eligible_scopes("", 10) == [("s", 1)]
    [lease] = (await work.admit({"s": 1})).leases
    await work.complete([_done(lease)])
    await work.settle_pending()
    assert message.settled


async def test_items_not_claimable_now_go_back_to_the_broker_when_due() -> None:
    ledger = Ledger({1: ("s", Standing.LEASED, 4.0), 2: ("s", Standing.HELD, 0),
                     3: ("s", Standing.DONE, 0), 4: ("s", Standing.LATER, 12.0)})
    broker = Broker()
    work, _ = _work(ledger, broker)
    message = Message(Work.of("batch:1", [1, 2, 3, 4, 99]))  # 99: pruned
    work._deliver(message)
    assert await work.eligible_scopes("", 10) == []
    await work.settle_pending()
    assert message.settled
    assert sorted((w.item_ids, s) for w, s in broker.deferred) == [
        ((1,), 4.0), ((2,), HELD_RECHECK_S), ((4,), 12.0)]


async def test_another_regions_items_go_to_the_relay_and_are_never_admitted() -> None:
    ledger = Ledger({1: ("s", Standing.ELSEWHERE, 0), 2: ("s", Standing.READY, 0)})
    work, _ = _work(ledger, Broker(region="us"))
    message = Message(Work.of("batch:1", [1, 2]))
    work._deliver(message)
    ledger.down = True  # the reroute not written: the message stays as it came, unsorted
    with pytest.raises(OSError, match="database unavailable"):
        await work.eligible_scopes("", 10)
    assert not ledger.rerouted and not work.books.hands
    ledger.down = False
    assert await work.eligible_scopes("", 10) == [("s", 1)]
    assert ledger.rerouted == [1]
    admitted = await work.admit({"s": 2})
    assert [x.item_id for x in admitted.leases] == [2]  # item 1 is not in hand
    await work.complete([_done(admitted.leases[0])])
    await work.settle_pending()
    assert message.settled


async def test_a_closed_scope_goes_back_and_the_other_goes_on() -> None:
    ledger = Ledger({1: ("closed", Standing.READY, 0), 2: ("open", Standing.READY, 0)},
                    tokens={"closed": None})
    broker = Broker()
    work, _ = _work(ledger, broker)
    message = Message(Work.of("batch:1", [1, 2]))
    work._deliver(message)
    assert {s for s, _ in await work.eligible_scopes("", 10)} == {"closed", "open"}
    admitted = await work.admit({"closed": 1, "open": 1})
    assert [x.item_id for x in admitted.leases] == [2]
    assert await work.eligible_scopes("", 10) == []  # the closed scope's item is not in hand
    await work.complete([_done(admitted.leases[0])])
    await work.settle_pending()
    # handed back when its message settles, to come back after the recheck
    assert message.settled
    assert broker.deferred == [(Work("batch:1", (1,)), CLOSED_RECHECK_S)]


async def test_a_retry_comes_back_later_and_a_confirmation_stays_in_hand() -> None:
    ledger = Ledger({1: ("s", Standing.READY, 0), 2: ("s", Standing.READY, 0)})
    broker = Broker()
    work, _ = _work(ledger, broker)
    message = Message(Work.of("batch:1", [1, 2]))
    work._deliver(message)
    await work.eligible_scopes("", 10)
    first, second = (await work.admit({"s": 2})).leases
    await work.complete([_done(first, "pending", retry_in=30.0),
                         _done(second, "pending", retry_in=0.0)])
    await work.settle_pending()
    assert not message.settled  # item 2 is in hand again, for its confirmation read
    [again] = (await work.admit({"s": 1})).leases
    assert again.item_id == 2
    await work.complete([_done(again)])
    await work.settle_pending()
    assert message.settled and broker.deferred == [(Work("batch:1", (1,)), 30.0)]


async def test_a_copy_of_an_item_held_by_a_live_delivery_is_done_with_at_once() -> None:
    ledger = Ledger({1: ("s", Standing.READY, 0)})
    work, _ = _work(ledger, Broker())
    first, copy = Message(Work.of("batch:1", [1])), Message(Work.of("batch:1", [1]))
    work._deliver(first)
    work._deliver(copy)
    await work.eligible_scopes("", 10)
    await work.settle_pending()
    assert copy.settled and not first.settled


async def test_a_copy_takes_over_from_a_delivery_whose_channel_closed() -> None:
    """The broker gave the message again after the first delivery's channel closed: the
    copy now holds the items (the first can never be acked), and settles when they are
    done, including the one in flight across the change."""
    ledger = Ledger({1: ("s", Standing.READY, 0), 2: ("s", Standing.READY, 0)})
    work, _ = _work(ledger, Broker())
    first = Message(Work.of("batch:1", [1, 2]))
    work._deliver(first)
    await work.eligible_scopes("", 10)
    [in_flight] = (await work.admit({"s": 1})).leases
    first.gone = True
    copy = Message(Work.of("batch:1", [1, 2]), delivered_before=1)
    work._deliver(copy)
    await work.eligible_scopes("", 10)
    [other] = (await work.admit({"s": 1})).leases
    await work.complete([_done(in_flight), _done(other)])
    await work.settle_pending()
    assert copy.settled and not work.books.hands


async def test_a_message_on_its_last_delivery_ends_its_items_dead() -> None:
    ledger = Ledger({1: ("s", Standing.READY, 0)})
    work, _ = _work(ledger, Broker())
    message = Message(Work.of("batch:1", [1]), delivered_before=10)
    work._deliver(message)
    assert await work.eligible_scopes("", 10) == []
    await work.settle_pending()
    assert ledger.dead == [1] and message.settled


async def test_a_failed_settle_is_tried_again_and_a_gone_delivery_dropped() -> None:
    ledger = Ledger({1: ("s", Standing.DONE, 0), 2: ("s", Standing.DONE, 0)})
    work, _ = _work(ledger, Broker())
    busy = Message(Work.of("batch:1", [1]), fail_settles=1)
    gone = Message(Work.of("batch:2", [2]), gone=True)
    work._deliver(busy)
    work._deliver(gone)
    await work.eligible_scopes("", 10)
    await work.settle_pending()
    assert not busy.settled and len(work.books.hands) == 1  # the gone one is the broker's
    await work.settle_pending()
    assert busy.settled and not work.books.hands


async def test_a_failed_deferral_is_sent_next_time_before_the_message_is_settled() -> None:
    ledger = Ledger({1: ("s", Standing.LATER, 12.0)})
    broker = Broker(fail_defers=1)
    work, _ = _work(ledger, broker)
    message = Message(Work.of("batch:1", [1]))
    work._deliver(message)
    await work.eligible_scopes("", 10)
    await work.settle_pending()
    assert not message.settled and broker.deferred == []
    await work.settle_pending()
    assert message.settled and broker.deferred == [(Work("batch:1", (1,)), 12.0)]


async def test_a_refused_outcome_is_read_again_not_dropped() -> None:
    """complete() tried again after a commit whose answer was lost: the ledger refuses the
    copy of a retry's outcome. The item is read again, found not yet due, and handed back
    to come when it is, never dropped."""
    ledger = Ledger({1: ("s", Standing.READY, 0)})
    broker = Broker()
    work, _ = _work(ledger, broker)
    message = Message(Work.of("batch:1", [1]))
    work._deliver(message)
    await work.eligible_scopes("", 10)
    [lease] = (await work.admit({"s": 1})).leases
    ledger.fence, ledger.items[1] = {1}, ("s", Standing.LATER, 30.0)
    await work.complete([_done(lease, "pending", retry_in=30.0)])
    await work.eligible_scopes("", 10)
    await work.settle_pending()
    assert message.settled and broker.deferred == [(Work("batch:1", (1,)), 30.0)]


async def test_with_every_slot_taken_a_starved_scope_makes_room() -> None:
    """Every message in hand waits on a scope without tokens: after STARVED_DEFER_S the
    newest goes back, so the next message can arrive."""
    ledger = Ledger({i: ("slow", Standing.READY, 0) for i in (1, 2)}, tokens={"slow": 0})
    broker = Broker()
    work, clock = _work(ledger, broker, prefetch=2)
    older, newer = Message(Work.of("batch:1", [1])), Message(Work.of("batch:2", [2]))
    work._deliver(older)
    await work.eligible_scopes("", 10)
    clock.now += 1
    work._deliver(newer)
    await work.eligible_scopes("", 10)
    await work.admit({"slow": 1})
    await work.settle_pending()
    assert broker.deferred == [] and not newer.settled  # not starved long enough yet
    clock.now += STARVED_DEFER_S
    await work.admit({"slow": 1})
    await work.settle_pending()
    assert newer.settled and not older.settled
    assert [w for w, _ in broker.deferred] == [Work("batch:2", (2,))]


async def test_with_every_slot_taken_a_slow_scope_keeps_one_message() -> None:
    """A scope that gets tokens, slowly (10/s), holding both slots with 100 items each
    (20 s of calls): the newest message goes back, due when the rest would be done."""
    ledger = Ledger({i: ("slow", Standing.READY, 0) for i in range(1, 201)},
                    tokens={"slow": 1})
    broker = Broker()
    work, _ = _work(ledger, broker, prefetch=2)
    older = Message(Work.of("batch:1", range(1, 101)))
    newer = Message(Work.of("batch:2", range(101, 201)))
    work._deliver(older)
    work._deliver(newer)
    await work.eligible_scopes("", 10)
    await work.admit({"slow": 1})
    await work.settle_pending()
    assert newer.settled and not older.settled
    [(back, seconds)] = broker.deferred
    assert back == Work.of("batch:2", range(101, 201)) and seconds == pytest.approx(19.9)


async def test_the_ledger_out_of_reach_hands_the_messages_back_once() -> None:
    ledger = Ledger({1: ("s", Standing.READY, 0)})
    broker = Broker()
    work, clock = _work(ledger, broker)
    message = Message(Work.of("batch:1", [1]))
    work._deliver(message)
    await work.eligible_scopes("", 10)
    ledger.admit_delivered = _down  # type: ignore[method-assign]

    async def failing_round() -> None:
        with pytest.raises(OSError, match="database unavailable"):
            await work.admit({"s": 1})
        await work.mind_the_ledger()

    await failing_round()
    assert not message.settled
    clock.now += LEDGER_LOST_S
    await failing_round()
    assert message.settled and broker.published == [Work("batch:1", (1,))]
    assert not work.books.hands
    again = Message(Work.of("batch:1", [1]))
    work._deliver(again)
    clock.now += LEDGER_LOST_S
    await failing_round()
    assert not again.settled  # once per outage: what arrives since stays


async def test_a_ledger_call_hanging_on_a_silent_link_hands_the_messages_back() -> None:
    """A link blackholed without a reset: the admission neither answers nor fails. After
    LEDGER_LOST_S the messages go back all the same."""
    ledger = Ledger({1: ("s", Standing.READY, 0)})
    broker = Broker()
    work, clock = _work(ledger, broker)
    message = Message(Work.of("batch:1", [1]))
    work._deliver(message)
    await work.eligible_scopes("", 10)
    silent = asyncio.Event()

    async def hanging(*_: object) -> Admission:
        await silent.wait()
        raise OSError("database unavailable")

    ledger.admit_delivered = hanging  # type: ignore[method-assign]
    stuck = asyncio.create_task(work.admit({"s": 1}))
    while not work._in_ledger:  # until the admission is under way
        await asyncio.sleep(0)
    await work.mind_the_ledger()
    assert not message.settled
    clock.now += LEDGER_LOST_S
    await work.mind_the_ledger()
    assert message.settled and broker.published == [Work("batch:1", (1,))]
    silent.set()
    with pytest.raises(OSError, match="database unavailable"):
        await stuck


async def _down(*_: object) -> Admission:
    raise OSError("database unavailable")


async def test_the_pool_stopping_hands_every_message_back_whole() -> None:
    ledger = Ledger({1: ("s", Standing.READY, 0), 2: ("s", Standing.LATER, 60.0)})
    broker = Broker()
    work, _ = _work(ledger, broker)
    message, unread = Message(Work.of("batch:1", [1, 2])), Message(Work.of("batch:2", [3]))
    work._deliver(message)
    await work.eligible_scopes("", 10)
    work._deliver(unread)  # arrived after the last round
    await work.hand_over()
    assert message.settled and unread.settled
    assert sorted(broker.published, key=lambda w: w.origin) == [
        Work("batch:1", (1,)), Work("batch:2", (3,))]
    assert broker.deferred == [(Work("batch:1", (2,)), 60.0)]
