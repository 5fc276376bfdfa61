"""Classify one upstream answer (or transport failure) into exactly one outcome class.

Pure: no I/O, no clock. The worker only applies what this returns. DESIGN.md's table:

    succeeded     2xx; 404/410 when the policy says absent = deleted
    throttled     429, or 503 with Retry-After      -> pending at retry time, attempt not counted
    transient     other 5xx, 408, connect error, timeout before the request was sent
    unknown       timeout or reset after the request was sent (the duplicate window)
    permanent     other 4xx (400, 404, 409, 422...), malformed id  -> dead at once
    unauthorized  401/403                            -> scope paused, item unpunished
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum

_DELAY_SECONDS = re.compile(r"[0-9]+", re.ASCII)  # RFC 9110: 1*DIGIT, ASCII digits only
MAX_BACKOFF_EXPONENT = 60  # 2**60 s is beyond any policy's max_seconds
# The reason recorded when an item's policy version is not in the policies file: it is not
# called, and dies as permanent.
UNKNOWN_POLICY_VERSION = "unknown_policy_version"


class Outcome(StrEnum):
    """The closed set of attempt outcomes."""

    SUCCEEDED = "succeeded"
    THROTTLED = "throttled"
    TRANSIENT = "transient"
    UNKNOWN = "unknown"
    PERMANENT = "permanent"
    UNAUTHORIZED = "unauthorized"


class Failure(StrEnum):
    """How a call failed without an HTTP answer; set by the upstream client."""

    CONNECT = "connect_error"            # never reached the upstream: safe to retry
    TIMEOUT_BEFORE_SEND = "timeout_before_send"
    TIMEOUT_AFTER_SEND = "timeout_after_send"  # it may have acted: unknown
    RESET_AFTER_SEND = "reset_after_send"
    PROTOCOL = "protocol_error"          # garbage where an HTTP answer should be
    INVALID_REQUEST = "invalid_request"  # the id cannot form a URL: a poison item


@dataclass(frozen=True)
class Answer:
    """What the upstream client observed: a status and headers, or a failure."""

    status: int | None = None
    retry_after: str | None = None
    failure: Failure | None = None
    quota_reset_seconds: float | None = None  # the upstream said its quota is used up


@dataclass(frozen=True)
class Classified:
    """An outcome with the reason code recorded in the ledger and, for throttling, the
    upstream's requested delay (seconds, unclamped; the limiter bounds it)."""

    outcome: Outcome
    reason: str
    retry_after_seconds: float | None = None


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Retry-After as delay-seconds or HTTP-date (RFC 9110 10.2.3); None when absent or
    unreadable. A past date is 0. Never raises."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if _DELAY_SECONDS.fullmatch(text):
        digits = text.lstrip("0") or "0"
        # beyond 12 digits (31,000 years) the exact value no longer matters: the policy's
        # retry_after_max_seconds clamps it
        return float(int(digits)) if len(digits) <= 12 else 1e12
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    delay = (when - now).total_seconds()
    return max(0.0, delay) if math.isfinite(delay) else None


def classify(answer: Answer, *, absent_means_deleted: bool, now: datetime) -> Classified:
    """The one switch from an answer to an outcome."""
    if answer.failure is not None:
        return _classify_failure(answer.failure)
    status = answer.status
    if status is None:
        return Classified(Outcome.UNKNOWN, "no_status")
    retry_after = parse_retry_after(answer.retry_after, now)
    if 200 <= status < 300:
        return Classified(Outcome.SUCCEEDED, f"http_{status}")
    if status in (404, 410):
        if absent_means_deleted:
            return Classified(Outcome.SUCCEEDED, f"absent_{status}")
        return Classified(Outcome.PERMANENT, f"http_{status}")
    if status == 429 or (status == 503 and retry_after is not None):
        return Classified(Outcome.THROTTLED, f"http_{status}", retry_after)
    if status in (401, 403):
        return Classified(Outcome.UNAUTHORIZED, f"http_{status}")
    if status == 408 or status >= 500:
        return Classified(Outcome.TRANSIENT, f"http_{status}")
    if 400 <= status < 500:
        return Classified(Outcome.PERMANENT, f"http_{status}")
    # 1xx/3xx: the deletion API did not answer the deletion; treat as a transient fault
    return Classified(Outcome.TRANSIENT, f"http_{status}")


def _classify_failure(failure: Failure) -> Classified:
    if failure in (Failure.CONNECT, Failure.TIMEOUT_BEFORE_SEND):
        return Classified(Outcome.TRANSIENT, failure.value)
    if failure is Failure.INVALID_REQUEST:
        return Classified(Outcome.PERMANENT, failure.value)
    return Classified(Outcome.UNKNOWN, failure.value)


@dataclass(frozen=True)
class Plan:
    """What the ledger does with an item after an attempt (applied by claims.complete)."""

    status: str  # pending | succeeded | dead
    retry_in_seconds: float
    refund_attempt: bool
    reason: str


def plan(result: Classified, *, attempt: int, max_attempts: int, backoff_base_s: float,
         backoff_max_s: float, retry_after_max_s: float, jitter: float) -> Plan:
    """Turn an outcome into the item's next state. `jitter` in [0, 1) comes from the caller
    (random in production, fixed in tests): full jitter over the exponential ceiling."""
    outcome = result.outcome
    if outcome is Outcome.SUCCEEDED:
        return Plan("succeeded", 0.0, False, result.reason)
    if outcome is Outcome.PERMANENT:
        return Plan("dead", 0.0, False, result.reason)
    exponent = min(max(0, attempt - 1), MAX_BACKOFF_EXPONENT)
    ceiling = min(backoff_max_s, backoff_base_s * 2.0**exponent)
    if outcome is Outcome.THROTTLED:
        # Not the item's fault: the attempt is refunded. Wait at least what the upstream
        # asked (bounded by policy), never less.
        wanted = result.retry_after_seconds
        delay = min(wanted, retry_after_max_s) if wanted is not None else ceiling * jitter
        return Plan("pending", delay, True, result.reason)
    if outcome is Outcome.UNAUTHORIZED:
        return Plan("pending", ceiling * jitter, True, result.reason)
    # transient or unknown: retried with the same key after backoff, dead when exhausted
    if attempt >= max_attempts:
        return Plan("dead", 0.0, False, f"max_attempts:{result.reason}")
    return Plan("pending", ceiling * jitter, False, result.reason)


_RATELIMIT_REMAINING = re.compile(r"(?:^|[;,\s])(?:r|remaining)=(\d+)", re.ASCII)
_RATELIMIT_RESET = re.compile(r"(?:^|[;,\s])(?:t|reset)=(\d+)", re.ASCII)
EPOCH_THRESHOLD_S = 1_000_000_000  # a reset this large is a Unix time, not a delay


def exhausted_for(headers: dict[str, str], now: datetime) -> float | None:
    """Seconds until the upstream's quota resets when it says none is left, else None.

    Reads the IETF httpapi `RateLimit` field (`"p";r=0;t=5` and the older
    `limit=.., remaining=0, reset=5`), `RateLimit-Remaining`/`-Reset`, and the common
    `X-RateLimit-Remaining`/`-Reset` (reset as delay seconds or as a Unix time)."""
    pairs: list[tuple[str | None, str | None]] = []
    combined = headers.get("ratelimit")
    if combined:
        r = _RATELIMIT_REMAINING.search(combined)
        t = _RATELIMIT_RESET.search(combined)
        pairs.append((r.group(1) if r else None, t.group(1) if t else None))
    for prefix in ("ratelimit-", "x-ratelimit-"):
        pairs.append((headers.get(prefix + "remaining"), headers.get(prefix + "reset")))
    for remaining, reset in pairs:
        if remaining is None or reset is None:
            continue
        remaining, reset = remaining.strip(), reset.strip()
        if not (_DELAY_SECONDS.fullmatch(remaining) and _DELAY_SECONDS.fullmatch(reset)):
            continue
        if int(remaining) > 0:
            return None
        value = float(int(reset[:15]))
        if value >= EPOCH_THRESHOLD_S:
            value -= now.timestamp()
        return max(0.0, value)
    return None
