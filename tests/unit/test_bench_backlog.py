"""The backlog benchmark's arithmetic: throughput of a drain's first and last tenth, read
off samples taken every few seconds."""

from __future__ import annotations

from typing import Any

import pytest

from bench.backlog import last_reading, reading_at, tenth_costs, tenths


def samples(points: list[tuple[float, int]]) -> list[dict[str, Any]]:
    return [{"seconds": s, "completed": c} for s, c in points]


def test_a_steady_drain_keeps_its_pace() -> None:
    steady = samples([(float(t), 1000 * t) for t in range(11)])
    assert tenths(steady, 10_000) == {"first_tenth_items_per_s": 1000.0,
                                      "last_tenth_items_per_s": 1000.0, "last_to_first": 1.0}


def test_a_slowing_drain_is_measured_between_samples() -> None:
    # 2,000/s for the first 5 s, then 500/s: tenths of 1,250 items fall between samples
    slowing = samples([(0.0, 0), (5.0, 10_000), (10.0, 12_500)])
    assert reading_at(slowing, 1_250) == pytest.approx(0.625)
    assert reading_at(slowing, 11_250) == pytest.approx(7.5)
    assert tenths(slowing, 12_500) == {"first_tenth_items_per_s": 2000.0,
                                       "last_tenth_items_per_s": 500.0, "last_to_first": 0.25}


def test_the_last_reading_skips_samples_without_a_scan() -> None:
    readings = [{"pages_per_scan": {"items_ready": v}} for v in (None, 3.0, 7.5, None)]
    assert last_reading(readings, "items_ready") == 7.5
    assert last_reading(readings, "items_unreleased") is None


def test_each_tenth_is_priced_per_item_on_both_sides() -> None:
    # the database's time per item doubles after 5,000 items; the worker's CPU stays flat
    points = [(0.0, 0, 100.0, 2.0), (5.0, 5_000, 100.0 + 5_000 * 0.4, 2.0 + 5_000 * 50e-6),
              (10.0, 10_000, 100.0 + 5_000 * 0.4 + 5_000 * 0.8, 2.0 + 10_000 * 50e-6)]
    drain = [{"seconds": t, "completed": c, "db_active_ms": db, "worker_cpu_s": cpu}
             for t, c, db, cpu in points]
    costs = tenth_costs(drain, 10_000)
    assert costs["db_ms_per_item"] == {"first_tenth": 0.4, "last_tenth": 0.8,
                                       "last_to_first": 2.0}
    assert costs["worker_cpu_us_per_item"] == pytest.approx(
        {"first_tenth": 50.0, "last_tenth": 50.0, "last_to_first": 1.0})
