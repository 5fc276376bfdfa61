"""service.budget.answer_effects: what one answer does to its scope, as a table."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from service.budget.answer_effects import LOCAL_HOLD_S, NO_EFFECT, SUCCESS, effects_of, merged
from service.budget.rules import Closure
from service.config.answer_rules import Costs
from service.config.policy_file import PolicyConfig
from service.observability.metrics import ScopeSignal
from service.outcomes import Answer, Classified, Failure, Outcome, classify
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
    # ...but what is left lowers the bucket (a budget in calls)
    (Answer(status=204, rate_limits={"x-ratelimit-remaining": "3",
                                     "x-ratelimit-reset": "20"}),
     {"signals": (), "closure": None, "succeeded": True, "cap": 3.0}),
    # BigCommerce's fields likewise
    (Answer(status=204, rate_limits={"x-rate-limit-requests-left": "7",
                                     "x-rate-limit-time-reset-ms": "1500"}),
     {"succeeded": True, "cap": 7.0}),
    (Answer(status=429, rate_limits={"x-rate-limit-requests-left": "0",
                                     "x-rate-limit-time-reset-ms": "1500"}),
     {"signals": (ScopeSignal.THROTTLED, ScopeSignal.QUOTA_EXHAUSTED),
      "closure": Closure(1.5, 2.0, 60.0), "cap": 0.0}),
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


POINTS = {"rate": {"per_second": 100, "burst": 1000, "unit": "points"},
          "cost": {"requested": 10, "actual": "cost.actual", "available": "cost.left"}}


@pytest.mark.parametrize(("costs", "outcome", "refund", "cap"), [
    (Costs(actual=10, available=500), "succeeded", 0.0, 50.0),
    (Costs(actual=1, available=None), "succeeded", 0.9, None),  # a not-found costs 1 point
    (Costs(actual=15, available=0), "succeeded", -0.5, 0.0),     # it cost more: taken
    (Costs(actual=None, available=4), "throttled", 1.0, 0.4),    # refused before it ran
    (Costs(actual=None, available=None), "transient", 0.0, None),
])
def test_a_cost_budget_refunds_and_lowers_the_bucket_in_calls(
        costs: Costs, outcome: str, refund: float, cap: float | None) -> None:
    cfg = config(**POINTS)
    verdict = Classified(Outcome(outcome), "x")
    got = effects_of(verdict, Answer(status=200), cfg, NOW, costs)
    assert (got.refund, got.cap) == (pytest.approx(refund), cap)


def test_a_cost_budget_ignores_quota_headers_in_calls() -> None:
    """A budget in points is not lowered by a header counting requests."""
    cfg = config(**POINTS)
    answer = Answer(status=200, rate_limits={"x-ratelimit-remaining": "3",
                                             "x-ratelimit-reset": "20"})
    got = effects_of(Classified(Outcome.SUCCEEDED, "x"), answer, cfg, NOW,
                     Costs(actual=10, available=None))
    assert got.cap is None


def test_a_budget_in_points_is_kept_in_calls_of_the_requested_cost() -> None:
    from service.budget.rules import budget_of
    policy = policies_from({"upstreams": {"shop": {"base_url": "http://127.0.0.1:9"}},
                            "policies": {"p": {"version": 1, "upstream": "shop",
                                               "path": "/c/{object_id}", **POINTS}}}
                           ).policies["p"]
    assert budget_of(policy) == (10.0, 100, 1)


def test_an_upstreams_word_on_cost_is_bounded() -> None:
    """An answer claiming a call cost 1e300 points takes at most a burst's worth."""
    got = effects_of(Classified(Outcome.SUCCEEDED, "x"), Answer(status=200),
                     config(**POINTS), NOW, Costs(actual=1e300, available=None))
    assert got.refund == -100.0  # burst 1,000 points / 10 per call
