"""Every benchmark with a plotter draws a PNG from its JSON section."""

from __future__ import annotations

from pathlib import Path

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
    "no-plotter": {"anything": 1},
}}


def test_each_plotter_writes_a_png(tmp_path: Path) -> None:
    written = write_charts(DOC, tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{n}.png" for n in PLOTTERS)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 5_000
