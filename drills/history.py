"""The checker of the network and failover drills: the upstream's own log of calls (each with
its arrival time, Idempotency-Key and what the fake answered) against the ledger's final
state, not Sweeper's view of itself. It fails the drill on the first invariant broken and
returns the figures it counted.

Invariants:
- every registered item was called, and ended `succeeded` or `dead` or is still retrying
  with a reason;
- no object was called under two keys, and none succeeded under two;
- every `succeeded` item was answered 2xx by the upstream for a call with its own key;
- no object was called three times (twice: a lease that expired or an answer lost);
- no second at the upstream held more than rate + burst calls.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from drills.base import Facts, check
from drills.stage import Stage, worst_window
from drills.upstream import Call


async def judge(stage: Stage, calls: list[Call], keys: list[str], *, rate: float,
                burst: int) -> Facts:
    """Judge the drill's history (`keys`: the operation keys it registered)."""
    items = await stage.fetch("SELECT object_id, operation_key, status, last_error FROM items")
    unfinished = [r["object_id"] for r in items if r["status"] not in ("succeeded", "dead")
                  and not (r["status"] == "pending" and r["last_error"])]
    check(not unfinished, f"{len(unfinished)} items neither finished nor retrying with a "
                          f"reason, e.g. {unfinished[:3]}")
    keys_of: dict[str, set[str | None]] = defaultdict(set)
    answered_ok: set[str | None] = set()
    for call in calls:
        keys_of[call.path.rsplit("/", 1)[1]].add(call.idempotency_key)
        if call.outcome == "ok":
            answered_ok.add(call.idempotency_key)
    two_keys = [o for o, keys in keys_of.items() if len(keys) > 1]
    check(not two_keys, f"objects called under two keys: {two_keys[:3]}")
    unconfirmed = [r["object_id"] for r in items
                   if r["status"] == "succeeded" and r["operation_key"] not in answered_ok]
    check(not unconfirmed, f"{len(unconfirmed)} items succeeded without a 2xx for their own "
                           f"key, e.g. {unconfirmed[:3]}")
    per_key = Counter(call.idempotency_key for call in calls)
    never = set(keys) - set(per_key)
    check(not never, f"{len(never)} registered items never called")
    thrice = [k for k, n in per_key.items() if n > 2]
    check(not thrice, f"{len(thrice)} objects called three times or more")
    worst = worst_window([call.wall_time for call in calls])
    check(worst <= rate + burst, f"{worst} calls in one second at the upstream (rate {rate}, "
                                 f"burst {burst})")
    return {"calls": len(calls), "called_twice": sum(1 for n in per_key.values() if n == 2),
            "worst_second": worst, "limit": rate + burst,
            "statuses": dict(Counter(r["status"] for r in items))}
