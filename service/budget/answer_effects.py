"""What one upstream answer does to its scope (the rate budget shared by every replica).

Pure, like `outcomes`: no I/O and no clock of its own. The worker applies what this returns.

    answer                          scope effect
    429 / 503 with a date           closed until that date (at most retry_after_max_seconds),
                                    held locally for at most LOCAL_HOLD_S
    429 without a usable date       closed by the scope's own backoff (its level grows),
                                    held locally for at most LOCAL_HOLD_S
    401 / 403                       paused as `unauthorized`, held locally for LOCAL_HOLD_S
    the tenant has no credential    paused as `no-credential`, held locally likewise
    a store target unreachable or   paused as `store-unreachable` or
    refusing its role               `store-permission-denied`, held locally likewise
    a store target's guard over     closed for the guard's backoff, like a 429 with a date
    its threshold
    2xx after this process backed   the scope's backoff level is reset
    off the scope
    RateLimit fields: quota spent   closed until the quota resets (any status)
    RateLimit fields: units left    a budget in calls: the bucket lowered to what is left
    a cost budget's answer          the unspent part of the requested cost refunded (all
                                    of it when throttled without an actual cost); the
                                    points left lower the bucket (in calls of that cost)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from service.budget.rules import Closure, call_cost
from service.config.answer_rules import Costs
from service.config.policy_file import PolicyConfig
from service.observability.metrics import ScopeSignal
from service.outcomes import Answer, Classified, Failure, Outcome, exhausted_for, remaining_for

# How long a scope this process saw throttled (without a date) or refused is held locally
# until the database closure or pause, which every replica obeys, is certainly in place.
LOCAL_HOLD_S: Final = 1.0
# A scope's pause reasons set by answers (an operator's pause carries the operator's reason).
UNAUTHORIZED: Final = "unauthorized"
NO_CREDENTIAL: Final = "no-credential"
PAUSE_REASONS: Final[Mapping[Failure | None, str]] = {Failure.NO_CREDENTIAL: NO_CREDENTIAL,
                        Failure.STORE_UNREACHABLE: "store-unreachable",
                        Failure.STORE_PERMISSION: "store-permission-denied"}


@dataclass(frozen=True)
class ScopeEffects:
    """The effects of one answer on its scope. `closure` is None when the scope stays
    open; `hold_seconds` is how long this process keeps it out of its own rounds."""

    signals: tuple[ScopeSignal, ...] = ()
    closure: Closure | None = None
    pause: str | None = None  # the pause's reason
    hold_seconds: float | None = None
    backs_off: bool = False  # closed by its own backoff: a later success must reset it
    succeeded: bool = False
    refund: float = 0.0  # calls' worth of tokens back to the bucket (negative: taken)
    cap: float | None = None  # the bucket holds at most this many calls' worth now


NO_EFFECT: Final = ScopeEffects()
SUCCESS: Final = ScopeEffects(succeeded=True)


def effects_of(verdict: Classified, answer: Answer, cfg: PolicyConfig, now: datetime,
               costs: Costs | None = None) -> ScopeEffects:
    """The scope effects of `answer` (classified as `verdict`), `now` being the moment it
    arrived (RateLimit reset fields may name an HTTP date); `costs` what its body said of
    a cost budget."""
    if verdict.outcome is Outcome.SUCCEEDED and not answer.rate_limits and costs is None:
        return SUCCESS  # the bulk of answers: nothing to compute
    refund, cap = _budget(verdict, answer, cfg, costs, now)
    signals: list[ScopeSignal] = []
    closure: Closure | None = None
    pause: str | None = None
    backs_off = False
    hold: float | None = None
    base, max_s = cfg.backoff.base_seconds, cfg.backoff.max_seconds
    if verdict.outcome is Outcome.THROTTLED:
        delay = verdict.retry_after_seconds
        if delay is not None:
            delay = min(delay, cfg.retry_after_max_seconds)
        signals.append(ScopeSignal.THROTTLED)
        closure = Closure(delay, base, max_s, verdict.reason)
        backs_off = delay is None
        # held only until the database closure is in place: that closure is what every
        # replica obeys, and what an operator's `lift_closure` ends for all of them
        hold = min(LOCAL_HOLD_S, delay if delay is not None else base)
    elif verdict.outcome is Outcome.UNAUTHORIZED:
        signals.append(ScopeSignal.UNAUTHORIZED)
        pause = PAUSE_REASONS.get(answer.failure, UNAUTHORIZED)
        hold = LOCAL_HOLD_S
    reset = exhausted_for(answer.rate_limits, now) if answer.rate_limits else None
    if reset is not None and reset > 0:
        # the upstream says the quota is spent: slow down before it answers 429. A reset
        # due now names no wait, and must not displace a throttle's backoff closure.
        signals.append(ScopeSignal.QUOTA_EXHAUSTED)
        closure = merged(closure, Closure(min(reset, cfg.retry_after_max_seconds), base, max_s,
                                          "quota_exhausted"))
    if not signals and not refund and cap is None:
        return SUCCESS if verdict.outcome is Outcome.SUCCEEDED else NO_EFFECT
    return ScopeEffects(signals=tuple(signals), closure=closure, pause=pause,
                        hold_seconds=hold, backs_off=backs_off,
                        succeeded=verdict.outcome is Outcome.SUCCEEDED, refund=refund,
                        cap=cap)


def _budget(verdict: Classified, answer: Answer, cfg: PolicyConfig, costs: Costs | None,
            now: datetime) -> tuple[float, float | None]:
    """(refund, cap) in calls' worth of tokens: what the answer says the bucket should give
    back, and the most it should hold."""
    requested = call_cost(cfg)
    if requested == 1.0 and cfg.cost is None:
        left = remaining_for(answer.rate_limits, now) if answer.rate_limits else None
        return 0.0, left
    if costs is None:
        return 0.0, None
    if costs.actual is not None:
        # an answer's word, bounded: it may take at most a burst's worth (an upstream
        # claiming 1e300 points must not empty the bucket for good)
        refund = max(-cfg.rate.burst / requested, (requested - costs.actual) / requested)
    elif verdict.outcome is Outcome.THROTTLED:
        refund = 1.0  # refused before it ran: it spent nothing
    else:
        refund = 0.0
    cap = costs.available / requested if costs.available is not None else None
    return refund, cap


def merged(known: Closure | None, new: Closure) -> Closure:
    """One closure per scope: the longest delay the upstream named wins over a shorter one
    and over the scope's own backoff (a closure without a delay)."""
    if known is None or (new.delay_seconds is not None and (
            known.delay_seconds is None or new.delay_seconds > known.delay_seconds)):
        return new
    return known
