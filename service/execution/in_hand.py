"""The messages a worker holds unsettled, and where each of their items is: waiting for its
scope's tokens (`ready`), leased by this pool (`flight`), to be read again (`resort`), or
done with. Pure bookkeeping, no I/O: service/execution/deliveries.py does the talking.

Invariants: an item id is in at most one of ready, flight and resort, and belongs there to
one message, its holder; a message is settled only once nothing of it is open (every item
committed, or in `later` to be handed back to the broker first). A copy of an item held by a
message whose delivery is still live is done with at once (the ledger fences it anyway); one
held by a message whose channel closed is taken over by the copy, since the broker will
never take the old delivery's ack.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from service.execution.ports import Delivery

_arrivals = itertools.count()
STARVED_DEFER_S: Final = 2.0  # a scope without a token this long lets its messages go back
HOLD_AHEAD_S: Final = 5.0     # a scope keeps in hand this long of its calls, with messages full


@dataclass(eq=False)
class Hand:
    """One delivery until settled: its items not yet done with, and those to hand back to
    the broker (by delay) when it is."""

    delivery: Delivery
    open: set[int]
    arrived: float
    later: dict[float, set[int]] = field(default_factory=lambda: defaultdict(set))
    seq: int = field(default_factory=lambda: next(_arrivals))  # the order of arrival


class InHand:
    """The messages in hand and their items (see the module's invariants)."""

    def __init__(self) -> None:
        self.hands: set[Hand] = set()
        self.ready: dict[str, dict[int, Hand]] = defaultdict(dict)  # by scope, by id
        self.flight: dict[int, Hand] = {}
        self.resort: dict[int, Hand] = {}
        self.rates: dict[str, float] = {}
        self.starved_since: dict[str, float] = {}

    def held(self) -> dict[int, Hand]:
        """Every item in flight, to be read again or ready, with the message holding it."""
        held = {**self.flight, **self.resort}
        for ready in self.ready.values():
            held.update(ready)
        return held

    def unpack(self, delivery: Delivery, now: float, fresh: dict[int, Hand],
               held: dict[int, Hand]) -> Hand:
        """A new message in hand; its items to sort go into `fresh`. A copy of an item held
        (`held`, kept up to date here) by a live delivery is done with; one held by a gone
        delivery is taken over."""
        hand = Hand(delivery, set(delivery.work.item_ids), now)
        for item_id in delivery.work.item_ids:
            old = fresh.get(item_id) or held.get(item_id)
            if old is None:
                fresh[item_id] = hand
            elif old.delivery.live:
                hand.open.discard(item_id)
            else:
                old.open.discard(item_id)
                self._rehome(item_id, old, hand, fresh)
                held[item_id] = hand
        return hand

    def _rehome(self, item_id: int, old: Hand, new: Hand, fresh: dict[int, Hand]) -> None:
        for where in (self.flight, self.resort, fresh, *self.ready.values()):
            if where.get(item_id) is old:
                where[item_id] = new

    def later(self, hand: Hand, item_id: int, seconds: float) -> None:
        """Hand this item back to the broker, due in `seconds`, once its message settles."""
        for where in (self.resort, *self.ready.values()):
            if where.get(item_id) is hand:
                del where[item_id]
        hand.open.discard(item_id)
        hand.later[seconds].add(item_id)

    def settleable(self) -> list[Hand]:
        return [h for h in self.hands if not h.open]

    def drop(self, hand: Hand) -> None:
        """Forget a message (settled, or the broker's again) and any item it still holds."""
        self.hands.discard(hand)
        for where in (self.flight, self.resort, *self.ready.values()):
            for item_id in [i for i, h in where.items() if h is hand]:
                del where[item_id]

    def backlog_s(self, scope: str) -> float:
        """How long this scope's items in hand take at its rate (0 while unknown)."""
        rate = self.rates.get(scope)
        return len(self.ready.get(scope, ())) / rate if rate else 0.0

    def to_make_room(self, prefetch: int, now: float) -> Hand | None:
        """With `prefetch` messages in hand, the newest whose items all wait on a scope
        starved for STARVED_DEFER_S, or on one with more than HOLD_AHEAD_S of calls in hand
        and another message of it in hand: handing it back lets other scopes' messages
        arrive. None when there is room, or nothing waits so."""
        if len(self.hands) < prefetch:
            return None
        scope_of = {i: s for s, ready in self.ready.items() for i in ready}
        hands_of: Counter[str] = Counter(
            s for h in self.hands for s in {scope_of[i] for i in h.open if i in scope_of})
        for hand in sorted(self.hands, key=lambda h: h.seq, reverse=True):
            scopes = {scope_of.get(i) for i in hand.open}
            if not hand.open or None in scopes:
                continue  # something of it is in flight or being read again
            if all(self._waits_long(str(s), hands_of[str(s)], now) for s in scopes):
                return hand
        return None

    def _waits_long(self, scope: str, hands: int, now: float) -> bool:
        since = self.starved_since.get(scope)
        if since is not None and now - since >= STARVED_DEFER_S:
            return True
        return hands > 1 and self.backlog_s(scope) > HOLD_AHEAD_S

    def scope_of(self, ids: Iterable[int]) -> dict[int, str]:
        wanted = set(ids)
        return {i: s for s, ready in self.ready.items() for i in ready if i in wanted}
