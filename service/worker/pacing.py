"""How fast one pool starts calls: the calls allowed in flight, the scopes it serves, the
scopes it holds back on its own, and where the database's schedule falls on its clock.

Plain state with no I/O; the pool passes in the moments (its clock's monotonic seconds).
"""

from __future__ import annotations

from collections import Counter
from typing import Final

from service.claims import Admission

# When calls start so late that their tokens go back (this event loop is congested: many
# answers to process, or too little CPU), the calls allowed in flight are halved, at most
# once per round, and grow back by one per round without a late start, so a congested pool
# stops claiming leases it cannot start on time.
MIN_CALLS_IN_FLIGHT: Final = 8
# How long the scopes found with work may be served again without asking which scopes have
# work (one round trip a round saved): a scope that gains work meanwhile waits this long.
ELIGIBLE_REUSE_S: Final = 0.1


class CallLimit:
    """The calls allowed in flight: `concurrency`, halved after a round with a late start."""

    def __init__(self, concurrency: int) -> None:
        self.ceiling = concurrency
        self.limit = concurrency
        self.round = 0
        self._late_round = 0  # the latest round whose call started too late
        self._slowed_round = 0  # the round at which the limit was last halved

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


class ScopeCache:
    """The scopes with work found by an earlier round, reused while every one of them still
    has work and none can have been missed for long."""

    def __init__(self) -> None:
        self._scopes: list[tuple[str, int]] = []
        self._at = 0.0

    def known(self, free: int, now: float) -> list[tuple[str, int]] | None:
        """The cached scopes, or None when they must be read again."""
        if not self._scopes or len(self._scopes) >= free or now - self._at > ELIGIBLE_REUSE_S:
            return None
        return self._scopes

    def found(self, scopes: list[tuple[str, int]], free: int, now: float) -> None:
        # every scope with work fits in this round: the list can serve the next rounds too
        # (each scope keeps its fair share) until a scope runs dry
        self._scopes = list(scopes) if len(scopes) < free else []
        self._at = now

    def admitted(self, admission: Admission) -> None:
        if not self._scopes:
            return
        used = Counter(lease.scope for lease in admission.leases)
        grants = {g.scope: g for g in admission.grants}
        # a scope that is closed or paused (no grant row) or had fewer items than its
        # tokens' calls carry is read again with the others; one that only lacked tokens
        # still has work
        if any(scope not in grants or used[scope] < grants[scope].granted
               * grants[scope].per_call for scope, _ in self._scopes):
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
