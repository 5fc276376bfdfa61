"""The fake upstream as its own process: ``python -m drills.upstream --port 0 ...`` serves
until SIGTERM or SIGINT, prints its base URL and, with ``--ready-file``, writes it there."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from drills.upstream import control, faults, server
from drills.upstream.limits import RateLimits
from drills.upstream.server import FakeUpstream


def _write_ready_file(path: str, base_url: str) -> None:
    """Atomically: a reader never sees a half-written URL."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(base_url)
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace) -> None:
    up = FakeUpstream(host=args.host, port=args.port, default_limit=args.default_limit,
                      default_burst=args.default_burst, default_window=args.default_window,
                      success_status=args.success_status)
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
