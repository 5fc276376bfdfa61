"""A process's tally of what it committed (service/history/tally.py), counted per minute,
policy, scope and batch as the ledger records it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from service.history.tally import Tally
from service.ledger.claims import Lease
from service.ledger.completions import Completion
from service.outcomes import UNKNOWN_POLICY_VERSION

T0 = datetime(2026, 12, 5, 10, 0, 59, 900_000, tzinfo=UTC)  # a tenth before a minute's end


def done(item: int, outcome: str, status: str, *, after_s: float = 0.0, scope: str = "s:a",
         batch: int | None = 7, reason: str = "http") -> Completion:
    lease = Lease(item, "t", f"o{item}", "carts", 1, "k" * 64, scope, uuid.uuid4(), 1, T0,
                  batch_id=batch)
    moment = T0 + timedelta(seconds=after_s)
    return Completion(lease=lease, worker="w", outcome=outcome, status=status, reason=reason,
                      http_status=None, retry_after_seconds=None, retry_in_seconds=0.0,
                      refund_attempt=False, started_at=moment, finished_at=moment,
                      latency_ms=1.0)


def test_completions_are_counted_in_their_own_minute_policy_scope_and_batch() -> None:
    tally = Tally()
    tally.completed([
        done(1, "succeeded", "succeeded"),
        done(2, "succeeded", "succeeded", after_s=0.2),  # the next minute
        done(3, "throttled", "pending", scope="s:b"),
        done(4, "permanent", "dead", batch=None),  # a webhook released it: no batch
        done(5, "succeeded", "succeeded"),  # fenced: called, its outcome not written
        done(6, "permanent", "dead", reason=UNKNOWN_POLICY_VERSION),  # never called
    ], fenced={5})
    m0, m1 = T0.replace(second=0, microsecond=0), T0.replace(second=0, microsecond=0) + \
        timedelta(minutes=1)
    assert tally.policies[m0, "carts"] == {"succeeded": 1, "throttled": 1, "permanent": 2,
                                           "dead": 2, "fenced": 1}
    assert tally.policies[m1, "carts"] == {"succeeded": 1}
    assert tally.scopes[m0, "s:a", "carts"] == {"calls": 3, "succeeded": 1}
    assert tally.scopes[m0, "s:b", "carts"] == {"calls": 1, "throttled": 1}
    assert tally.batches == {(m0, 7): {"succeeded": 1, "dead": 1}, (m1, 7): {"succeeded": 1}}
    taken = tally.take()
    assert not tally and taken
    tally.merge(taken)
    tally.merge(taken)
    assert tally.policies[m1, "carts"] == {"succeeded": 2}
