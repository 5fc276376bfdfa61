"""What one process saw happen, per minute, until its next write of the ledger's minutes
(service/history/minutes.py): outcomes committed, calls made, closures, expired leases taken
over, items of each batch finished. Pure: no I/O, no clock of its own (a count's minute is
its completion's finish, or the moment the caller gives).

Counted after the fact they describe is committed (a flush's outcomes, a claim's leases), so
the minutes never show what the ledger does not hold; a process that dies loses at most what
it had not written yet (WRITE_EVERY_S of counts), which the charts may miss."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final, TypeVar

from service.ledger.claims import Lease
from service.ledger.completions import Completion
from service.outcomes import UNKNOWN_POLICY_VERSION

WRITE_EVERY_S: Final = 10.0  # between a process's writes of its counts
_MINUTE: Final = timedelta(minutes=1)

# the outcome classes policy_minutes counts in columns of their names (migration 0026)
OUTCOMES: Final = ("succeeded", "throttled", "transient", "unknown", "permanent",
                   "unauthorized", "skipped")
FINISHED: Final = ("succeeded", "dead", "skipped")  # a batch's items, by final status

PolicyKey = tuple[datetime, str]  # minute, policy
ScopeKey = tuple[datetime, str, str]  # minute, scope, policy
BatchKey = tuple[datetime, int]  # minute, batch
Key = TypeVar("Key", PolicyKey, ScopeKey, BatchKey)


def minute_of(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


@dataclass
class Tally:
    """Counts waiting to be added to the ledger's minutes."""

    policies: dict[PolicyKey, Counter[str]] = field(default_factory=dict)
    scopes: dict[ScopeKey, Counter[str]] = field(default_factory=dict)
    batches: dict[BatchKey, Counter[str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.policies or self.scopes or self.batches)

    def completed(self, batch: Iterable[Completion], fenced: set[int]) -> None:
        """A flush's outcomes, committed; `fenced`: the items whose lease was no longer
        ours (their calls were made, their outcomes not written). Grouped first, then
        counted once per group: a flush's completions share a few minutes and scopes."""
        groups: Counter[tuple[datetime, str, str, int | None, str, str, bool, bool]] = Counter()
        start = end = None  # the minute of the last completion seen, and its end
        for c in batch:
            moment, lease = c.finished_at, c.lease
            if start is None or end is None or not start <= moment < end:
                start = minute_of(moment)
                end = start + _MINUTE
            groups[start, lease.policy, lease.scope, lease.batch_id, c.outcome, c.status,
                   lease.item_id in fenced, c.reason != UNKNOWN_POLICY_VERSION] += 1
        for (minute, policy, scope, batch_id, outcome, status, was_fenced, called), n \
                in groups.items():
            by_policy = self._policy(minute, policy)
            by_scope = self._scope(minute, scope, policy)
            if called:  # a completion for an unknown policy version was never called
                by_scope["calls"] += n
            if was_fenced:
                by_policy["fenced"] += n
                continue
            by_policy[outcome] += n
            if outcome in ("succeeded", "throttled"):
                by_scope[outcome] += n
            if status == "dead":
                by_policy["dead"] += n
            if status in FINISHED and batch_id is not None:
                self._batch(minute, batch_id)[status] += n

    def claimed(self, leases: Iterable[Lease], at: datetime) -> None:
        """A claim's leases, committed at `at`: those that took over an expired lease."""
        minute = minute_of(at)
        for lease in leases:
            if lease.reclaimed:
                self._policy(minute, lease.policy)["reclaimed"] += 1
                self._scope(minute, lease.scope, lease.policy)["reclaimed"] += 1

    def closed(self, policy: str, scope: str, at: datetime) -> None:
        """An answer of `policy`'s closed `scope` (a 429 or an outage's backoff)."""
        minute = minute_of(at)
        self._policy(minute, policy)["closures"] += 1
        self._scope(minute, scope, policy)["closures"] += 1

    def take(self) -> Tally:
        """Everything counted so far; this tally starts again empty."""
        taken = Tally(self.policies, self.scopes, self.batches)
        self.policies, self.scopes, self.batches = {}, {}, {}
        return taken

    def merge(self, other: Tally) -> None:
        """Add `other`'s counts back (a write that failed: tried again later)."""
        _add(self.policies, other.policies)
        _add(self.scopes, other.scopes)
        _add(self.batches, other.batches)

    def _policy(self, minute: datetime, policy: str) -> Counter[str]:
        return self.policies.setdefault((minute, policy), Counter())

    def _scope(self, minute: datetime, scope: str, policy: str) -> Counter[str]:
        return self.scopes.setdefault((minute, scope, policy), Counter())

    def _batch(self, minute: datetime, batch_id: int) -> Counter[str]:
        return self.batches.setdefault((minute, batch_id), Counter())


def _add(mine: dict[Key, Counter[str]], theirs: dict[Key, Counter[str]]) -> None:
    for key, counts in theirs.items():
        mine.setdefault(key, Counter()).update(counts)
