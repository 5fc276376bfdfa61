"""The backlog benchmark's arithmetic: throughput of a drain's first and last tenth, read
off samples taken every few seconds."""

from __future__ import annotations

from typing import Any

import pytest

from bench.backlog import last_reading, tenths, time_at


def samples(points: list[tuple[float, int]]) -> list[dict[str, Any]]:
    return [{"seconds": s, "completed": c} for s, c in points]


def test_a_steady_drain_keeps_its_pace() -> None:
    steady = samples([(float(t), 1000 * t) for t in range(11)])
    assert tenths(steady, 10_000) == {"first_tenth_items_per_s": 1000.0,
                                      "last_tenth_items_per_s": 1000.0, "last_to_first": 1.0}


def test_a_slowing_drain_is_measured_between_samples() -> None:
    # 2,000/s for the first 5 s, then 500/s: tenths of 1,250 items fall between samples
    slowing = samples([(0.0, 0), (5.0, 10_000), (10.0, 12_500)])
    assert time_at(slowing, 1_250) == pytest.approx(0.625)
    assert time_at(slowing, 11_250) == pytest.approx(7.5)
    assert tenths(slowing, 12_500) == {"first_tenth_items_per_s": 2000.0,
                                       "last_tenth_items_per_s": 500.0, "last_to_first": 0.25}


def test_the_last_reading_skips_samples_without_a_scan() -> None:
    readings = [{"pages_per_scan": {"items_ready": v}} for v in (None, 3.0, 7.5, None)]
    assert last_reading(readings, "items_ready") == 7.5
    assert last_reading(readings, "items_leased") is None
