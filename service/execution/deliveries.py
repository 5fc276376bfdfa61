"""A worker's admissions from what a broker delivered (broker mode): the pool's admission,
completion and wake-up ports over the messages in hand (in_hand.py keeps their books), each
item still claimed, fenced and completed in the ledger.

How an item moves: a message arrives (`_deliver`) and its items are sorted by one ledger
read (sorting.py): a ready item waits in hand for its scope's tokens; the pool's admission
round takes tokens and leases from among the items in hand only (claims.admit_delivered),
so the budget, closures, pauses and holds mean what they mean in database mode. An outcome
is committed in the ledger first; then the item is done with, or, still pending (a retry,
a confirmation read), handed to the broker to come back when it is due. A message is
settled (acked) only once every item it carried is done with: committed, or handed on.
Settling runs in a task of its own, so a slow broker never holds up the commit of outcomes.

What waits does not block what follows: an item not claimable now (leased elsewhere, not
due, held, its scope closed or paused) goes back to the broker deferred, and with every
message slot taken, the newest message waiting on a starved or slow scope goes back too.
A message delivered for the last time it may be (the broker's limit) ends its items dead
in the ledger instead of calling them. Messages are handed back whole, their delivery
counts reset (published anew, then acked), when the pool stops and when the ledger has
been out of reach for LEDGER_LOST_S: another worker may reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final, Protocol, TypeVar

from service.execution.in_hand import Hand, InHand
from service.execution.ports import Broker, Delivery, DeliveryGone
from service.execution.sorting import Sorted, Standing
from service.ledger.claims import Admission, Lease
from service.ledger.completions import Completion
from service.observability.failures import expected
from service.observability.metrics import BROKER_IN_HAND, BROKER_MESSAGES, BrokerEvent

log = logging.getLogger("service.execution")

CLOSED_RECHECK_S: Final = 30.0  # a closed or paused scope's items come back after this
HELD_RECHECK_S: Final = 300.0   # a held item's: a hold ends by release or expiry, unsignalled
BACK_IN_HAND_S: Final = 1.0     # a pending item due sooner stays in hand
LEDGER_LOST_S: Final = 5.0      # the ledger out of reach this long: the messages go back
WATCH_S: Final = 1.0            # the settler looks at least this often
DEAD_REASON: Final = "broker_delivery_limit"
T = TypeVar("T")


class DeliveredLedger(Protocol):
    """The ledger statements a worker in broker mode runs (service/worker/postgres.py)."""

    async def admit_delivered(self, wants: Mapping[str, int],
                              only: Sequence[tuple[int, str]]) -> Admission: ...

    async def sort_delivered(self, item_ids: Sequence[int]) -> dict[int, Sorted]: ...

    async def reroute(self, item_ids: Sequence[int]) -> None: ...

    async def end_dead(self, item_ids: Sequence[int], reason: str) -> list[int]: ...

    async def complete(self, batch: Sequence[Completion]) -> list[int]: ...

    async def hand_back(self, leases: Sequence[Lease], tokens: Sequence[int] | None = None
                        ) -> None: ...

    async def database_time(self) -> float: ...


class Listens(Protocol):
    """The ledger's wake-ups (holds placed), as service/worker/postgres.Listener gives."""

    async def listen(self, wake: Callable[[], None],
                     held: Callable[[], None] | None = None) -> None: ...


class DeliveredWork:
    """The pool's AdmissionPort, CompletionPort and WakeupPort in broker mode."""

    def __init__(self, broker: Broker, ledger: DeliveredLedger, *, prefetch: int,
                 holds: Listens | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.broker, self.ledger, self.prefetch = broker, ledger, prefetch
        self.books = InHand()
        self._monotonic = monotonic
        self._inbox: list[Delivery] = []
        self._weights: dict[str, int] = {}
        self._per_call: dict[str, int] = {}
        self._wake: Callable[[], None] = lambda: None
        self._holds = holds
        self._settling = asyncio.Lock()
        self._settle_wanted = asyncio.Event()
        self._last_ok = monotonic()  # the last ledger call answered (see _ledger)
        self._in_ledger = 0  # ledger calls in progress
        self._failing = False  # the last ledger call failed as an outage does
        self._given_back = False  # this outage's messages went back already
        self.settled = 0  # messages settled since start

    # -- wake-ups: deliveries (and the ledger's hold signals); settling ----------------

    async def listen(self, wake: Callable[[], None],
                     held: Callable[[], None] | None = None) -> None:
        self._wake = wake
        tasks = [asyncio.create_task(self.broker.consume(self.prefetch, self._deliver)),
                 asyncio.create_task(self._settler())]
        if self._holds is not None:
            tasks.append(asyncio.create_task(self._holds.listen(wake, held)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _deliver(self, delivery: Delivery) -> None:
        self._inbox.append(delivery)
        self._wake()

    async def _settler(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WATCH_S):
                    await self._settle_wanted.wait()
            self._settle_wanted.clear()
            await self.mind_the_ledger()
            await self.settle_pending()

    async def settle_pending(self) -> None:
        """Settle each message whose items are all done with, after handing the broker
        those that come back later (confirmed, each delay's part once). A message whose
        channel closed is the broker's again; any other failure keeps it for next time."""
        async with self._settling:
            for hand in self.books.settleable():
                try:
                    await self._defer_later(hand)
                    await hand.delivery.settle()
                    BROKER_MESSAGES.labels(BrokerEvent.SETTLED).inc()
                    self.settled += 1
                except DeliveryGone:
                    pass  # delivered anew; its deferred parts went out already
                except Exception as exc:
                    log.warning("broker: a message could not be settled yet; tried again",
                                extra={"origin": hand.delivery.work.origin,
                                       "error_type": type(exc).__name__})
                    continue
                self.books.drop(hand)
                BROKER_IN_HAND.dec()

    async def _defer_later(self, hand: Hand) -> None:
        for seconds in sorted(hand.later):
            ids = hand.later[seconds]
            await self.broker.defer([hand.delivery.work.part(ids)], seconds)
            del hand.later[seconds]  # only once confirmed: a failure sends it next time
            BROKER_MESSAGES.labels(BrokerEvent.DEFERRED).inc()

    async def hand_over(self) -> None:
        """Give every message in hand back to the broker: its open items published anew
        (their delivery count starts again), the rest deferred as due, then acked. At the
        pool's stop, and once per outage of the ledger. A failure leaves the message to
        the broker's redelivery."""
        async with self._settling:
            for delivery in self._inbox:
                self._adopt(Hand(delivery, set(delivery.work.item_ids), self._monotonic()))
            self._inbox = []
            for hand in list(self.books.hands):
                with contextlib.suppress(Exception):
                    if hand.open:
                        await self.broker.publish([hand.delivery.work.part(hand.open)])
                    await self._defer_later(hand)
                    with contextlib.suppress(DeliveryGone):
                        await hand.delivery.settle()
                self.books.drop(hand)
                BROKER_IN_HAND.dec()

    def _adopt(self, hand: Hand) -> None:
        self.books.hands.add(hand)
        BROKER_IN_HAND.inc()

    async def _ledger(self, call: Awaitable[T]) -> T:
        """A ledger call, timed for `mind_the_ledger`: the ledger counts as out of reach
        from the start of a call (or failure) after the last success."""
        if not self._in_ledger and not self._failing:
            self._last_ok = self._monotonic()
        self._in_ledger += 1
        try:
            result = await call
        except Exception as exc:
            self._failing = self._failing or expected(exc)
            raise
        finally:
            self._in_ledger -= 1
        self._last_ok, self._failing, self._given_back = self._monotonic(), False, False
        return result

    async def mind_the_ledger(self) -> None:
        """With the ledger out of reach for LEDGER_LOST_S (calls failing, or one hanging on
        a link gone silent), give the messages in hand back to the broker, once per outage:
        a worker that reaches the ledger takes them (it waits out this worker's leases)."""
        lost = (self._in_ledger or self._failing) and not self._given_back \
            and self._monotonic() - self._last_ok >= LEDGER_LOST_S
        if lost:
            self._given_back = True
            log.warning("broker: the ledger is out of reach; messages in hand go back to "
                        "the broker", extra={"messages": len(self.books.hands)})
            await self.hand_over()

    # -- admission ---------------------------------------------------------------------

    async def database_time(self) -> float:
        return await self.ledger.database_time()

    async def eligible_scopes(self, cursor: str, limit: int) -> list[tuple[str, int]]:
        """The scopes of the items in hand, round-robin after `cursor` (messages that
        arrived since the last round sorted first)."""
        await self._sort_arrivals()
        self._settle_wanted.set()
        names = sorted(s for s, ids in self.books.ready.items() if ids)
        after = [s for s in names if s > cursor] + [s for s in names if s <= cursor]
        return [(s, self._weights.get(s, 1)) for s in after[:limit]]

    async def admit(self, wants: Mapping[str, int]) -> Admission:
        """Tokens and leases as claims.admit, from among the items in hand only."""
        ready = self.books.ready
        only = [(i, scope) for scope, n in wants.items()
                for i in list(ready.get(scope, {}))[:n * self._per_call.get(scope, 1)]]
        admitted = await self._ledger(self.ledger.admit_delivered(wants, only))
        now = self._monotonic()
        for lease in admitted.leases:
            hand = ready[lease.scope].pop(lease.item_id, None)
            if hand is not None:
                self.books.flight[lease.item_id] = hand
        grants = {g.scope: g for g in admitted.grants}
        used = Counter(lease.scope for lease in admitted.leases)
        for scope in wants:
            grant, waiting = grants.get(scope), ready.get(scope, {})
            if grant is None:  # closed or paused: its items come back later
                for item_id, hand in list(waiting.items()):
                    self._later(hand, item_id, CLOSED_RECHECK_S)
                continue
            self._per_call[scope], self.books.rates[scope] = grant.per_call, grant.rate
            if grant.granted == 0:
                self.books.starved_since.setdefault(scope, now)
                continue
            self.books.starved_since.pop(scope, None)
            if used[scope] < grant.granted * grant.per_call:
                # granted but fewer leased than offered: those offered and not leased are
                # no longer ready (leased elsewhere, not due, held): read them again
                for item_id in [i for i, _ in only if i in waiting]:
                    self.books.resort[item_id] = waiting.pop(item_id)
        self._make_room(now)
        self._settle_wanted.set()
        return admitted

    def _make_room(self, now: float) -> None:
        hand = self.books.to_make_room(self.prefetch, now)
        if hand is None:
            return
        scope_of = self.books.scope_of(hand.open)
        due = {s: max(1.0, self.books.backlog_s(s)) for s in set(scope_of.values())}
        for item_id in list(hand.open):  # due when the scope's calls in hand would be done
            self._later(hand, item_id, due[scope_of[item_id]])

    def _later(self, hand: Hand, item_id: int, seconds: float) -> None:
        self.books.later(hand, item_id, self.broker.delay_for(seconds))

    async def _sort_arrivals(self) -> None:
        """Sort the items of the messages that arrived (and of those to read again): one
        ledger read for all. Nothing is taken into hand until the ledger answered: if it
        did not, every message waits for the next round as it was. A message on its last
        allowed delivery ends its items dead instead."""
        arrived = list(self._inbox)  # deliveries keep arriving during the reads below
        if not arrived and not self.books.resort:
            return
        last = self.broker.delivery_limit - 1
        poison = {n for n, d in enumerate(arrived) if d.delivered_before >= last}
        ids = {i for n, d in enumerate(arrived) if n not in poison for i in d.work.item_ids}
        ids |= set(self.books.resort)
        leased = {n: await self._ledger(self.ledger.end_dead(arrived[n].work.item_ids,
                                                             DEAD_REASON)) for n in poison}
        standings = await self._ledger(self.ledger.sort_delivered(sorted(ids)))
        # another region's (re-pinned since published): the relay takes them to its queues
        elsewhere = [i for i, s in standings.items() if s.standing is Standing.ELSEWHERE]
        if elsewhere:
            await self._ledger(self.ledger.reroute(elsewhere))
            BROKER_MESSAGES.labels(BrokerEvent.REROUTED).inc()
        self._inbox = self._inbox[len(arrived):]
        now = self._monotonic()
        fresh = dict(self.books.resort)
        self.books.resort.clear()
        held = self.books.held()
        for n, delivery in enumerate(arrived):
            hand = self.books.unpack(delivery, now, {} if n in poison else fresh, held)
            self._adopt(hand)
            if n in poison:
                self._end_poison(hand, leased[n])
        for item_id, hand in fresh.items():
            if item_id in hand.open:
                self._place(hand, item_id, standings.get(item_id))

    def _place(self, hand: Hand, item_id: int, standing: Sorted | None) -> None:
        """Put a sorted item where its standing says: in hand, deferred, or done."""
        if standing is None or standing.standing in (Standing.DONE, Standing.ELSEWHERE):
            hand.open.discard(item_id)
        elif standing.standing is Standing.READY:
            self._weights[standing.scope] = standing.weight
            self.books.ready[standing.scope][item_id] = hand
        elif standing.standing is Standing.HELD:
            self._later(hand, item_id, HELD_RECHECK_S)
        else:  # leased elsewhere, or not due yet: back when it may be claimable
            self._later(hand, item_id, max(standing.wait_s, 0.0))

    def _end_poison(self, hand: Hand, leased: list[int]) -> None:
        """Its items ended dead in the ledger (those a running lease holds come back after
        it): none of them is called again."""
        work = hand.delivery.work
        log.warning("broker: a message on its last allowed delivery; its items end dead",
                    extra={"origin": work.origin, "items": len(work.item_ids) - len(leased)})
        BROKER_MESSAGES.labels(BrokerEvent.DEAD).inc()
        hand.open.clear()
        if leased:
            hand.later[self.broker.delay_for(HELD_RECHECK_S / 10)].update(leased)

    # -- completion ----------------------------------------------------------------------

    async def complete(self, batch: Sequence[Completion]) -> list[int]:
        """Commit the outcomes (fenced), then do with each item what its outcome says; a
        refused one is read again (its outcome may have been committed by an earlier try
        of this batch whose answer was lost: the ledger says where it stands)."""
        fenced = await self._ledger(self.ledger.complete(batch))
        refused = set(fenced)
        for done in batch:
            item_id = done.lease.item_id
            hand = self.books.flight.pop(item_id, None)
            if hand is None:
                continue
            if item_id in refused:
                self.books.resort[item_id] = hand
            elif done.status != "pending":
                hand.open.discard(item_id)
            elif done.retry_in_seconds <= BACK_IN_HAND_S:
                self.books.ready[done.lease.scope][item_id] = hand  # due at once: kept
            else:
                self._later(hand, item_id, done.retry_in_seconds)
        self._settle_wanted.set()
        return fenced

    async def hand_back(self, leases: Sequence[Lease], tokens: Sequence[int] | None = None
                        ) -> None:
        """Return unstarted leases (and tokens) to the ledger; their items stay in hand."""
        await self._ledger(self.ledger.hand_back(leases, tokens))
        for lease in leases:
            hand = self.books.flight.pop(lease.item_id, None)
            if hand is not None:
                self.books.ready[lease.scope][lease.item_id] = hand
