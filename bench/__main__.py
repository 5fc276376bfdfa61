"""``python -m bench <benchmark|all> [options]``: run benchmarks, write one JSON document.

    python -m bench drain --items 20000 --repeat 3 --concurrency 16,64,256 --json-out out.json
    python -m bench all --json-out out.json

The database server is --database-url, else SWEEPER_BENCH_DATABASE_URL, else
SWEEPER_TEST_DATABASE_URL, else an embedded PostgreSQL started for the run and deleted after.
Each benchmark creates and drops its own `sweeper_bench_*` databases on it.

To add a benchmark (publication, registration, budget precision, webhook intake...): write
`bench/<name>.py` exposing ``BENCHMARK = Benchmark(name, help, add_arguments, run)`` where
``run(ctx, args)`` returns its JSON section, and list it in BENCHMARKS below. It then gets its
own subcommand and runs as part of `all`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from bench import (
    backlog,
    budget,
    bulk,
    console,
    drain,
    history,
    holds,
    itemcost,
    memory,
    peers,
    points,
    publication,
    realistic,
    registration,
    stores,
    webhooks,
)
from bench.common import (
    BenchContext,
    Benchmark,
    code_digest,
    database_server,
    machine_info,
    progress,
    utc_now,
)

BENCHMARKS: tuple[Benchmark, ...] = (drain.BENCHMARK, budget.BENCHMARK, registration.BENCHMARK,
                                      publication.BENCHMARK, webhooks.BENCHMARK,
                                      history.BENCHMARK, backlog.BENCHMARK, memory.BENCHMARK,
                                      points.BENCHMARK, bulk.BENCHMARK, peers.BENCHMARK,
                                      stores.BENCHMARK, console.BENCHMARK, holds.BENCHMARK,
                                      realistic.BENCHMARK, itemcost.BENCHMARK)


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3,
                        help="repetitions per configuration; medians are reported (default 3)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="write the JSON document here (default: stdout)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="write results.json and one PNG chart per benchmark here "
                             "(charts need the `bench` extra: pip install -e '.[bench]')")
    parser.add_argument("--database-url", default=None,
                        help="postgresql:// URL of a maintenance database on the server to use")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="event loop (default asyncio, as `sweeper worker` runs)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="BENCHMARK")
    for bench in BENCHMARKS:
        p = sub.add_parser(bench.name, help=bench.help)
        add_common(p)
        bench.add_arguments(p)
    every = sub.add_parser("all", help="every benchmark with its defaults")
    add_common(every)
    return parser


def benchmark_args(bench: Benchmark, common: argparse.Namespace) -> argparse.Namespace:
    """A benchmark's defaults, with the common options of an `all` run applied."""
    parser = argparse.ArgumentParser(prog=f"python -m bench {bench.name}")
    add_common(parser)
    bench.add_arguments(parser)
    ns = parser.parse_args([])
    for key in ("repeat", "json_out", "results_dir", "database_url", "loop"):
        setattr(ns, key, getattr(common, key))
    return ns


async def run_all(selected: list[tuple[Benchmark, argparse.Namespace]], server_url: str,
                  server_source: str, argv: Sequence[str]) -> dict[str, Any]:
    ctx = BenchContext(server_url=server_url, server_source=server_source)
    doc: dict[str, Any] = {"schema": 1, "command": ["python", "-m", "bench", *argv],
                           "started_at": utc_now(),
                           "machine": await machine_info(server_url, server_source),
                           "code": code_digest(ctx.repo_root),
                           "benchmarks": {}}
    for bench, args in selected:
        progress(f"benchmark {bench.name}")
        doc["benchmarks"][bench.name] = await bench.run(ctx, args)
    doc["finished_at"] = utc_now()
    return doc


def run_loop(main: Coroutine[Any, Any, dict[str, Any]], loop: str) -> dict[str, Any]:
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    if args.command == "all":
        selected = [(b, benchmark_args(b, args)) for b in BENCHMARKS]
    else:
        selected = [(next(b for b in BENCHMARKS if b.name == args.command), args)]
    with database_server(args.database_url) as (server_url, source):
        doc = run_loop(run_all(selected, server_url, source, argv), args.loop)
    rendered = json.dumps(doc, indent=2, default=str)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(rendered + "\n", encoding="utf-8")
        progress(f"wrote {args.json_out}")
    if args.results_dir is not None:
        write_results(doc, rendered, args.results_dir)
    if args.json_out is None and args.results_dir is None:
        print(rendered)
    return 0


def write_results(doc: dict[str, Any], rendered: str, folder: Path) -> None:
    """results.json plus the charts, when matplotlib is installed."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(rendered + "\n", encoding="utf-8")
    progress(f"wrote {folder / 'results.json'}")
    try:
        from bench.plots import write_charts

        for path in write_charts(doc, folder):
            progress(f"wrote {path}")
    except ImportError:
        progress("no charts: matplotlib is not installed (pip install -e '.[bench]')")


if __name__ == "__main__":
    sys.exit(main())
