"""PNG charts of a benchmark document (matplotlib, from the optional `bench` extra).

One chart per benchmark that has a plotter below; each reads only its own JSON section, so
a benchmark without a chart (or a section of an older shape) is skipped, never fatal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Section = dict[str, Any]


def _median(value: Any) -> float:
    if isinstance(value, dict):
        return float(value.get("median") or 0)
    return float(value or 0)


def _drain(ax: Any, section: Section) -> None:
    for mode, by_concurrency in sorted(section.get("results", {}).items()):
        points = sorted((int(c), _median(v["items_per_s"])) for c, v in by_concurrency.items())
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
    target = section.get("target", {}).get("items_per_s")
    if target:
        ax.axhline(target, linestyle="--", color="grey", label=f"target {target}/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent claims (workers)")
    ax.set_ylabel("items drained per second (median)")
    ax.set_title("Drain throughput")


def _budget(ax: Any, section: Section) -> None:
    configs = section.get("configurations", [])
    budgets = sorted({c["budget_per_second"] for c in configs})
    replicas = sorted({c["replicas"] for c in configs})
    width = 0.8 / max(1, len(replicas))
    for i, r in enumerate(replicas):
        values = [next((_median(c["achieved_percent"]) for c in configs
                        if c["budget_per_second"] == b and c["replicas"] == r), 0.0)
                  for b in budgets]
        ax.bar([x + i * width for x in range(len(budgets))], values, width,
               label=f"{r} replica(s)")
    ax.axhline(98, linestyle="--", color="grey", label="target 98%")
    ax.set_xticks([x + width * (len(replicas) - 1) / 2 for x in range(len(budgets))],
                  [f"{b}/s" for b in budgets])
    ax.set_xlabel("budget")
    ax.set_ylabel("2xx calls / what the budget allows (%)")
    ax.set_title("Budget precision")


def _registration(ax: Any, section: Section) -> None:
    configs = section.get("configurations", [])
    labels = [f"{c['clients']} client(s)" for c in configs]
    xs = range(len(configs))
    ax.bar([x - 0.2 for x in xs], [_median(c["fresh_items_per_second"]) for c in configs],
           0.4, label="new items")
    ax.bar([x + 0.2 for x in xs], [_median(c["again_items_per_second"]) for c in configs],
           0.4, label="same items again")
    target = section.get("target_items_per_second")
    if target:
        ax.axhline(target, linestyle="--", color="grey", label=f"target {target}/s")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("items registered per second (median)")
    ax.set_title(f"Registration, {section.get('batch')} items per request")


def _publication(ax: Any, section: Section) -> None:
    runs = section.get("runs", [])
    ax.bar([f"run {i + 1}" for i in range(len(runs))],
           [r["published_seconds"] for r in runs], label="published after (s)")
    ax.plot([f"run {i + 1}" for i in range(len(runs))],
            [r["trigger_answer_seconds"] for r in runs], "o", color="black",
            label="trigger answered after (s)")
    ax.axhline(30, linestyle="--", color="grey", label="target 30 s")
    ax.set_ylabel("seconds")
    ax.set_title(f"Publication of {section.get('items'):,} due items")


def _history(ax: Any, section: Section) -> None:
    configs = section.get("configurations", [])
    labels = [f"{c['history_rows']:,} finished" for c in configs]
    values = [_median(c["items_per_s"]) for c in configs]
    pruning = section.get("pruning") or {}
    if pruning.get("drains_during_pruning"):
        labels.append(f"{pruning['rows']:,}, pruning")
        values.append(_median(pruning["items_per_s"]))
    ax.bar(labels, values, label="drain items/s (median)")
    if values:
        ax.axhline(0.9 * values[0], linestyle="--", color="grey",
                   label="target: 90% of the smallest history")
    ax.set_ylabel("items drained per second")
    ax.set_title("Claim cost against finished history")


def _memory(ax: Any, section: Section) -> None:
    for i, run in enumerate(section.get("runs", [])):
        samples = run.get("samples", [])
        ax.plot([s["calls"] for s in samples], [s["rss_mb"] for s in samples],
                label=f"run {i + 1}: RSS (peak {run.get('peak_rss_mb')} MB)")
    target = section.get("target_peak_rss_mb")
    if target:
        ax.axhline(target, linestyle="--", color="grey", label=f"target {target} MB")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("items called")
    ax.set_ylabel("worker resident set (MB)")
    ax.set_title("One replica's memory while draining")


def _backlog(ax: Any, section: Section) -> None:
    pages = ax.twinx()
    for i, run in enumerate(section.get("runs", [])):
        samples = run.get("samples", [])[1:]
        done = [s["completed"] for s in samples]
        line = ax.plot(done, [s["items_per_s"] for s in samples],
                       label=f"run {i + 1}: items/s")[0]
        pages.plot(done, [s["pages_per_scan"].get("items_ready") for s in samples], ":",
                   color=line.get_color(), label=f"run {i + 1}: claim index pages/scan")
    ax.set_ylim(bottom=0)
    pages.set_ylim(bottom=0)
    ax.set_xlabel("items completed")
    ax.set_ylabel("items drained per second (solid)")
    pages.set_ylabel("claim index pages read per scan (dotted)")
    pages.legend(loc="upper right", fontsize="small")
    ax.set_title(f"One drain of {section.get('parameters', {}).get('items', 0):,} items")


def _console(ax: Any, section: Section) -> None:
    pages = section.get("pages", {})
    labels = list(pages)
    cells = [pages[name]["p95_ms"] for name in labels]
    viewers = section.get("viewers") or {}
    if viewers.get("p95_ms"):
        labels.append(f"overview, {viewers.get('viewers')} viewers at once")
        cells.append(viewers["p95_ms"])
    target = float((section.get("target") or {}).get("p95_ms_below") or 200)
    values = [_median(c) for c in cells]
    low = [max(0.0, v - float(c.get("min") or v)) for v, c in zip(values, cells, strict=True)]
    high = [max(0.0, float(c.get("max") or v) - v) for v, c in zip(values, cells, strict=True)]
    ys = list(range(len(labels)))
    ax.barh(ys, values, xerr=[low, high], capsize=3, label="p95 (median; range of repetitions)",
            color=["tab:red" if v >= target else "tab:blue" for v in values])
    cold = [(y, _median(pages[name]["cold"]["p95_ms"])) for y, name in enumerate(pages)
            if (pages[name].get("cold") or {}).get("p95_ms")]
    if cold:
        ax.plot([c[1] for c in cold], [c[0] for c in cold], "kx", markersize=8,
                label="p95 with nothing shared (requests 5 s apart)")
    ax.axvline(target, linestyle="--", color="grey", label=f"target {target:.0f} ms")
    ax.set_yticks(ys, labels, fontsize="small")
    ax.invert_yaxis()
    if max([*values, *(c[1] for c in cold)], default=0.0) > 10 * target:
        ax.set_xscale("log")
    ax.set_xlabel("ms to the whole answer, 95th percentile")
    items = (section.get("parameters") or {}).get("items", 0)
    ax.set_title(f"Console pages with {items:,} items in the ledger")


PLOTTERS: dict[str, Callable[[Any, Section], None]] = {
    "drain": _drain, "budget": _budget, "registration": _registration,
    "publication": _publication, "history": _history, "backlog": _backlog,
    "memory": _memory, "console": _console}


def write_charts(doc: dict[str, Any], folder: Path) -> list[Path]:
    """One PNG per benchmark section with a plotter; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written = []
    for name, section in doc.get("benchmarks", {}).items():
        plotter = PLOTTERS.get(name)
        if plotter is None:
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        try:
            plotter(ax, section)
            ax.legend(loc="best", fontsize="small")
            ax.grid(True, alpha=0.3)
            fig.tight_layout()
            path = folder / f"{name}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
        finally:
            plt.close(fig)
    return written
