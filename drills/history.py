"""The checker of the network and failover drills: the upstream's own log of calls (each with
its arrival time, Idempotency-Key and what the fake answered) against the ledger's final
state, not Sweeper's view of itself. It fails the drill on the first invariant broken and
returns the figures it counted.

Invariants:
- every registered item was called, and ended `succeeded` or `dead` or is still retrying
  with a reason;
- no object was called under two keys, and none succeeded under two;
- every `succeeded` item was answered 2xx by the upstream for a call with its own key;
- no object was called three times, and twice only with a reason: the first call was
  answered with something other than a 2xx, or its answer was lost on the way (the ledger
  holds an `unknown` attempt for it), or the second came after the first call's lease could
  have expired (`lease_s` later, less the token's lookahead and a margin: SLACK_S), or a
  failover came between them (what recorded the first may have gone with the primary);
- no second at the upstream held more than rate + burst calls.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from drills.base import Facts, check
from drills.stage import Stage, worst_window
from drills.upstream import Call

SLACK_S = 1.0  # a call starts within this of its claim (the lookahead and a late token)


async def judge(stage: Stage, calls: list[Call], keys: list[str], *, rate: float,
                burst: int, lease_s: float, failover_at: float | None = None) -> Facts:
    """Judge the drill's history (`keys`: the operation keys it registered)."""
    items = await stage.fetch("SELECT object_id, operation_key, status, last_error FROM items")
    lost = {r["operation_key"] for r in await stage.fetch(
        "SELECT DISTINCT i.operation_key FROM attempts a JOIN items i ON i.id = a.item_id "
        "WHERE a.outcome = 'unknown'")}
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
    twice = _second_calls(calls, lost, lease_s, failover_at)
    check(not twice["unexplained"], f"{len(twice['unexplained'])} objects called again "
          f"within {lease_s - SLACK_S:.1f} s of a 2xx whose answer was not lost, e.g. "
          f"{twice['unexplained'][:3]}")
    worst = worst_window([call.wall_time for call in calls])
    check(worst <= rate + burst, f"{worst} calls in one second at the upstream (rate {rate}, "
                                 f"burst {burst})")
    return {"calls": len(calls), "called_twice": sum(1 for n in per_key.values() if n == 2),
            "again_after_error": len(twice["after_error"]),
            "again_answer_lost": len(twice["answer_lost"]),
            "again_after_lease": len(twice["after_lease"]),
            **({"again_across_failover": len(twice["across_failover"])}
               if failover_at is not None else {}),
            "worst_second": worst, "limit": rate + burst,
            "statuses": dict(Counter(r["status"] for r in items))}


def _second_calls(calls: list[Call], lost: set[str], lease_s: float,
                  failover_at: float | None) -> dict[str, list[str | None]]:
    """Each call of a key after its first, by its reason: the call before it answered
    other than 2xx, or its answer was lost (`lost`: keys with an unknown attempt), or the
    lease could have expired between them, or a failover came between them; or none."""
    out: dict[str, list[str | None]] = {
        "after_error": [], "answer_lost": [], "after_lease": [], "across_failover": [],
        "unexplained": []}
    last: dict[str | None, Call] = {}
    for call in sorted(calls, key=lambda c: c.wall_time):
        before = last.get(call.idempotency_key)
        last[call.idempotency_key] = call
        if before is None:
            continue
        if before.outcome != "ok":
            reason = "after_error"
        elif call.idempotency_key in lost:
            reason = "answer_lost"
        elif call.wall_time - before.wall_time >= lease_s - SLACK_S:
            reason = "after_lease"
        elif failover_at is not None and before.wall_time < failover_at <= call.wall_time:
            reason = "across_failover"
        else:
            reason = "unexplained"
        out[reason].append(call.idempotency_key)
    return out
