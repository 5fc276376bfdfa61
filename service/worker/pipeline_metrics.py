"""The worker pipeline's Prometheus series, counted per batch.

Each admission round, each hand-back of unstarted leases and each flush updates the
counters once per label set (Counter.inc(n)), not once per item; the upstream-duration
histogram alone is observed per call, each call having its own duration. Labels come from
closed sets only: policy names, outcome classes, reasons.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Final

from prometheus_client import Histogram

from service.ledger.claims import Lease
from service.ledger.completions import Completion
from service.observability.metrics import (
    COMPLETIONS,
    ITEMS_CLAIMED,
    ITEMS_DEAD,
    LATE_COMPLETIONS,
    LEASES_RECLAIMED,
    LEASES_RETURNED,
    TOKENS_RETURNED,
    UPSTREAM_DURATION,
    LeaseReturn,
)
from service.outcomes import UNKNOWN_POLICY_VERSION, Failure

log = logging.getLogger("service.worker")


def dead_reason_label(reason: str) -> str:
    """A dead item's reason as a metric label from a closed set (the ledger keeps the
    exact reason): `max_attempts`, a transport failure, a known HTTP status, else its
    class (`http_4xx`)."""
    if reason.startswith("max_attempts:"):
        return "max_attempts"
    if reason in _FAILURE_REASONS:
        return reason
    status = reason.removeprefix("http_").removeprefix("absent_")
    if status.isdigit():
        return f"http_{status}" if int(status) in _LABELLED_STATUSES else f"http_{status[0]}xx"
    return "other"


_FAILURE_REASONS: Final = frozenset({*(f.value for f in Failure), UNKNOWN_POLICY_VERSION,
                                     "no_status"})
_LABELLED_STATUSES: Final = frozenset({400, 401, 403, 404, 405, 409, 410, 411, 413, 415,
                                       422, 500, 501, 502, 503, 504})


class PipelineCounts:
    """The per-batch updates of one worker pool's series."""

    def claimed(self, leases: Iterable[Lease]) -> int:
        """Count a round's leases; returns how many took over an expired lease."""
        claimed: Counter[str] = Counter()
        reclaimed: Counter[str] = Counter()
        for lease in leases:
            claimed[lease.policy] += 1
            if lease.reclaimed:
                reclaimed[lease.policy] += 1
        for policy, n in claimed.items():
            ITEMS_CLAIMED.labels(policy).inc(n)
        for policy, n in reclaimed.items():
            LEASES_RECLAIMED.labels(policy).inc(n)
        return sum(reclaimed.values())

    def returned(self, reasons: Mapping[LeaseReturn, int], tokens: int | None = None) -> None:
        """Count leases handed back unstarted by reason, and their tokens (one a lease,
        unless told: a batch's call holds one token for its many leases)."""
        for reason, n in reasons.items():
            LEASES_RETURNED.labels(reason).inc(n)
        TOKENS_RETURNED.inc(sum(reasons.values()) if tokens is None else tokens)

    def completed(self, batch: Iterable[Completion], fenced: set[int]) -> None:
        """Count a flushed batch: outcomes, dead items, fenced (late) completions, and the
        duration of every call made."""
        outcomes: Counter[tuple[str, str]] = Counter()
        dead: Counter[tuple[str, str]] = Counter()
        late: Counter[str] = Counter()
        durations: dict[tuple[str, str], Histogram] = {}  # a label set's child, looked up once
        for c in batch:
            policy = c.lease.policy
            if c.reason != UNKNOWN_POLICY_VERSION:  # that one was never called
                key = (policy, c.outcome)
                child = durations.get(key)
                if child is None:
                    child = durations[key] = UPSTREAM_DURATION.labels(*key)
                child.observe(c.latency_ms / 1000)
            if c.lease.item_id in fenced:
                late[policy] += 1
                log.warning("late completion fenced out", extra={"item_id": c.lease.item_id})
                continue
            outcomes[policy, c.outcome] += 1
            if c.status == "dead":
                dead[policy, dead_reason_label(c.reason)] += 1
        for labels, n in outcomes.items():
            COMPLETIONS.labels(*labels).inc(n)
        for labels, n in dead.items():
            ITEMS_DEAD.labels(*labels).inc(n)
        for policy, n in late.items():
            LATE_COMPLETIONS.labels(policy).inc(n)
