"""Medians of an interleaved before/after drain set: `python3 summarize.py DIR`, where DIR
holds interleave.sh's before-N.json and after-N.json (one mock repetition each)."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

FIELDS = ("items_per_s", "database_cpu_us_per_item", "cpu_us_per_item")


def main(folder: Path) -> None:
    runs: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for path in sorted(folder.glob("*.json")):
        found = re.fullmatch(r"(before|after)-(\d+)\.json", path.name)
        if found is None:
            continue
        side, pair = found.group(1), int(found.group(2))
        results = json.loads(path.read_text())["benchmarks"]["drain"]["results"]["mock"]
        for concurrency, cell in results.items():
            rep = cell["repetitions"][0]
            runs.setdefault((concurrency, side), {})[pair] = {
                **{f: rep[f] for f in FIELDS}, "complete_ms": rep["complete"]["wall_ms_mean"]}
    for concurrency in sorted({c for c, _ in runs}, key=int):
        medians = {}
        for side in ("before", "after"):
            cells = runs[(concurrency, side)].values()
            medians[side] = {k: statistics.median(c[k] for c in cells)
                             for k in (*FIELDS, "complete_ms")}
            ips = [c["items_per_s"] for c in cells]
            print(f"c={concurrency} {side}: n={len(ips)} items/s median "
                  f"{medians[side]['items_per_s']:.1f} (min {min(ips):.1f}, max {max(ips):.1f}); "
                  f"database cpu us/item {medians[side]['database_cpu_us_per_item']:.1f}; "
                  f"worker cpu us/item {medians[side]['cpu_us_per_item']:.1f}; "
                  f"completion ms/call {medians[side]['complete_ms']:.2f}")
        before, after = runs[(concurrency, "before")], runs[(concurrency, "after")]
        ratios = [after[p]["items_per_s"] / before[p]["items_per_s"]
                  for p in sorted(before) if p in after]
        print(f"c={concurrency} after/before: ratio of medians "
              f"{medians['after']['items_per_s'] / medians['before']['items_per_s']:.3f}, "
              f"median of per-pair ratios {statistics.median(ratios):.3f} "
              f"({' '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
