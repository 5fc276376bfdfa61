"""Medians of an interleaved before/after drain set.

    python3 summarize.py DIR            # interleave.sh's before-N.json / after-N.json
    python3 summarize.py DIR --compact  # also write DIR.pairs.json (what results/ keeps)
    python3 summarize.py results/segments-2.pairs.json

A run is one mock repetition of `python -m bench drain` per concurrency; the compact form
keeps, per pair, side and concurrency, the figures below and the load at the start.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

FIELDS = ("items_per_s", "database_cpu_us_per_item", "cpu_us_per_item",
          "load_average_1m_at_start")

Runs = dict[str, dict[str, dict[str, dict[str, float]]]]  # concurrency -> side -> pair


def read_folder(folder: Path) -> Runs:
    runs: Runs = {}
    for path in sorted(folder.glob("*.json")):
        found = re.fullmatch(r"(before|after)-(\d+)\.json", path.name)
        if found is None:
            continue
        side, pair = found.group(1), found.group(2)
        results = json.loads(path.read_text())["benchmarks"]["drain"]["results"]["mock"]
        for concurrency, cell in results.items():
            rep: dict[str, Any] = cell["repetitions"][0]
            runs.setdefault(concurrency, {}).setdefault(side, {})[pair] = {
                **{f: rep[f] for f in FIELDS}, "complete_ms": rep["complete"]["wall_ms_mean"]}
    return runs


def report(runs: Runs) -> None:
    for concurrency in sorted(runs, key=int):
        medians = {}
        for side in ("before", "after"):
            cells = runs[concurrency][side].values()
            medians[side] = {k: statistics.median(c[k] for c in cells)
                             for k in (*FIELDS, "complete_ms")}
            ips = [c["items_per_s"] for c in cells]
            print(f"c={concurrency} {side}: n={len(ips)} items/s median "
                  f"{medians[side]['items_per_s']:.1f} (min {min(ips):.1f}, max {max(ips):.1f}); "
                  f"database cpu us/item {medians[side]['database_cpu_us_per_item']:.1f}; "
                  f"worker cpu us/item {medians[side]['cpu_us_per_item']:.1f}; "
                  f"completion ms/call {medians[side]['complete_ms']:.2f}")
        before, after = runs[concurrency]["before"], runs[concurrency]["after"]
        ratios = [after[p]["items_per_s"] / before[p]["items_per_s"]
                  for p in sorted(before, key=int) if p in after]
        print(f"c={concurrency} after/before: ratio of medians "
              f"{medians['after']['items_per_s'] / medians['before']['items_per_s']:.3f}, "
              f"median of per-pair ratios {statistics.median(ratios):.3f} "
              f"({' '.join(f'{r:.2f}' for r in ratios)})")


def main(args: list[str]) -> None:
    source = Path(args[0])
    runs: Runs = json.loads(source.read_text()) if source.is_file() else read_folder(source)
    report(runs)
    if "--compact" in args and source.is_dir():
        Path(f"{source}.pairs.json").write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
