"""The budget's rules, pure: what a policy's budget is in tokens, what a grant of tokens
promises and when each may be spent, how late a token may still go, how a closure is timed
and how free worker slots are shared between scopes.

No I/O and no clock of its own, like `service.outcomes`: the buckets' statements
(`service.budget.buckets`), what an answer does to its scope (`answer_effects`) and the
worker pool apply these rules. Everything here is on the database's clock (bucket times are
its `clock_timestamp()`, never a worker's). The measurements behind the rules are in
bench/reports/design-notes.md ("The budget").
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Final

from service.config.policies import Policy
from service.config.policy_file import PolicyConfig

MAX_JITTER_S: Final = 1.0
JITTER_SHARE: Final = 0.1  # of the delay, bounded by MAX_JITTER_S

LOOKAHEAD_S: Final = 0.1  # how far ahead a worker may reserve tokens (covers a round trip)

# A token spent later than its due moment by more than this (or one refill interval, if
# longer) would crowd the tokens after it at the upstream: the worker returns its lease
# unstarted instead, and the token is dropped (its refill, granted again, would crowd them
# all the same).
LATE_TOLERANCE_MIN_S: Final = 0.02


def late_tolerance(rate: float) -> float:
    """How late after its due moment a worker may still spend a token of a `rate` bucket."""
    return max(LATE_TOLERANCE_MIN_S, 1.0 / rate)


@dataclass(frozen=True)
class Grant:
    """Tokens granted for a scope. The i-th token (from 0) is due `due_in(i)` seconds after
    the grant; tokens are reserved at most LOOKAHEAD_S ahead, so a worker that holds them
    never waits longer than that. `wait_seconds` is when to ask again if none was granted."""

    scope: str
    granted: int
    wait_seconds: float
    available: float = 0.0  # tokens in the bucket at the grant (may be below zero: lent)
    rate: float = 1.0
    granted_at: float = 0.0  # the database's clock at the grant, Unix seconds
    per_call: int = 1  # items one token's call carries (a batch policy's max_objects)
    # The database's clock when the claim had leased its items (None: not known).
    claimed_at: float | None = None

    @property
    def schedule_start(self) -> float:
        """Where the tokens' schedule starts on the database's clock. For calls of one item,
        the grant's moment: a claim that answers late makes them late, and they go back
        rather than bunch. For calls of many items, the claim's end: locking a store
        target's rows for a call may take longer than its tokens may be late, and counted
        as lateness it would send every claim's leases back unspent (design-notes.md,
        "The budget")."""
        if self.per_call > 1 and self.claimed_at is not None:
            return self.claimed_at
        return self.granted_at

    def due_in(self, i: int) -> float:
        """Seconds from the grant until token i may be spent."""
        return max(0.0, (i + 1 - self.available) / self.rate)


Budget = tuple[float, int, int]  # calls per second, burst in calls, objects per call


def budget_of(policy: Policy) -> Budget:
    """A scope's budget as its policy states it: (calls per second, burst in calls, objects
    per call). A budget in points is counted in calls of the requested cost: the bucket,
    the claim and GET /v1/scopes stay in calls, and an answer's actual cost refunds the
    fraction of a call it did not spend (answer_effects). A batch policy's token is one call
    of up to `max_objects` items. A budget in rows (a store target's) is counted in calls of
    `max_objects` rows, and a statement of fewer rows refunds the rest likewise."""
    rate = policy.config.rate
    per_call = policy.per_call
    cost = call_cost(policy.config)
    if cost == 1.0:
        return (rate.per_second, rate.burst, per_call)
    return (rate.per_second / cost, max(1, int(rate.burst // cost)), per_call)


def call_cost(cfg: PolicyConfig) -> float:
    """What one token of the scope's bucket stands for in the policy's own unit: a call,
    the requested cost of one in points, or a statement's worth of rows."""
    if cfg.cost is not None:
        return cfg.cost.requested
    if cfg.rate.unit == "rows":
        return float(cfg.batch.max_objects) if cfg.batch is not None else 1.0
    return 1.0


@dataclass(frozen=True)
class Closure:
    """Close a scope: until `delay_seconds` from now, or (None) by its exponential backoff."""

    delay_seconds: float | None
    backoff_base_s: float
    backoff_max_s: float
    # what closed it (an outcome's reason), which GET /v1/scopes shows: not what the closure
    # does, so two closures that act alike are equal whatever their reasons
    reason: str | None = field(default=None, compare=False)


def jitter_for(delay: float | None, base: float, rng: random.Random) -> float:
    """Jitter added after the permitted moment (never before it): at most 10% of the
    delay and at most a second, so replicas do not all reopen at the same instant."""
    span = min(MAX_JITTER_S, JITTER_SHARE * (delay if delay is not None else base))
    return rng.uniform(0.0, max(0.0, span))


def fair_shares(scopes: list[tuple[str, int]], free: int) -> dict[str, int]:
    """Split `free` worker slots across scopes by weight, at least one each while slots
    last, so a scope with a million items cannot starve one with ten."""
    if free <= 0 or not scopes:
        return {}
    chosen = scopes[:free]
    total = sum(max(1, w) for _, w in chosen)
    shares = {name: max(1, free * max(1, w) // total) for name, w in chosen}
    spare = free - sum(shares.values())
    # the floor of one slot each can overshoot (free 3, weights 1, 1, 4): take the excess
    # from the largest shares, never below one; a shortfall goes round-robin
    while spare < 0:
        largest = max(shares, key=lambda name: shares[name])
        shares[largest] -= 1
        spare += 1
    i = 0
    while spare > 0:
        shares[chosen[i % len(chosen)][0]] += 1
        spare -= 1
        i += 1
    return shares
