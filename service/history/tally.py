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
from datetime import datetime
from typing import Final, TypeVar

from service.ledger.claims import Lease
from service.ledger.completions import Completion
from service.outcomes import UNKNOWN_POLICY_VERSION

WRITE_EVERY_S: Final = 10.0  # between a process's writes of its counts

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
        ours (their calls were made, their outcomes not written)."""
        for c in batch:
            lease, minute = c.lease, minute_of(c.finished_at)
            by_policy = self._policy(minute, lease.policy)
            by_scope = self._scope(minute, lease.scope, lease.policy)
            if c.reason != UNKNOWN_POLICY_VERSION:  # that one was never called
                by_scope["calls"] += 1
            if lease.item_id in fenced:
                by_policy["fenced"] += 1
                continue
            by_policy[c.outcome] += 1
            if c.outcome in ("succeeded", "throttled"):
                by_scope[c.outcome] += 1
            if c.status == "dead":
                by_policy["dead"] += 1
            if c.status in FINISHED and lease.batch_id is not None:
                self._batch(minute, lease.batch_id)[c.status] += 1

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
