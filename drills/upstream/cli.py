"""The fake upstream as its own process: ``python -m drills.upstream --port 0 ...`` serves
until SIGTERM or SIGINT, prints its base URL and, with ``--ready-file``, writes it there."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from drills.upstream import control, faults, server
from drills.upstream.limits import RateLimits
from drills.upstream.server import FakeUpstream
from drills.upstream.tls import self_signed_context


def _write_ready_file(path: str, base_url: str) -> None:
    """Atomically: a reader never sees a half-written URL."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(base_url)
    os.replace(tmp, path)


def _latency(value: str) -> tuple[float, float]:
    """`--latency-ms 50-200` (or `100`) as seconds (low, high)."""
    low, _, high = value.partition("-")
    try:
        pair = (float(low) / 1000, float(high or low) / 1000)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected LOW-HIGH in ms, like 50-200"
                                         ) from None
    if not 0 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{value!r}: expected 0 <= LOW <= HIGH")
    return pair


async def _serve(args: argparse.Namespace) -> None:
    tls = self_signed_context(args.host, args.tls_cert_out) if args.tls_cert_out else None
    up = FakeUpstream(host=args.host, port=args.port, default_limit=args.default_limit,
                      default_burst=args.default_burst, default_window=args.default_window,
                      success_status=args.success_status, tls=tls, latency=args.latency_ms,
                      keep_calls=not args.count_only)
    await up.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if args.ready_file:
            _write_ready_file(args.ready_file, up.base_url)
        print(up.base_url, flush=True)
        await stop.wait()
    finally:
        await up.close()


def main(argv: list[str] | None = None) -> int:
    description = "\n".join(m.__doc__ or "" for m in (server, faults, control))
    ap = argparse.ArgumentParser(prog="python -m drills.upstream", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    ap.add_argument("--default-limit", type=float, default=None,
                    help="calls per second each scope may make (default: unlimited)")
    ap.add_argument("--default-burst", type=int, default=1,
                    help="token bucket size of --default-limit (default 1: a client whose "
                         "burst is larger is answered 429 for its bursts)")
    ap.add_argument("--default-window", action="store_true",
                    help="enforce --default-limit (a whole number) as at most that many calls "
                         "in any trailing second (a sliding window) instead of a token bucket")
    ap.add_argument("--success-status", type=int, default=204,
                    help="status of a successful deletion (default 204)")
    ap.add_argument("--tls-cert-out", type=Path, default=None,
                    help="serve HTTPS with a self-signed certificate made at start for "
                         "--host, written (without its key) to this file for clients to "
                         "trust as their CA file (default: plain HTTP)")
    ap.add_argument("--latency-ms", type=_latency, default=None,
                    help="delay each deletion call's answer by a time drawn uniformly from "
                         "LOW-HIGH milliseconds, e.g. 50-200 (default: answer at once)")
    ap.add_argument("--count-only", action="store_true",
                    help="count deletion calls without keeping them (GET /_control/calls "
                         "answers []; /_control/stats still counts): for long benchmarks")
    ap.add_argument("--ready-file", default=None,
                    help="write the base URL to this file once listening (default: none)")
    ap.add_argument("--log-level", default="WARNING", help="default WARNING")
    args = ap.parse_args(argv)
    try:
        RateLimits(args.default_limit, args.default_burst, args.default_window)
    except ValueError as exc:
        ap.error(str(exc))
    logging.basicConfig(level=args.log_level.upper())
    asyncio.run(_serve(args))
    return 0
