"""Every benchmark with a plotter draws a PNG from its JSON section."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.plots import PLOTTERS, write_charts

DOC = {"benchmarks": {
    "drain": {"results": {"mock": {"64": {"items_per_s": {"median": 2000.0}},
                                   "256": {"items_per_s": {"median": 2100.0}}},
                          "loopback": {"64": {"items_per_s": {"median": 400.0}}}},
              "target": {"items_per_s": 5000}},
    "budget": {"configurations": [
        {"replicas": r, "budget_per_second": b, "achieved_percent": {"median": 97.0}}
        for r in (1, 2) for b in (10, 100)]},
    "registration": {"batch": 10000, "target_items_per_second": 50000, "configurations": [
        {"clients": 1, "fresh_items_per_second": {"median": 21000.0},
         "again_items_per_second": {"median": 30000.0}}]},
    "publication": {"items": 1000, "runs": [
        {"published_seconds": 1.5, "trigger_answer_seconds": 0.02}]},
    "history": {"configurations": [
        {"history_rows": 10_000, "items_per_s": {"median": 9000.0}},
        {"history_rows": 10_000_000, "items_per_s": {"median": 8500.0}}],
        "pruning": {"rows": 10_000_000, "items_per_s": {"median": 8000.0},
                    "drains_during_pruning": [{"items_per_s": 8000.0}]}},
    "backlog": {"parameters": {"items": 1_000_000}, "runs": [
        {"samples": [{"completed": n, "items_per_s": 12000.0 - n / 100,
                      "pages_per_scan": {"items_ready": n / 450 or None}}
                     for n in range(0, 1_000_001, 100_000)]}]},
    "memory": {"target_peak_rss_mb": 200, "runs": [
        {"peak_rss_mb": 90.0, "samples": [{"calls": n, "rss_mb": 80.0 + n / 1e5}
                                          for n in range(0, 1_000_001, 100_000)]}]},
    "console": {"parameters": {"items": 1_000_000}, "target": {"p95_ms_below": 200},
                "pages": {name: {"p95_ms": {"median": p95, "min": p95 * 0.9, "max": p95 * 1.2},
                                 "cold": {"p95_ms": {"median": p95 * 8}}}
                          for name, p95 in (("overview", 5.0), ("runs", 9.0),
                                            ("items-pending", 6.0))},
                "viewers": {"viewers": 8, "p95_ms": {"median": 27.0, "min": 24.0,
                                                     "max": 31.0}}},
    "no-plotter": {"anything": 1},
}}


@pytest.mark.slow
def test_each_plotter_writes_a_png(tmp_path: Path) -> None:
    written = write_charts(DOC, tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{n}.png" for n in PLOTTERS)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 5_000
