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
    dead_reason_label,
)
from service.outcomes import UNKNOWN_POLICY_VERSION

log = logging.getLogger("service.worker")


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
