"""service.outcomes: every upstream answer lands in exactly one outcome class (DESIGN.md,
"Outcome classes"), Retry-After is read per RFC 9110 and never raises (0 and past dates are no
usable date), `plan` turns an outcome into the item's next state with bounded, monotone
backoff, and `exhausted_for` reads the upstream's quota fields as Structured Fields."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from service.outcomes import (
    FAILURE_OUTCOMES,
    Answer,
    Classified,
    Failure,
    Outcome,
    Plan,
    classify,
    exhausted_for,
    parse_retry_after,
    plan,
)

# A Sunday, so the HTTP-date forms below carry the right day names.
NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)

S, TH, TR, UK, PE, UA = (Outcome.SUCCEEDED, Outcome.THROTTLED, Outcome.TRANSIENT,
                         Outcome.UNKNOWN, Outcome.PERMANENT, Outcome.UNAUTHORIZED)

# (answer, absent_means_deleted, outcome, reason, retry_after_seconds)
CLASSIFY_TABLE: list[tuple[Answer, bool, Outcome, str, float | None]] = [
    # 2xx: succeeded, whatever the policy says about absence
    *[(Answer(status=s), a, S, f"http_{s}", None)
      for s in (200, 201, 204, 299) for a in (True, False)],
    (Answer(status=200, retry_after="30"), False, S, "http_200", None),
    # 404/410: succeeded when absent means deleted, otherwise permanent
    (Answer(status=404), True, S, "absent_404", None),
    (Answer(status=410), True, S, "absent_410", None),
    (Answer(status=404), False, PE, "http_404", None),
    (Answer(status=410), False, PE, "http_410", None),
    # 429: throttled, with or without (a usable) Retry-After; 0, a date now or past, and
    # garbage all leave the delay to the policy's backoff, as no Retry-After does
    (Answer(status=429), True, TH, "http_429", None),
    (Answer(status=429), False, TH, "http_429", None),
    (Answer(status=429, retry_after="7"), False, TH, "http_429", 7.0),
    (Answer(status=429, retry_after="1"), False, TH, "http_429", 1.0),
    (Answer(status=429, retry_after="0"), False, TH, "http_429", None),
    (Answer(status=429, retry_after="000"), True, TH, "http_429", None),
    (Answer(status=429, retry_after="Sun, 01 Mar 2026 12:01:00 GMT"), False, TH, "http_429",
     60.0),
    (Answer(status=429, retry_after="Sun, 01 Mar 2026 12:00:00 GMT"), False, TH, "http_429",
     None),
    (Answer(status=429, retry_after="Sun, 06 Nov 1994 08:49:37 GMT"), False, TH, "http_429",
     None),
    (Answer(status=429, retry_after="soon"), False, TH, "http_429", None),
    # 503: throttled only with a usable Retry-After; with none, 0 or a date not ahead it is a
    # plain transient 5xx (counted, backed off, the scope left open)
    (Answer(status=503, retry_after="30"), False, TH, "http_503", 30.0),
    (Answer(status=503, retry_after="Sun, 01 Mar 2026 12:00:05 GMT"), False, TH, "http_503",
     5.0),
    (Answer(status=503, retry_after="0"), True, TR, "http_503", None),
    (Answer(status=503, retry_after="0"), False, TR, "http_503", None),
    (Answer(status=503, retry_after="Sun, 01 Mar 2026 12:00:00 GMT"), False, TR, "http_503",
     None),
    (Answer(status=503, retry_after="Sun, 06 Nov 1994 08:49:37 GMT"), False, TR, "http_503",
     None),
    (Answer(status=503), False, TR, "http_503", None),
    (Answer(status=503, retry_after="later"), False, TR, "http_503", None),
    (Answer(status=503, retry_after=""), False, TR, "http_503", None),
    # other 5xx and 408: transient; a Retry-After on them is not a throttle
    *[(Answer(status=s), a, TR, f"http_{s}", None)
      for s in (500, 502, 504, 599) for a in (True, False)],
    (Answer(status=500, retry_after="5"), False, TR, "http_500", None),
    (Answer(status=408), False, TR, "http_408", None),
    (Answer(status=408, retry_after="5"), True, TR, "http_408", None),
    # 401/403: a credential fault, never the item's
    *[(Answer(status=s), a, UA, f"http_{s}", None) for s in (401, 403) for a in (True, False)],
    # other 4xx: permanent
    *[(Answer(status=s), a, PE, f"http_{s}", None)
      for s in (400, 405, 409, 418, 422, 451, 499) for a in (True, False)],
    # 1xx: not an answer to the deletion, transient
    *[(Answer(status=s), False, TR, f"http_{s}", None) for s in (100, 101, 199)],
    # 3xx: a deletion is never followed elsewhere; where to is in the reason
    *[(Answer(status=s), False, PE, f"http_{s}:redirect", None)
      for s in (300, 301, 302, 304, 307, 308, 399)],
    (Answer(status=301, location="https://new.example/carts/1?a=b"), False, PE,
     "http_301:redirect:https://new.example/carts/1?a=b", None),
    (Answer(status=302, location="/x\r\nSet-Cookie: a \u00e9" + "y" * 300), False, PE,
     "http_302:redirect:" + ("/xSet-Cookie:a" + "y" * 300)[:200], None),
    # no status and no failure
    (Answer(), False, UK, "no_status", None),
    # transport failures (a failure wins over any status)
    (Answer(failure=Failure.CONNECT), False, TR, "connect_error", None),
    (Answer(failure=Failure.TIMEOUT_BEFORE_SEND), True, TR, "timeout_before_send", None),
    # the worker hands such a call back unattempted; classified, it is a call never sent
    (Answer(failure=Failure.SENT_TOO_LATE), False, TR, "sent_too_late", None),
    (Answer(failure=Failure.WITHHELD), False, TR, "withheld", None),
    (Answer(failure=Failure.ECHO_MISMATCH), False, UK, "echo_mismatch", None),
    (Answer(failure=Failure.PRIVATE_ADDRESS, detail="a.example resolves to 10.0.0.7"), False,
     PE, "private_address:a.example resolves to 10.0.0.7", None),
    (Answer(failure=Failure.TIMEOUT_AFTER_SEND), False, UK, "timeout_after_send", None),
    (Answer(failure=Failure.RESET_AFTER_SEND), True, UK, "reset_after_send", None),
    (Answer(failure=Failure.PROTOCOL), False, UK, "protocol_error", None),
    (Answer(failure=Failure.INVALID_REQUEST), True, PE, "invalid_request", None),
    # the tenant has no credential: never called, the item waits unpunished
    (Answer(failure=Failure.NO_CREDENTIAL), True, UA, "no_credential", None),
    # its lookup failed (the store's database): nothing sent, the item unpunished
    (Answer(failure=Failure.CREDENTIAL_UNAVAILABLE), True, TH, "credential_unavailable", None),
    # a store target's statement (service/sweeps/store_targets.py)
    (Answer(failure=Failure.STORE_UNREACHABLE), False, UA, "store_unreachable", None),
    (Answer(failure=Failure.STORE_PERMISSION), False, UA, "store_permission_denied", None),
    (Answer(failure=Failure.STORE_BUSY), False, TR, "store_busy", None),
    (Answer(failure=Failure.STORE_LOST), False, UK, "store_connection_lost", None),
    (Answer(failure=Failure.STORE_REFUSED), False, PE, "store_refused", None),
    (Answer(failure=Failure.STORE_GUARD, retry_after="5"), False, TH, "store_guard", 5.0),
    (Answer(failure=Failure.LEDGER_UNAVAILABLE), False, TH, "ledger_unavailable", None),
    (Answer(status=200, failure=Failure.TIMEOUT_AFTER_SEND), True, UK, "timeout_after_send",
     None),
    (Answer(status=429, retry_after="5", failure=Failure.CONNECT), False, TR, "connect_error",
     None),
]


def _case_id(case: tuple[Answer, bool, Outcome, str, float | None]) -> str:
    answer, absent, outcome, _, _ = case
    what = answer.failure.value if answer.failure else f"{answer.status}"
    ra = f"-ra={answer.retry_after!r}" if answer.retry_after is not None else ""
    return f"{what}{ra}-absent={absent}->{outcome.value}"


@pytest.mark.parametrize("case", CLASSIFY_TABLE, ids=_case_id)
def test_classify_table(case: tuple[Answer, bool, Outcome, str, float | None]) -> None:
    answer, absent, outcome, reason, retry_after = case
    assert classify(answer, absent_means_deleted=absent, now=NOW) == Classified(
        outcome, reason, retry_after)


def test_the_table_covers_every_outcome_and_failure() -> None:
    # `skipped` is no answer's class: a store target reads it from what its statement
    # returned (tests/integration/test_stores.py)
    assert {c[2] for c in CLASSIFY_TABLE} == set(Outcome) - {Outcome.SKIPPED}
    assert {c[0].failure for c in CLASSIFY_TABLE if c[0].failure} == set(Failure)
    assert set(FAILURE_OUTCOMES) == set(Failure)  # every failure has its row


@given(status=st.integers(100, 599), absent=st.booleans(),
       retry_after=st.none() | st.sampled_from(["0", "5", "soon", "",
                                                "Sun, 01 Mar 2026 12:00:09 GMT",
                                                "Sun, 01 Mar 2026 11:59:00 GMT"]))
def test_every_status_lands_in_exactly_one_documented_class(
        status: int, absent: bool, retry_after: str | None) -> None:
    got = classify(Answer(status=status, retry_after=retry_after),
                   absent_means_deleted=absent, now=NOW)
    usable = retry_after is not None and parse_retry_after(retry_after, NOW) is not None
    if 200 <= status < 300 or (status in (404, 410) and absent):
        expected = S
    elif status == 429 or (status == 503 and usable):
        expected = TH
    elif status in (401, 403):
        expected = UA
    elif (400 <= status < 500 and status != 408) or 300 <= status < 400:
        expected = PE
    else:
        expected = TR
    assert got.outcome is expected
    assert (got.retry_after_seconds is not None) <= (got.outcome is TH)
    assert got.retry_after_seconds is None or got.retry_after_seconds > 0


@pytest.mark.parametrize("status", [200, 429, 503])
def test_classify_survives_a_superscript_retry_after(status: int) -> None:
    # httpx decodes a header byte 0xB2 (latin-1) as "²": this reaches classify off the wire
    got = classify(Answer(status=status, retry_after="²"), absent_means_deleted=False, now=NOW)
    assert got.outcome in (S, TH, TR)


# -- parse_retry_after -------------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    ("1", 1.0),
    ("3", 3.0),
    (" 7 ", 7.0),
    ("\t12\n", 12.0),
    ("120", 120.0),
    ("86400", 86400.0),
    ("999999999999", 999999999999.0),
    # HTTP-date, the three forms of RFC 9110 §5.6.7
    ("Sun, 01 Mar 2026 12:00:30 GMT", 30.0),         # IMF-fixdate
    ("Sunday, 01-Mar-26 12:00:30 GMT", 30.0),        # obsolete RFC 850
    ("Sun Mar  1 12:00:30 2026", 30.0),              # obsolete asctime
    ("Sun, 01 Mar 2026 13:00:00 GMT", 3600.0),
    ("Mon, 02 Mar 2026 12:00:00 GMT", 86400.0),
    ("Sun, 01 Mar 2026 12:00:01 GMT", 1.0),
])
def test_parse_retry_after_valid(value: str, expected: float) -> None:
    assert parse_retry_after(value, NOW) == expected


@pytest.mark.parametrize("value", [
    # zero, in every spelling, asks for no wait at all
    "0", "00", "0000000000000", " 0 ",
    # a date now or past, in all three forms
    "Sun, 01 Mar 2026 12:00:00 GMT",
    "Sun, 01 Mar 2026 11:59:59 GMT",
    "Sun, 06 Nov 1994 08:49:37 GMT",
    "Sunday, 06-Nov-94 08:49:37 GMT",
    "Sun Nov  6 08:49:37 1994",
    "Thu, 01 Jan 1970 00:00:00 GMT",
])
def test_parse_retry_after_zero_or_past_is_no_usable_date(value: str) -> None:
    # Taken literally these let an upstream switch throttling off; the caller backs off instead
    assert parse_retry_after(value, NOW) is None


@pytest.mark.parametrize("digits", ["9" * 13, "9" * 30, "1" + "0" * 40, "7" * 1000])
def test_parse_retry_after_huge_delay_seconds_is_huge_and_finite(digits: str) -> None:
    got = parse_retry_after(digits, NOW)
    assert got is not None and math.isfinite(got)
    assert got >= 1e11  # far beyond any retry_after_max_seconds (at most 86400)


@pytest.mark.parametrize("value", [
    None, "", "   ", "soon", "-5", "+5", "1.5", "1e3", "0x10", "5 seconds", "3 4",
    "Wed, 99 Foo 2026", "Thu, 32 Jan 2026 00:00:00 GMT", "Sun, 01 Mar 2026 25:00:00 GMT",
    "Sun, 01 Mar 2026", "GMT", "Fri, 31 Dec 99999 23:59:59 GMT", "\x00", "∞", "NaN", "inf",
])
def test_parse_retry_after_garbage_is_none(value: str | None) -> None:
    assert parse_retry_after(value, NOW) is None


@pytest.mark.parametrize("value", ["²", "¹²", "³", "①", "5²"])
def test_parse_retry_after_superscript_digits_do_not_raise(value: str) -> None:
    got = parse_retry_after(value, NOW)
    assert got is None or got >= 0


@pytest.mark.parametrize(("value", "expected"), [("0000000000005", 5.0),
                                                 ("00000000000000000120", 120.0)])
def test_parse_retry_after_leading_zeros_keep_their_value(value: str, expected: float) -> None:
    assert parse_retry_after(value, NOW) == expected


@given(st.integers(min_value=1, max_value=10**11), st.text(" \t", max_size=3),
       st.text(" \t", max_size=3))
def test_parse_retry_after_delay_seconds_roundtrip(n: int, pre: str, post: str) -> None:
    assert parse_retry_after(f"{pre}{n}{post}", NOW) == float(n)


@given(st.integers(min_value=-10**9, max_value=10**9))
def test_parse_retry_after_imf_fixdate_roundtrip(offset: int) -> None:
    when = NOW + timedelta(seconds=offset)
    value = when.strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert parse_retry_after(value, NOW) == (float(offset) if offset > 0 else None)


@given(st.text())
@example("Wed, 99 Foo 2026")
@example("Sun, 01 Mar 2026 12:00:00 +9999")
@example("Sun, 01 Mar 10000 12:00:00 GMT")
@example("Sun, 01 Mar 0000 12:00:00 GMT")
@example("1 Jan 1 00:00:00 -2359")
@example("31 Dec 9999 23:59:59 +2359")
def test_parse_retry_after_is_total(value: str) -> None:
    """Any text: a finite float > 0 or None, never an exception."""
    got = parse_retry_after(value, NOW)
    assert got is None or (math.isfinite(got) and got > 0)


@given(st.text())
@example("²")
def test_parse_retry_after_never_raises_on_any_text(value: str) -> None:
    got = parse_retry_after(value, NOW)
    assert got is None or (math.isfinite(got) and got > 0)


# -- plan --------------------------------------------------------------------------------

KNOBS = {"max_attempts": 5, "backoff_base_s": 2.0, "backoff_max_s": 60.0,
         "retry_after_max_s": 3600.0}


def _plan(outcome: Outcome, *, attempt: int = 1, retry_after: float | None = None,
          jitter: float = 0.5, **knobs: float) -> Plan:
    return plan(Classified(outcome, f"r_{outcome.value}", retry_after),
                attempt=attempt, jitter=jitter, **{**KNOBS, **knobs})  # type: ignore[arg-type]


@pytest.mark.parametrize("attempt", [1, 4, 5, 50])
def test_plan_succeeded(attempt: int) -> None:
    assert _plan(S, attempt=attempt) == Plan("succeeded", 0.0, False, "r_succeeded")


@pytest.mark.parametrize("attempt", [1, 2, 5, 50])
def test_plan_permanent_is_dead_at_once(attempt: int) -> None:
    assert _plan(PE, attempt=attempt) == Plan("dead", 0.0, False, "r_permanent")


@pytest.mark.parametrize("outcome", [TR, UK])
@pytest.mark.parametrize(("attempt", "ceiling"), [(1, 2.0), (2, 4.0), (3, 8.0), (4, 16.0)])
def test_plan_transient_and_unknown_back_off_before_the_limit(
        outcome: Outcome, attempt: int, ceiling: float) -> None:
    assert _plan(outcome, attempt=attempt, jitter=0.25) == Plan(
        "pending", ceiling * 0.25, False, f"r_{outcome.value}")


@pytest.mark.parametrize("outcome", [TR, UK])
@pytest.mark.parametrize("attempt", [5, 6, 100])
def test_plan_transient_and_unknown_are_dead_after_max_attempts(outcome: Outcome,
                                                                attempt: int) -> None:
    assert _plan(outcome, attempt=attempt) == Plan(
        "dead", 0.0, False, f"max_attempts:r_{outcome.value}")


def test_plan_backoff_ceiling_is_capped_by_max() -> None:
    got = _plan(TR, attempt=4, jitter=0.5, max_attempts=100, backoff_base_s=10.0,
                backoff_max_s=30.0)
    assert got.retry_in_seconds == 15.0  # min(30, 10*2^3) * 0.5


def test_plan_max_attempts_one_is_dead_on_the_first_failure() -> None:
    assert _plan(TR, attempt=1, max_attempts=1).status == "dead"


@pytest.mark.parametrize(("asked", "expected"), [
    (0.0, 0.0), (1.0, 1.0), (30.0, 30.0), (3600.0, 3600.0), (3601.0, 3600.0),
    (1e12, 3600.0),
])
@pytest.mark.parametrize("attempt", [1, 5, 9])
def test_plan_throttled_waits_what_was_asked_clamped_and_refunds(
        asked: float, expected: float, attempt: int) -> None:
    # never dead, even at or past max_attempts: the attempt is refunded
    assert _plan(TH, attempt=attempt, retry_after=asked, jitter=0.0) == Plan(
        "pending", expected, True, "r_throttled")


@pytest.mark.parametrize("attempt", [1, 3, 5, 9])
def test_plan_throttled_without_retry_after_uses_backoff_and_refunds(attempt: int) -> None:
    ceiling = min(60.0, 2.0 * 2 ** (attempt - 1))
    assert _plan(TH, attempt=attempt, jitter=0.5) == Plan("pending", ceiling * 0.5, True,
                                                           "r_throttled")


@pytest.mark.parametrize("attempt", [1, 3, 5, 9])
def test_plan_unauthorized_is_pending_and_refunded(attempt: int) -> None:
    ceiling = min(60.0, 2.0 * 2 ** (attempt - 1))
    assert _plan(UA, attempt=attempt, jitter=0.75) == Plan("pending", ceiling * 0.75, True,
                                                            "r_unauthorized")


def test_plan_end_to_end_with_classify() -> None:
    c = classify(Answer(status=429, retry_after="Sun, 01 Mar 2026 12:02:00 GMT"),
                 absent_means_deleted=False, now=NOW)
    assert _plan(c.outcome, retry_after=c.retry_after_seconds).retry_in_seconds == 120.0


@pytest.mark.parametrize("retry_after", ["0", "Sun, 06 Nov 1994 08:49:37 GMT", "soon"])
def test_plan_for_an_unusable_retry_after_is_the_plan_without_one(retry_after: str) -> None:
    def planned(value: str | None) -> Plan:
        c = classify(Answer(status=429, retry_after=value), absent_means_deleted=False, now=NOW)
        return _plan(c.outcome, attempt=3, retry_after=c.retry_after_seconds, jitter=0.5)

    assert planned(retry_after) == planned(None) == Plan("pending", 4.0, True, "r_throttled")


@pytest.mark.parametrize("outcome", [TR, UK, TH, UA])
def test_plan_survives_a_runaway_attempt_counter(outcome: Outcome) -> None:
    got = _plan(outcome, attempt=1100, max_attempts=8, jitter=0.5)
    assert got.status in ("dead", "pending")
    assert math.isfinite(got.retry_in_seconds)


# properties

_base = st.floats(min_value=0.001, max_value=3600, allow_nan=False)
_cap = st.floats(min_value=0.001, max_value=86_400, allow_nan=False)
_jitter = st.floats(min_value=0.0, max_value=1.0, exclude_max=True, allow_nan=False)


@given(outcome=st.sampled_from([TR, UK]), attempt=st.integers(1, 999), base=_base,
       cap=_cap, jitter=_jitter)
@example(outcome=TR, attempt=999, base=1.0, cap=1.0, jitter=0.5)
@example(outcome=UK, attempt=1, base=0.001, cap=86_400, jitter=0.999)
def test_plan_backoff_is_bounded_and_grows_with_attempt(
        outcome: Outcome, attempt: int, base: float, cap: float, jitter: float) -> None:
    cap = max(cap, base)  # the policies file requires max_seconds >= base_seconds
    knobs = {"max_attempts": 1001, "backoff_base_s": base, "backoff_max_s": cap}
    now_ = _plan(outcome, attempt=attempt, jitter=jitter, **knobs)
    nxt = _plan(outcome, attempt=attempt + 1, jitter=jitter, **knobs)
    ceiling = min(cap, base * 2.0 ** (attempt - 1))
    assert now_.status == "pending" and not now_.refund_attempt
    assert 0.0 <= now_.retry_in_seconds <= ceiling <= cap
    assert nxt.retry_in_seconds >= now_.retry_in_seconds
    assert now_.retry_in_seconds == pytest.approx(ceiling * jitter, rel=1e-12, abs=0)


@given(attempt=st.integers(1, 1000), max_attempts=st.integers(1, 1000),
       outcome=st.sampled_from([TR, UK]), jitter=_jitter)
def test_plan_dead_exactly_when_attempts_are_exhausted(
        attempt: int, max_attempts: int, outcome: Outcome, jitter: float) -> None:
    got = _plan(outcome, attempt=attempt, max_attempts=max_attempts, jitter=jitter)
    assert (got.status == "dead") == (attempt >= max_attempts)
    assert got.refund_attempt is False


@given(asked=st.floats(min_value=0, max_value=1e15, allow_nan=False),
       cap=_cap, attempt=st.integers(1, 1000), jitter=_jitter)
def test_plan_throttled_never_waits_less_than_asked_unless_clamped(
        asked: float, cap: float, attempt: int, jitter: float) -> None:
    got = _plan(TH, attempt=attempt, retry_after=asked, jitter=jitter, retry_after_max_s=cap,
                max_attempts=3)
    assert got.status == "pending" and got.refund_attempt
    assert got.retry_in_seconds <= cap
    assert got.retry_in_seconds >= min(asked, cap)
    if asked <= cap:
        assert got.retry_in_seconds >= asked


# -- exhausted_for -----------------------------------------------------------------------

EPOCH = int(NOW.timestamp())

# (headers, seconds until the quota resets when it is spent, else None)
QUOTA_TABLE: list[tuple[dict[str, str], float | None]] = [
    # the IETF RateLimit field: a List of policies, each with r (remaining) and t (reset)
    ({"ratelimit": '"default";r=0;t=7'}, 7.0),
    ({"ratelimit": '"default";r=3;t=7'}, None),
    ({"ratelimit": "default;r=0;t=7"}, 7.0),  # a Token names a policy as well as a String
    ({"ratelimit": '"default";t=7;r=0'}, 7.0),
    ({"ratelimit": '"default";r=0;t=0'}, 0.0),
    ({"ratelimit": '"default";r=0;t=7;pk=:AAE=:'}, 7.0),
    # several policies: any one spent is enough ...
    ({"ratelimit": '"burst";r=5;t=1, "day";r=0;t=30'}, 30.0),
    ({"ratelimit": '"burst";r=0;t=1, "day";r=900;t=30'}, 1.0),
    ({"ratelimit": '"burst";r=5;t=1,"day";r=0;t=30'}, 30.0),
    ({"ratelimit": '"burst";r=5;t=1, "hour";r=7;t=60, "day";r=9;t=30'}, None),
    # ... and the longest wait among the spent ones wins
    ({"ratelimit": '"a";r=0;t=5, "b";r=0;t=60, "c";r=3;t=900'}, 60.0),
    ({"ratelimit": '"b";r=0;t=60, "a";r=0;t=5'}, 60.0),
    # r and t are one policy's own: never paired across policies
    ({"ratelimit": '"a";r=0, "b";r=3;t=30'}, None),
    ({"ratelimit": '"a";t=30, "b";r=0'}, None),
    ({"ratelimit": '"a";r=0, "b";r=0;t=4'}, 4.0),
    ({"ratelimit": '"a";r=5;t=900, "b";r=0;t=2'}, 2.0),
    # malformed: the field (or the member) is ignored, never guessed at
    ({"ratelimit": '"a";r=0;t=5,'}, None),               # trailing comma
    ({"ratelimit": '"a";r=0;t=5 junk'}, None),
    ({"ratelimit": "'a';r=0;t=5"}, None),                # single quotes
    ({"ratelimit": '"a";R=0;T=5'}, None),                # keys are lowercase
    ({"ratelimit": '"ä";r=0;t=5'}, None),                # not ASCII
    ({"ratelimit": '"a";r=0;t=-5'}, None),
    ({"ratelimit": '"a";r=-1;t=5'}, None),
    ({"ratelimit": '"a";r=0;t=5.5'}, None),              # a Decimal is no Integer
    ({"ratelimit": '"a";r;t=5'}, None),                  # a bare r is the Boolean true
    ({"ratelimit": '"a";r=?0;t=5'}, None),
    ({"ratelimit": '"a";r="0";t="5"'}, None),
    ({"ratelimit": "(a b);r=0;t=5"}, None),              # an Inner List is no policy
    ({"ratelimit": '"a";r=0;t=9999999999999999'}, None),  # beyond an Integer's 15 digits
    ({"ratelimit": '"a";r=0;t=999999999999999'}, 999999999999999.0),  # the caller clamps
    ({"ratelimit": '"a";r=0;t=5, "b";r=0;t=oops'}, 5.0),  # "oops" is a Token: b has no t
    ({"ratelimit": ""}, None),
    ({"ratelimit": "   "}, None),
    # the older drafts' Dictionary
    ({"ratelimit": "limit=100, remaining=0, reset=5"}, 5.0),
    ({"ratelimit": "limit=100, remaining=2, reset=5"}, None),
    ({"ratelimit": "remaining=0, reset=5;w=60"}, 5.0),
    ({"ratelimit": "limit=100, remaining=0"}, None),
    ({"ratelimit": "limit=100, remaining=(0), reset=5"}, None),
    ({"ratelimit": 'remaining=0, reset=5, "day";r=0;t=9'}, None),  # neither form: ignored
    # RateLimit-Remaining/-Reset and X-RateLimit-Remaining/-Reset
    ({"ratelimit-remaining": "0", "ratelimit-reset": "12"}, 12.0),
    ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "30"}, 30.0),
    ({"x-ratelimit-remaining": " 0 ", "x-ratelimit-reset": " 30 "}, 30.0),
    ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "000000000000000007"}, 7.0),
    ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(EPOCH + 9)}, 9.0),  # Unix time
    ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(EPOCH - 9)}, 0.0),  # past: reset
    ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1000000000"}, 0.0),
    ({"x-ratelimit-remaining": "4", "x-ratelimit-reset": "30"}, None),
    ({"x-ratelimit-remaining": "zero", "x-ratelimit-reset": "30"}, None),
    ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "-30"}, None),
    ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1.5"}, None),
    ({"x-ratelimit-remaining": "0"}, None),
    ({"x-ratelimit-reset": "30"}, None),
    # every family is read: any one spent is enough, the longest wait wins
    ({"ratelimit": '"a";r=3;t=7', "x-ratelimit-remaining": "0", "x-ratelimit-reset": "30"},
     30.0),
    ({"ratelimit": '"a";r=0;t=40', "ratelimit-remaining": "0", "ratelimit-reset": "30"}, 40.0),
    ({"ratelimit": "garbage;;", "ratelimit-remaining": "0", "ratelimit-reset": "3"}, 3.0),
    ({}, None),
]


@pytest.mark.parametrize(("headers", "expected"), QUOTA_TABLE, ids=lambda v: repr(v)[:60])
def test_exhausted_for_table(headers: dict[str, str], expected: float | None) -> None:
    assert exhausted_for(headers, NOW) == expected


@pytest.mark.parametrize("digits", ["9" * 16, "9" * 40, "7" * 5000])
def test_exhausted_for_an_absurd_reset_is_huge_and_finite(digits: str) -> None:
    got = exhausted_for({"x-ratelimit-remaining": "0", "x-ratelimit-reset": digits}, NOW)
    assert got is not None and math.isfinite(got) and got >= 1e11  # the caller clamps it


_policy = st.tuples(st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True),
                    st.integers(0, 3), st.integers(0, 10**6))


@given(st.lists(_policy, min_size=1, max_size=6))
def test_exhausted_for_is_the_longest_reset_among_the_spent_policies(
        policies: list[tuple[str, int, int]]) -> None:
    field = ", ".join(f'"{name}";r={r};t={t}' for name, r, t in policies)
    spent = [float(t) for _, r, t in policies if r == 0]
    assert exhausted_for({"ratelimit": field}, NOW) == (max(spent) if spent else None)


_sf_text = st.text(st.sampled_from([*'"();=,?*:@%-. \t0123456789abdrtRT', "ä", "\x00"]),
                   max_size=40)


@given(st.dictionaries(st.sampled_from(["ratelimit", "ratelimit-remaining", "ratelimit-reset",
                                        "x-ratelimit-remaining", "x-ratelimit-reset"]),
                       _sf_text | st.text()))
@example({"ratelimit": '"a";r=0;t=@99999999999999'})
@example({"ratelimit": '"a";r=0;t=:####:'})
@example({"ratelimit": '"a";r=0;t=%"%ff"'})
@example({"ratelimit": "a=(" * 500})
def test_exhausted_for_never_raises(headers: dict[str, str]) -> None:
    got = exhausted_for(headers, NOW)
    assert got is None or (math.isfinite(got) and got >= 0)
