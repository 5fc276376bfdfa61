"""A worker's admissions from what a broker delivered (broker mode): the pool's admission,
completion and wake-up ports over the messages in hand, each item still claimed, fenced and
completed in the ledger.

How an item moves: a message arrives (`_deliver`) and its items are sorted by one ledger
read (sorting.py): a ready item waits in hand for its scope's tokens; the pool's admission
round takes tokens and leases from among the items in hand only (claims.admit_delivered),
so the budget, closures, pauses and holds mean what they mean in database mode. An outcome
is committed in the ledger first; then the item is done with, or, still pending (a retry,
a confirmation read), handed to the broker to come back when it is due. A message is
settled (acked) only once every item it carried is done with: committed, or handed on.

What waits does not block what follows: an item not claimable now (leased elsewhere, not
due, held, its scope closed or paused) goes back to the broker deferred, and when every
message in hand waits on scopes without tokens, the one waiting longest is deferred too.
A message delivered for the last time it may be (the broker's limit) ends its items dead
in the ledger instead of calling them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from service.execution.ports import Broker, Delivery, DeliveryGone
from service.execution.sorting import Sorted, Standing
from service.ledger.claims import Admission, Lease
from service.ledger.completions import Completion
from service.observability.failures import InternalErrors
from service.observability.metrics import (
    BROKER_IN_HAND,
    BROKER_MESSAGES,
    BrokerEvent,
    Where,
)

log = logging.getLogger("service.execution")

CLOSED_RECHECK_S: Final = 5.0   # a closed or paused scope's items come back after this
HELD_RECHECK_S: Final = 300.0   # a held item's: a hold ends by release or expiry, unsignalled
STARVED_DEFER_S: Final = 2.0    # messages in hand all waiting on tokens this long: one goes
BACK_IN_HAND_S: Final = 1.0     # a pending item due sooner stays in hand
DEAD_REASON: Final = "broker_delivery_limit"


class DeliveredLedger(Protocol):
    """The ledger statements a worker in broker mode runs (service/worker/postgres.py)."""

    async def admit_delivered(self, wants: Mapping[str, int],
                              only: Sequence[tuple[int, str]]) -> Admission: ...

    async def sort_delivered(self, item_ids: Sequence[int]) -> dict[int, Sorted]: ...

    async def end_dead(self, item_ids: Sequence[int], reason: str) -> list[int]: ...

    async def complete(self, batch: Sequence[Completion]) -> list[int]: ...

    async def hand_back(self, leases: Sequence[Lease], tokens: Sequence[int] | None = None
                        ) -> None: ...

    async def database_time(self) -> float: ...


class Listens(Protocol):
    """The ledger's wake-ups (holds placed), as service/worker/postgres.Listener gives."""

    async def listen(self, wake: Callable[[], None],
                     held: Callable[[], None] | None = None) -> None: ...


@dataclass(eq=False)
class _InHand:
    """One delivery until settled: its items not yet done with, and those to hand back to
    the broker (by delay) when it is."""

    delivery: Delivery
    open: set[int]
    later: dict[float, set[int]] = field(default_factory=lambda: defaultdict(set))
    since: float = 0.0  # waiting on tokens since (the pool's monotonic clock)


class DeliveredWork:
    """The pool's AdmissionPort, CompletionPort and WakeupPort in broker mode."""

    def __init__(self, broker: Broker, ledger: DeliveredLedger, *, prefetch: int,
                 holds: Listens | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.broker, self.ledger, self.prefetch = broker, ledger, prefetch
        self._monotonic = monotonic
        self._inbox: list[Delivery] = []
        self._ready: dict[str, dict[int, _InHand]] = defaultdict(dict)  # by scope, by id
        self._weights: dict[str, int] = {}
        self._flight: dict[int, _InHand] = {}  # leased by this pool
        self._resort: dict[int, _InHand] = {}  # admitted nothing though granted: read again
        self._hands: set[_InHand] = set()
        self._per_call: dict[str, int] = {}
        self._rates: dict[str, float] = {}
        self._wake: Callable[[], None] = lambda: None
        self._holds = holds
        self._errors = InternalErrors(log)
        self.settled = 0  # messages settled since start

    # -- wake-ups: deliveries (and the ledger's hold signals) ---------------------------

    async def listen(self, wake: Callable[[], None],
                     held: Callable[[], None] | None = None) -> None:
        self._wake = wake
        tasks = [asyncio.create_task(self.broker.consume(self.prefetch, self._deliver))]
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

    # -- admission ---------------------------------------------------------------------

    async def database_time(self) -> float:
        return await self.ledger.database_time()

    async def eligible_scopes(self, cursor: str, limit: int) -> list[tuple[str, int]]:
        """The scopes of the items in hand, round-robin after `cursor` (messages that
        arrived since the last round sorted first)."""
        await self._sort_arrivals()
        await self._finish_settled()
        names = sorted(s for s, ids in self._ready.items() if ids)
        after = [s for s in names if s > cursor] + [s for s in names if s <= cursor]
        return [(s, self._weights.get(s, 1)) for s in after[:limit]]

    async def admit(self, wants: Mapping[str, int]) -> Admission:
        """Tokens and leases as claims.admit, from among the items in hand only."""
        only = [(i, scope) for scope, n in wants.items()
                for i in list(self._ready.get(scope, {}))[:n * self._per_call.get(scope, 1)]]
        admitted = await self.ledger.admit_delivered(wants, only)
        now = self._monotonic()
        for lease in admitted.leases:
            hand = self._ready[lease.scope].pop(lease.item_id, None)
            if hand is not None:
                self._flight[lease.item_id] = hand
        grants = {g.scope: g for g in admitted.grants}
        used = Counter(lease.scope for lease in admitted.leases)
        for scope in wants:
            grant, ready = grants.get(scope), self._ready.get(scope, {})
            if grant is None:  # closed or paused: its items come back later
                for item_id, hand in list(ready.items()):
                    self._later(hand, item_id, CLOSED_RECHECK_S, ready)
                continue
            self._per_call[scope], self._rates[scope] = grant.per_call, grant.rate
            if grant.granted == 0:
                continue  # waiting on tokens: in hand still (see _starved)
            for hand in ready.values():
                hand.since = now
            if used[scope] < grant.granted * grant.per_call:
                # granted but fewer leased than offered: those offered and not leased are
                # no longer ready (leased elsewhere, not due, held): read them again
                for item_id in [i for i, _ in only if i in ready]:
                    self._resort[item_id] = ready.pop(item_id)
        await self._starved(now)
        await self._finish_settled()
        return admitted

    async def _sort_arrivals(self) -> None:
        """Sort the items of the messages that arrived (and of those to read again): one
        ledger read for all. A message on its last allowed delivery ends its items dead.
        Nothing is taken into hand until the ledger answered: if it did not, every message
        waits for the next round as it was."""
        arrived, again = self._inbox, self._resort
        if not arrived and not again:
            return
        self._inbox, self._resort = [], {}
        try:
            hands, poison, fresh = self._unpack(arrived, again)
            for hand in poison:
                await self._end_poison(hand)
            standings = await self.ledger.sort_delivered(list(fresh)) if fresh else {}
        except BaseException:
            self._inbox[:0] = arrived
            self._resort.update(again)
            raise
        self._hands.update(hands)
        BROKER_IN_HAND.inc(len(hands))
        for item_id, hand in fresh.items():
            self._place(hand, item_id, standings.get(item_id))

    def _unpack(self, arrived: list[Delivery], again: dict[int, _InHand]
                ) -> tuple[list[_InHand], list[_InHand], dict[int, _InHand]]:
        """The arrived messages in hand, those of them on their last allowed delivery, and
        every item to sort (with its message); a copy of an item already in hand (the same
        message published twice) is done with at once."""
        held = {i for ready in self._ready.values() for i in ready} | set(self._flight)
        fresh: dict[int, _InHand] = dict(again)
        hands, poison = [], []
        for delivery in arrived:
            hand = _InHand(delivery, set(delivery.work.item_ids), since=self._monotonic())
            hands.append(hand)
            if delivery.delivered_before >= self.broker.delivery_limit - 1:
                poison.append(hand)
                continue
            for item_id in delivery.work.item_ids:
                if item_id in fresh or item_id in held:
                    hand.open.discard(item_id)
                else:
                    fresh[item_id] = hand
        return hands, poison, fresh

    def _place(self, hand: _InHand, item_id: int, standing: Sorted | None) -> None:
        """Put a sorted item where its standing says: in hand, deferred, or done."""
        if standing is None or standing.standing is Standing.DONE:
            hand.open.discard(item_id)
        elif standing.standing is Standing.READY:
            self._weights[standing.scope] = standing.weight
            self._ready[standing.scope][item_id] = hand
        elif standing.standing is Standing.HELD:
            self._later(hand, item_id, HELD_RECHECK_S)
        else:  # leased elsewhere, or not due yet: back when it may be claimable
            self._later(hand, item_id, max(standing.wait_s, 0.0))

    def _later(self, hand: _InHand, item_id: int, seconds: float,
               ready: dict[int, _InHand] | None = None) -> None:
        """Hand this item back to the broker, due in `seconds`, once its message settles."""
        if ready is not None:
            ready.pop(item_id, None)
        hand.open.discard(item_id)
        hand.later[seconds].add(item_id)

    async def _end_poison(self, hand: _InHand) -> None:
        """A message on its last allowed delivery: its items end dead in the ledger (those
        a running lease holds come back after it), never called again."""
        work = hand.delivery.work
        leased = await self.ledger.end_dead(work.item_ids, DEAD_REASON)
        log.warning("broker: a message on its last allowed delivery; its items end dead",
                    extra={"origin": work.origin, "items": len(work.item_ids) - len(leased)})
        BROKER_MESSAGES.labels(BrokerEvent.DEAD).inc()
        hand.open.clear()
        if leased:
            hand.later[HELD_RECHECK_S / 10].update(leased)

    async def _starved(self, now: float) -> None:
        """With as many messages in hand as may be, none settling and every one waiting on
        tokens since STARVED_DEFER_S or longer, defer the one waiting longest: a scope
        without tokens never keeps the other scopes' messages from arriving."""
        if len(self._hands) < self.prefetch:
            return
        waiting = [h for h in self._hands if h.open and not any(
            i in self._flight for i in h.open) and now - h.since >= STARVED_DEFER_S]
        if len(waiting) < len(self._hands):
            return
        hand = min(waiting, key=lambda h: h.since)
        for item_id in list(hand.open):
            scope = next((s for s, ready in self._ready.items() if item_id in ready), None)
            if scope is None:
                continue
            ahead = len(self._ready[scope])  # this scope's items in hand, at its rate
            self._later(hand, item_id, ahead / max(self._rates.get(scope, 1.0), 0.001),
                        self._ready[scope])

    async def _finish_settled(self) -> None:
        """Settle each message whose items are all done with, after handing the broker
        those that come back later (confirmed). A message whose channel closed is the
        broker's again (it delivers it anew, and the ledger fences what it finds); any
        other failure keeps it in hand, to be tried again next round."""
        for hand in [h for h in self._hands if not h.open]:
            try:
                for seconds in sorted(hand.later):
                    ids = hand.later.pop(seconds)
                    await self.broker.defer([hand.delivery.work.part(sorted(ids))], seconds)
                    BROKER_MESSAGES.labels(BrokerEvent.DEFERRED).inc()
                await hand.delivery.settle()
                BROKER_MESSAGES.labels(BrokerEvent.SETTLED).inc()
                self.settled += 1
            except DeliveryGone:
                pass  # redelivered elsewhere; its deferred parts went out already
            except Exception as exc:
                log.warning("broker: a message could not be settled yet; tried again",
                            extra={"origin": hand.delivery.work.origin,
                                   "error_type": type(exc).__name__})
                continue
            self._hands.discard(hand)
            BROKER_IN_HAND.dec()

    # -- completion ----------------------------------------------------------------------

    async def complete(self, batch: Sequence[Completion]) -> list[int]:
        """Commit the outcomes (fenced), then do with each item what its outcome says."""
        fenced = await self.ledger.complete(batch)
        refused = set(fenced)
        for done in batch:
            item_id = done.lease.item_id
            hand = self._flight.pop(item_id, None)
            if hand is None:
                continue
            if item_id in refused or done.status != "pending":
                hand.open.discard(item_id)  # finished, or another lease has it
            elif done.retry_in_seconds <= BACK_IN_HAND_S:
                hand.since = self._monotonic()
                self._ready[done.lease.scope][item_id] = hand  # due at once: kept in hand
            else:
                self._later(hand, item_id, done.retry_in_seconds)
        try:
            await self._finish_settled()
        except Exception as exc:  # the outcomes are committed: never report them unwritten
            self._errors.caught(Where.DELIVERIES, exc)
        return fenced

    async def hand_back(self, leases: Sequence[Lease], tokens: Sequence[int] | None = None
                        ) -> None:
        """Return unstarted leases (and tokens) to the ledger; their items stay in hand."""
        await self.ledger.hand_back(leases, tokens)
        for lease in leases:
            hand = self._flight.pop(lease.item_id, None)
            if hand is not None:
                self._ready[lease.scope][lease.item_id] = hand
