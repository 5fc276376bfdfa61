"""The budget's pure rules (service/budget/rules.py): fair shares and jitter; and the
upstream's quota headers."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.budget.rules import fair_shares, jitter_for
from service.outcomes import exhausted_for

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_a_small_scope_gets_a_share_beside_a_huge_one() -> None:
    assert fair_shares([("huge", 1), ("small", 1)], 10) == {"huge": 5, "small": 5}


def test_weights_divide_the_slots() -> None:
    assert fair_shares([("a", 3), ("b", 1)], 8) == {"a": 6, "b": 2}


def test_more_scopes_than_slots_serve_the_first_ones() -> None:
    assert fair_shares([("a", 1), ("b", 1), ("c", 1)], 2) == {"a": 1, "b": 1}


@given(st.lists(st.tuples(st.text(min_size=1), st.integers(1, 1000)), min_size=1,
                max_size=20, unique_by=lambda t: t[0]), st.integers(1, 500))
def test_shares_use_every_slot_and_never_more(scopes: list[tuple[str, int]], free: int
                                              ) -> None:
    shares = fair_shares(scopes, free)
    assert sum(shares.values()) == free
    assert all(n >= 1 for n in shares.values())
    assert len(shares) == min(free, len(scopes))


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"ratelimit": '"default";r=0;t=7'}, 7.0),
        ({"ratelimit": '"default";r=3;t=7'}, None),
        ({"ratelimit": "limit=100, remaining=0, reset=5"}, 5.0),
        ({"ratelimit-remaining": "0", "ratelimit-reset": "12"}, 12.0),
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "30"}, 30.0),
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(int(NOW.timestamp()) + 9)},
         9.0),
        ({"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(int(NOW.timestamp()) - 9)},
         0.0),
        ({"x-ratelimit-remaining": "4", "x-ratelimit-reset": "30"}, None),
        ({"x-ratelimit-remaining": "zero", "x-ratelimit-reset": "30"}, None),
        ({"x-ratelimit-remaining": "0"}, None),
        ({}, None),
    ],
)
def test_quota_headers(headers: dict[str, str], expected: float | None) -> None:
    assert exhausted_for(headers, NOW) == expected


@given(st.dictionaries(st.sampled_from(["ratelimit", "ratelimit-remaining", "ratelimit-reset",
                                        "x-ratelimit-remaining", "x-ratelimit-reset"]),
                       st.text()))
def test_quota_headers_never_raise(headers: dict[str, str]) -> None:
    got = exhausted_for(headers, NOW)
    assert got is None or got >= 0


@given(st.none() | st.floats(0, 86_400), st.floats(0.01, 100))
def test_jitter_stays_small_and_after_the_permitted_moment(delay: float | None, base: float
                                                           ) -> None:
    import random

    j = jitter_for(delay, base, random.Random(0))
    assert 0.0 <= j <= 1.0
    assert j <= 0.1 * (delay if delay is not None else base) + 1e-9
