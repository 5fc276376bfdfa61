"""How fast one pool starts calls: the calls allowed in flight, the scopes it serves, the
scopes it holds back on its own, and where the database's schedule falls on its clock.

Plain state with no I/O; the pool passes in the moments (its clock's monotonic seconds).
What each rule buys, and where it stops paying: bench/reports/design-notes.md, "The worker
pool".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Final

from service.ledger.claims import Admission

# When calls start so late that their tokens go back (this event loop is congested: many
# answers to process, or too little CPU), the calls allowed in flight are halved, at most
# once per round, and grow back by one per round without a late start, so a congested pool
# stops claiming leases it cannot start on time.
MIN_CALLS_IN_FLIGHT: Final = 8
# How long the scopes found with work may be served again without asking which scopes have
# work (one round trip a round saved): a scope that gains work meanwhile waits this long.
ELIGIBLE_REUSE_S: Final = 0.1
# The weight of the latest claim in the running mean of calls that finish while a claim
# is answered (how far ahead of its free slots a pool claims).
FREED_WEIGHT: Final = 0.25


class CallLimit:
    """The calls allowed in flight: `concurrency`, halved after a round with a late start;
    and the leases a pool may hold, a few more than that."""

    def __init__(self, concurrency: int) -> None:
        self.ceiling = concurrency
        self.limit = concurrency
        self.round = 0
        self._late_round = 0  # the latest round whose call started too late
        self._slowed_round = 0  # the round at which the limit was last halved
        self._freed_per_claim = 0.0  # running mean: calls finished while a claim ran

    @property
    def claimable(self) -> int:
        """The calls a pool may hold claimed: those allowed in flight, plus twice as many as
        finish while one claim is answered (at most as many again). A round starts with
        one claim's worth waiting for slots, which take them while it claims the next
        claim's worth: a slot that frees finds its next call claimed instead of waiting a
        round trip for it."""
        return self.limit + min(self.limit, math.ceil(2 * self._freed_per_claim))

    def claim_answered(self, freed: int) -> None:
        """`freed` calls finished while the latest claim was answered."""
        self._freed_per_claim += FREED_WEIGHT * (freed - self._freed_per_claim)

    def next_round(self) -> int:
        """Start a round: adjust the limit; the round's number."""
        self.round += 1
        if self._late_round > self._slowed_round:
            self.limit = max(min(MIN_CALLS_IN_FLIGHT, self.ceiling), self.limit // 2)
            self._slowed_round = self.round
        elif self.limit < self.ceiling:
            self.limit += 1
        return self.round

    def started_late(self, round_no: int) -> None:
        self._late_round = max(self._late_round, round_no)
        # calls waiting for a slot are what starts late first: claim none ahead for now
        self._freed_per_claim = 0.0


class ScopeCache:
    """Every scope with work, as the latest answer that listed them all gave them, served
    in turn without asking the database again while each still has work and none can have
    been missed for long."""

    def __init__(self) -> None:
        self._scopes: list[tuple[str, int]] = []  # in the database's order, a cycle
        self._position: dict[str, int] = {}
        self._at = 0.0

    def known(self, cursor: str, now: float) -> list[tuple[str, int]] | None:
        """The scopes, the one after `cursor` first; None when they must be read again."""
        if not self._scopes or now - self._at > ELIGIBLE_REUSE_S:
            return None
        # the cursor is the last scope served; one not listed was served before this list
        # was read, which the database already began after
        after = self._position.get(cursor, -1) + 1
        return self._scopes[after:] + self._scopes[:after]

    def found(self, scopes: list[tuple[str, int]], asked: int, now: float) -> None:
        # fewer scopes than asked for: the answer lists every scope with work
        self._scopes = list(scopes) if len(scopes) < asked else []
        self._position = {name: i for i, (name, _) in enumerate(self._scopes)}
        self._at = now

    def admitted(self, admission: Admission, wanted: Iterable[str]) -> None:
        if not self._scopes:
            return
        used = Counter(lease.scope for lease in admission.leases)
        grants = {g.scope: g for g in admission.grants}
        # a scope asked for that is closed or paused (no grant row) or had fewer items than
        # its tokens' calls carry is read again with the others; one that only lacked tokens
        # still has work
        if any(scope not in grants or used[scope] < grants[scope].granted
               * grants[scope].per_call for scope in wanted):
            self._scopes = []


class LocalHolds:
    """Scopes this process heard throttled or refused itself, kept out of its rounds
    without waiting for the database round trip that tells every other replica."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def hold(self, scope: str, until: float) -> None:
        self._until[scope] = until

    def __contains__(self, scope: str) -> bool:
        return scope in self._until

    def without_held(self, scopes: list[tuple[str, int]], now: float
                     ) -> list[tuple[str, int]]:
        """`scopes` less those held at `now` (expired holds are dropped)."""
        if not self._until:
            return scopes
        self._until = {s: t for s, t in self._until.items() if t > now}
        return [(s, w) for s, w in scopes if s not in self._until]


class DatabaseClock:
    """Maps the database's clock onto this process's monotonic clock, so every replica
    spends its tokens on the database's schedule. The offset is the smallest seen of
    (local receipt - database time): one slow answer does not shift the schedule later,
    and the estimate is never early (it includes at least the fastest one-way delay)."""

    DRIFT_ALLOWANCE_S_PER_S: Final = 0.0001

    def __init__(self) -> None:
        self._offset: float | None = None
        self._at = 0.0

    def to_local(self, db_time: float) -> float:
        """The local monotonic moment of `db_time` on the offset known (no new sample); a
        moment far ahead of now before any sample (nothing calibrated yet)."""
        return db_time + (self._offset if self._offset is not None else 0.0)

    def local(self, db_time: float, received: float) -> float:
        """The local monotonic moment of `db_time`, given it was received at `received`."""
        sample = received - db_time
        if self._offset is None:
            self._offset = sample
        else:
            # let the estimate creep up slowly so clock drift cannot pin it too low
            aged = self._offset + (received - self._at) * self.DRIFT_ALLOWANCE_S_PER_S
            self._offset = min(aged, sample)
        self._at = received
        return db_time + self._offset
