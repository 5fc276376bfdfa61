"""service.scope_signals: what one answer does to its scope, as a table."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from service.limiter import Closure
from service.metrics import ScopeSignal
from service.outcomes import Answer, Failure, classify
from service.policies import PolicyConfig
from service.scope_signals import LOCAL_HOLD_S, NO_EFFECT, SUCCESS, effects_of, merged
from tests.conftest import policies_from

NOW = datetime(2026, 6, 1, tzinfo=UTC)
SPENT = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "20"}


def config(**policy: object) -> PolicyConfig:
    cfg: dict[str, object] = {"version": 1, "upstream": "shop", "path": "/c/{object_id}",
                              "rate": {"per_second": 10, "burst": 10},
                              "backoff": {"base_seconds": 2, "max_seconds": 60},
                              "retry_after_max_seconds": 600}
    cfg.update(policy)
    return policies_from({"upstreams": {"shop": {"base_url": "http://127.0.0.1:9"}},
                          "policies": {"p": cfg}}).policies["p"].config


def effects(answer: Answer, **policy: object) -> object:
    cfg = config(**policy)
    verdict = classify(answer, absent_means_deleted=cfg.absent_means_deleted, now=NOW)
    return effects_of(verdict, answer, cfg, NOW)


@pytest.mark.parametrize(("answer", "expected"), [
    (Answer(status=204), SUCCESS),
    (Answer(status=500), NO_EFFECT),
    (Answer(status=422), NO_EFFECT),
    (Answer(failure=Failure.CONNECT), NO_EFFECT),
    (Answer(status=429, retry_after="30"),
     {"signals": (ScopeSignal.THROTTLED,), "closure": Closure(30.0, 2.0, 60.0),
      "hold_seconds": LOCAL_HOLD_S, "backs_off": False}),
    # a date beyond retry_after_max_seconds is cut to it
    (Answer(status=429, retry_after="86400"),
     {"closure": Closure(600.0, 2.0, 60.0), "hold_seconds": LOCAL_HOLD_S}),
    (Answer(status=429),
     {"signals": (ScopeSignal.THROTTLED,), "closure": Closure(None, 2.0, 60.0),
      "hold_seconds": LOCAL_HOLD_S, "backs_off": True}),
    (Answer(status=503, retry_after="5"),
     {"signals": (ScopeSignal.THROTTLED,), "closure": Closure(5.0, 2.0, 60.0)}),
    (Answer(status=401),
     {"signals": (ScopeSignal.UNAUTHORIZED,), "closure": None, "pause": "unauthorized",
      "hold_seconds": LOCAL_HOLD_S}),
    (Answer(status=403), {"pause": "unauthorized"}),
    # no credential for the tenant: paused until one arrives, never as `unauthorized`
    (Answer(failure=Failure.NO_CREDENTIAL),
     {"signals": (ScopeSignal.UNAUTHORIZED,), "closure": None, "pause": "no-credential",
      "hold_seconds": LOCAL_HOLD_S}),
    (Answer(status=204, rate_limits=SPENT),
     {"signals": (ScopeSignal.QUOTA_EXHAUSTED,), "closure": Closure(20.0, 2.0, 60.0),
      "hold_seconds": None, "succeeded": True}),
    # a quota reset longer than the 429's date wins; the throttle still counts
    (Answer(status=429, retry_after="5", rate_limits=SPENT),
     {"signals": (ScopeSignal.THROTTLED, ScopeSignal.QUOTA_EXHAUSTED),
      "closure": Closure(20.0, 2.0, 60.0), "hold_seconds": LOCAL_HOLD_S}),
    # a quota with calls left, or reset now, names no wait
    (Answer(status=204, rate_limits={"x-ratelimit-remaining": "3",
                                     "x-ratelimit-reset": "20"}), SUCCESS),
    (Answer(status=429, rate_limits={"x-ratelimit-remaining": "0",
                                     "x-ratelimit-reset": "0"}),
     {"closure": Closure(None, 2.0, 60.0), "backs_off": True}),
])
def test_effects_table(answer: Answer, expected: object) -> None:
    got = effects(answer)
    if isinstance(expected, dict):
        assert {k: getattr(got, k) for k in expected} == expected
    else:
        assert got is expected


def test_a_404_that_means_deleted_is_a_success() -> None:
    assert effects(Answer(status=404), absent_means_deleted=True) is SUCCESS


@pytest.mark.parametrize(("known", "new", "expected"), [
    (None, Closure(None, 1, 9), Closure(None, 1, 9)),
    (Closure(None, 1, 9), Closure(5.0, 1, 9), Closure(5.0, 1, 9)),
    (Closure(5.0, 1, 9), Closure(None, 1, 9), Closure(5.0, 1, 9)),
    (Closure(5.0, 1, 9), Closure(3.0, 1, 9), Closure(5.0, 1, 9)),
    (Closure(5.0, 1, 9), Closure(8.0, 1, 9), Closure(8.0, 1, 9)),
])
def test_the_longest_named_delay_wins(known: Closure | None, new: Closure,
                                      expected: Closure) -> None:
    assert merged(known, new) == expected
