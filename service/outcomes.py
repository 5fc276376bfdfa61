"""Classify one upstream answer (or transport failure) into exactly one outcome class.

Pure: no I/O, no clock. The worker only applies what this returns. The outcome table of
docs/architecture.md (Outcomes), in full:

    succeeded     2xx; 404/410 when the policy says absent = deleted
    throttled     429, or 503 with a usable Retry-After (> 0) -> pending at retry time,
                  attempt not counted
    transient     other 5xx (a 503 without a usable Retry-After too), 408, 1xx,
                  connect error, timeout before the request was sent
    unknown       timeout or reset after the request was sent (the duplicate window), a
                  protocol error, no status at all
    permanent     other 4xx (400, 404, 409, 422...), malformed id  -> dead at once;
                  3xx (a deletion is never followed elsewhere: `http_301:redirect:<Location>`)
    unauthorized  401/403; the tenant has no credential -> scope paused, item unpunished
    skipped       a store target's statement found the row no longer matching its
                  predicate (active again since discovery): not deleted, item ends skipped
    (a credential lookup that failed is `throttled`: nothing was sent, the item unpunished)

A store target's statement (service/sweeps/store_targets.py) fails as:

    store unreachable, permission denied    unauthorized (the scope paused with the reason)
    lock or statement timeout, serialization failure, deadlock    transient
    the connection lost while it ran or committed                  unknown
    any other SQL error                                            permanent
    its guard over the threshold            throttled, for the guard's backoff

A policy's answer rules (service/config/answer_rules.py) are read first and passed in as `ruled`.

A confirmation read (a policy's `confirm`, after its deletion answered success) is read by
`classify_confirmation`, never by the rules:

    succeeded     one of the policy's `absent` statuses: the object is gone
    transient     2xx (`not_confirmed`): the object is still served, the deletion did not
                  take; deleted again with the same key, dead at max_attempts
    otherwise     the read's own failure, as the table above classifies it with reason
                  `confirm:<reason>`: throttled, transient, unknown, unauthorized or
                  permanent, never succeeded
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Final

import http_sf

from service.values import value

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
    SKIPPED = "skipped"


class Failure(StrEnum):
    """How a call failed without an HTTP answer; set by the upstream client."""

    CONNECT = "connect_error"            # never reached the upstream: safe to retry
    TIMEOUT_BEFORE_SEND = "timeout_before_send"
    TIMEOUT_AFTER_SEND = "timeout_after_send"  # it may have acted: unknown
    RESET_AFTER_SEND = "reset_after_send"
    PROTOCOL = "protocol_error"          # garbage where an HTTP answer should be
    # the host resolves to an address its upstream may not reach (service/protocols/egress.py):
    # never connected, and never will be while its DNS says so
    PRIVATE_ADDRESS = "private_address"
    # an answer that could record a deletion lacked the value this request sent in the
    # upstream's echo_header: it may answer another request (the deletion may have happened)
    ECHO_MISMATCH = "echo_mismatch"
    INVALID_REQUEST = "invalid_request"  # the id cannot form a URL: a poison item
    NO_CREDENTIAL = "no_credential"      # the tenant has no credential: never called
    CREDENTIAL_UNAVAILABLE = "credential_unavailable"  # its lookup failed: never called
    # its rate-limit token's moment passed before the request could be written: never sent
    # (the worker returns the lease without an attempt: service/worker/pool.py)
    SENT_TOO_LATE = "sent_too_late"
    # a legal hold took the call back, or its lease was ending, just before the request
    # would have been written: never sent (the lease goes back: service/worker/hold_gate.py)
    WITHHELD = "withheld"
    # a store target's statement (service/sweeps/store_targets.py)
    STORE_UNREACHABLE = "store_unreachable"  # no connection: nothing ran
    STORE_PERMISSION = "store_permission_denied"
    STORE_BUSY = "store_busy"  # lock or statement timeout, serialization, deadlock: undone
    STORE_LOST = "store_connection_lost"  # lost while it ran or committed: it may have
    STORE_REFUSED = "store_refused"  # any other SQL error
    STORE_GUARD = "store_guard"  # the guard's number is over its threshold: nothing ran
    LEDGER_UNAVAILABLE = "ledger_unavailable"  # the run's cutoff could not be read: nothing ran


@value
class Answer:
    """What the upstream client observed: a status and headers, or a failure."""

    status: int | None = None
    retry_after: str | None = None
    failure: Failure | None = None
    # the rate-limit header fields as received (lower-case names), read by scope_signals
    rate_limits: Mapping[str, str] | None = None
    # the body, read only where a policy's answer rules look at it (service/config/answer_rules.py),
    # and only up to the policy's cap: None otherwise. Never logged or stored.
    body: bytes | None = field(default=None, repr=False)
    location: str | None = None  # a 3xx answer's Location, as received
    detail: str | None = None  # what a PRIVATE_ADDRESS failure refused (host and address)


@value
class Classified:
    """An outcome with the reason code recorded in the ledger and, for throttling, the
    upstream's requested delay (seconds, unclamped; the limiter bounds it). `version` is the
    version an optimistic-concurrency conflict named: retried at once with it."""

    outcome: Outcome
    reason: str
    retry_after_seconds: float | None = None
    version: str | None = None


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Retry-After as delay-seconds or HTTP-date (RFC 9110 10.2.3): a delay > 0, or None when
    absent, unreadable, zero or a date not after `now`. Never raises.

    Zero and the past are no usable date: taken literally they let an upstream that answers
    every call over its limit with `Retry-After: 0` switch throttling off, so the caller backs
    off exactly as when there is no Retry-After at all."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if _DELAY_SECONDS.fullmatch(text):
        delay = _whole_seconds(text)
    else:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        delay = (when - now).total_seconds()
    return delay if math.isfinite(delay) and delay > 0 else None


def _whole_seconds(digits: str) -> float:
    """An ASCII 1*DIGIT string as seconds. Beyond 12 digits (31,000 years) the exact value no
    longer matters, and the policy's retry_after_max_seconds clamps it."""
    significant = digits.lstrip("0") or "0"
    return float(int(significant)) if len(significant) <= 12 else 1e12


# A call that got no HTTP answer, by how it failed (the module docstring's table): every
# Failure has its row.
FAILURE_OUTCOMES: Final[Mapping[Failure, Outcome]] = {
    # nothing reached the upstream, or nothing was changed: retried with the same key
    Failure.CONNECT: Outcome.TRANSIENT,
    Failure.TIMEOUT_BEFORE_SEND: Outcome.TRANSIENT,
    Failure.SENT_TOO_LATE: Outcome.TRANSIENT,
    Failure.WITHHELD: Outcome.TRANSIENT,
    Failure.STORE_BUSY: Outcome.TRANSIENT,
    # it may have acted: the duplicate window
    Failure.TIMEOUT_AFTER_SEND: Outcome.UNKNOWN,
    Failure.RESET_AFTER_SEND: Outcome.UNKNOWN,
    Failure.PROTOCOL: Outcome.UNKNOWN,
    Failure.ECHO_MISMATCH: Outcome.UNKNOWN,
    Failure.STORE_LOST: Outcome.UNKNOWN,
    # never callable as it stands: dead at once
    Failure.PRIVATE_ADDRESS: Outcome.PERMANENT,
    Failure.INVALID_REQUEST: Outcome.PERMANENT,
    Failure.STORE_REFUSED: Outcome.PERMANENT,
    # not the item's fault: it waits, unpunished, in a scope paused until the store answers
    # or a credential arrives
    Failure.STORE_UNREACHABLE: Outcome.UNAUTHORIZED,
    Failure.STORE_PERMISSION: Outcome.UNAUTHORIZED,
    Failure.NO_CREDENTIAL: Outcome.UNAUTHORIZED,
    # our side held the call back: the item is not punished and the scope waits out its
    # backoff, as after a 429 without a date (the guard's: its own Retry-After)
    Failure.CREDENTIAL_UNAVAILABLE: Outcome.THROTTLED,
    Failure.LEDGER_UNAVAILABLE: Outcome.THROTTLED,
    Failure.STORE_GUARD: Outcome.THROTTLED,
}

# An HTTP answer by its exact status first, then by its class; anything else (1xx: the
# deletion was not answered) is transient. 404 and 410 (absent), a 503 with a usable
# Retry-After (throttled) and a 3xx's reason are read in `_classify_status`.
_BY_STATUS: Final[Mapping[int, Outcome]] = {
    401: Outcome.UNAUTHORIZED, 403: Outcome.UNAUTHORIZED,
    408: Outcome.TRANSIENT,
    429: Outcome.THROTTLED,
}
_BY_CLASS: Final[Mapping[int, Outcome]] = {
    2: Outcome.SUCCEEDED,
    3: Outcome.PERMANENT,
    4: Outcome.PERMANENT,
    5: Outcome.TRANSIENT,
}


def classify(answer: Answer, *, absent_means_deleted: bool, now: datetime,
             ruled: Classified | None = None) -> Classified:
    """The one switch from an answer to an outcome. `ruled` is what the policy's answer
    rules made of it (service/config/answer_rules.py), which takes precedence over the status
    table."""
    if answer.failure is not None:
        return _classify_failure(answer.failure, answer, now)
    status = answer.status
    if status is None:
        return Classified(Outcome.UNKNOWN, "no_status")
    retry_after = parse_retry_after(answer.retry_after, now)
    if ruled is not None and ruled.outcome is Outcome.THROTTLED:
        return Classified(Outcome.THROTTLED, ruled.reason, retry_after)
    if ruled is not None:
        return ruled
    return _classify_status(answer, status, retry_after, absent_means_deleted)


def _classify_failure(failure: Failure, answer: Answer, now: datetime) -> Classified:
    """A call without an HTTP answer: its FAILURE_OUTCOMES row."""
    reason = failure.value
    if failure is Failure.PRIVATE_ADDRESS and answer.detail:
        reason = f"{reason}:{answer.detail}"
    # only a store's guard names when to come back
    retry_after = (parse_retry_after(answer.retry_after, now)
                   if failure is Failure.STORE_GUARD else None)
    return Classified(FAILURE_OUTCOMES[failure], reason, retry_after)


def _classify_status(answer: Answer, status: int, retry_after: float | None,
                     absent_means_deleted: bool) -> Classified:
    """An HTTP answer no answer rule claimed: the status table."""
    if status in (404, 410) and absent_means_deleted:
        return Classified(Outcome.SUCCEEDED, f"absent_{status}")
    # a 503 throttles only with a usable time; with none (or 0, or a past date) it is a plain
    # transient 5xx: counted against the item and backed off, the scope left open
    if status == 503 and retry_after is not None:
        return Classified(Outcome.THROTTLED, f"http_{status}", retry_after)
    outcome = _BY_STATUS.get(status) or _BY_CLASS.get(status // 100, Outcome.TRANSIENT)
    if outcome is Outcome.THROTTLED:
        return Classified(outcome, f"http_{status}", retry_after)
    if 300 <= status < 400:
        # a deletion is never followed elsewhere (the Idempotency-Key and credential would
        # go with it): the policy's URL is wrong, and the operator needs to see where to
        return Classified(outcome, redirect_reason(status, answer.location))
    return Classified(outcome, f"http_{status}")


NOT_CONFIRMED: Final = "not_confirmed"  # a confirmation read found the object served


def classify_confirmation(answer: Answer, *, absent: Collection[int], now: datetime
                          ) -> Classified:
    """A confirmation read's answer as an outcome (the module docstring): SUCCEEDED only for
    a status in `absent`."""
    status = answer.status if answer.failure is None else None
    if status is not None and status in absent:
        return Classified(Outcome.SUCCEEDED, f"confirmed:http_{status}")
    if status is not None and 200 <= status < 300:
        return Classified(Outcome.TRANSIENT, NOT_CONFIRMED)
    # with no deletion semantics, no status left here classifies as a success
    read = classify(answer, absent_means_deleted=False, now=now)
    return dataclasses.replace(read, reason=f"confirm:{read.reason}")


REDIRECT_SHOWN_CHARS: Final = 200


def redirect_reason(status: int, location: str | None) -> str:
    """`http_3xx:redirect` and where to, as much of the Location as is printable ASCII (at
    most REDIRECT_SHOWN_CHARS), for the item's reason."""
    shown = "".join(c for c in (location or "") if " " < c < "\x7f")[:REDIRECT_SHOWN_CHARS]
    return f"http_{status}:redirect" + (f":{shown}" if shown else "")


@value
class Plan:
    """What the ledger does with an item after an attempt (applied by completions.complete)."""

    status: str  # pending | succeeded | dead | skipped
    retry_in_seconds: float
    refund_attempt: bool
    reason: str


# The item's status after an outcome that ends it, whatever its attempts
_FINAL: Final[Mapping[Outcome, str]] = {
    Outcome.SUCCEEDED: "succeeded",
    Outcome.SKIPPED: "skipped",
    Outcome.PERMANENT: "dead",
}


def plan(result: Classified, *, attempt: int, max_attempts: int, backoff_base_s: float,
         backoff_max_s: float, retry_after_max_s: float, jitter: float) -> Plan:
    """Turn an outcome into the item's next state. `jitter` in [0, 1) comes from the caller
    (random in production, fixed in tests): full jitter over the exponential ceiling."""
    outcome = result.outcome
    final = _FINAL.get(outcome)
    if final is not None:
        return Plan(final, 0.0, False, result.reason)
    exponent = min(max(0, attempt - 1), MAX_BACKOFF_EXPONENT)
    ceiling = min(backoff_max_s, backoff_base_s * 2.0**exponent)
    if outcome is Outcome.THROTTLED:
        # Not the item's fault: the attempt is refunded. Wait at least what the upstream
        # asked (bounded by policy), never less. Without a usable date full jitter may put
        # the item due at once: the pace is held by the scope, which its bucket is closed by
        # its own backoff, never for less than backoff_base_s (service.budget.buckets._CLOSE).
        wanted = result.retry_after_seconds
        delay = min(wanted, retry_after_max_s) if wanted is not None else ceiling * jitter
        return Plan("pending", delay, True, result.reason)
    if outcome is Outcome.UNAUTHORIZED:
        return Plan("pending", ceiling * jitter, True, result.reason)
    # transient or unknown: retried with the same key after backoff, dead when exhausted
    if attempt >= max_attempts:
        return Plan("dead", 0.0, False, f"max_attempts:{result.reason}")
    # an optimistic-concurrency conflict that named the current version: the next call
    # carries it, at once (the attempt counts, so conflicts stay bounded)
    delay = 0.0 if result.version is not None else ceiling * jitter
    return Plan("pending", delay, False, result.reason)


EPOCH_THRESHOLD_S = 1_000_000_000  # a -Reset this large is a Unix time, not a delay

# One quota policy as read: (units remaining, seconds until it resets).
_Quota = tuple[float, float]


def exhausted_for(headers: Mapping[str, str], now: datetime) -> float | None:
    """Seconds until the upstream's quota resets when it says none is left, else None.

    Reads the IETF httpapi `RateLimit` field, a Structured Field (RFC 9651) List of policies
    (`"burst";r=5;t=1, "day";r=0;t=30`: `r` remaining, `t` seconds until reset) or the older
    drafts' Dictionary (`limit=10, remaining=0, reset=5`), and the separate
    `RateLimit-Remaining`/`-Reset` and `X-RateLimit-Remaining`/`-Reset` (reset as delay
    seconds or as a Unix time). The quota is spent when any policy read has none left, and
    the wait is the longest reset among those. The headers are the upstream's: what does not
    parse is ignored, never raised; the caller clamps the wait."""
    quotas = [*_ratelimit_field(headers.get("ratelimit")), *_split_fields(headers, now)]
    waits = [reset for remaining, reset in quotas if remaining == 0]
    return max(waits) if waits else None


def _ratelimit_field(value: str | None) -> list[_Quota]:
    """Each policy of a `RateLimit` field that names both its remaining units and its reset
    (a spent policy without a reset names no wait: a 429 then backs off by policy)."""
    if not value:
        return []
    members = _structured(value, "list")
    if isinstance(members, list):
        # r and t come from one member's own parameters, never paired across policies; an
        # Inner List is no policy
        return [quota for member in members
                if isinstance(member, tuple) and not isinstance(member[0], list)
                for quota in _quota(member[1].get("r"), member[1].get("t"))]
    legacy = _structured(value, "dictionary")
    if isinstance(legacy, dict):
        return _quota(_bare_item(legacy.get("remaining")), _bare_item(legacy.get("reset")))
    return []


def _structured(value: str, tltype: str) -> http_sf.StructuredType | None:
    """`value` parsed as a Structured Field of `tltype`, or None when it is not one."""
    try:
        # RFC 9651 fields are ASCII: other text is as malformed as bad syntax
        return http_sf.parse(value.encode("ascii"), tltype=tltype)
    except ValueError:  # http_sf.StructuredFieldError and UnicodeEncodeError alike
        return None


def _bare_item(member: object) -> object:
    """The value of a parsed Dictionary member that is an Item, else None."""
    if isinstance(member, tuple) and not isinstance(member[0], list):
        return member[0]
    return None


def _quota(remaining: object, reset: object) -> list[_Quota]:
    """The policy when both are non-negative Integers, else nothing. An Integer has at most
    15 digits (RFC 9651), so the reset is finite."""
    r, t = _count(remaining), _count(reset)
    return [] if r is None or t is None else [(float(r), float(t))]


def _count(value: object) -> int | None:
    # a bare `;r` parses as True, and bool is an int: no count
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def remaining_for(headers: Mapping[str, str], now: datetime) -> float | None:
    """The fewest units any quota the upstream names has left, else None (the same fields
    as exhausted_for)."""
    quotas = [*_ratelimit_field(headers.get("ratelimit")), *_split_fields(headers, now)]
    return min(remaining for remaining, _ in quotas) if quotas else None


def _split_fields(headers: Mapping[str, str], now: datetime) -> list[_Quota]:
    """The policy of each `RateLimit-*` and `X-RateLimit-*` pair that is present and
    readable, and BigCommerce's `X-Rate-Limit-Requests-Left` with `-Time-Reset-Ms`."""
    quotas: list[_Quota] = []
    for prefix in ("ratelimit-", "x-ratelimit-"):
        remaining = _digits(headers.get(prefix + "remaining"))
        reset = _digits(headers.get(prefix + "reset"))
        if remaining is None or reset is None:
            continue
        if reset >= EPOCH_THRESHOLD_S:
            # a Unix time; one already past has reset, which names no wait
            reset -= now.timestamp()
        quotas.append((remaining, max(0.0, reset)))
    left = _digits(headers.get("x-rate-limit-requests-left"))
    reset_ms = _digits(headers.get("x-rate-limit-time-reset-ms"))
    if left is not None and reset_ms is not None:
        quotas.append((left, reset_ms / 1000.0))
    return quotas


def _digits(value: str | None) -> float | None:
    """An ASCII 1*DIGIT field (whitespace around it allowed) as a number, else None."""
    text = value.strip() if value is not None else ""
    return _whole_seconds(text) if _DELAY_SECONDS.fullmatch(text) else None
