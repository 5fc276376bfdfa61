"""`python -m bench.realistic_worker [--off RULE ...]`: `sweeper worker` (the same settings,
the same code) with some of the worker's hot-path rules switched off, for the realistic
benchmark's on/off comparisons (bench/realistic.py).

Each switch sets a module constant the product reads at run time, or takes a path the product
already has, before the worker starts; nothing here changes what a rule does when it is on.
Benchmarks only: this is how a measurement asks "what if the rule were not there", not a
setting anyone should deploy.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

NEVER_MATCHES = re.compile(r"(?!)")


def _no_claim_ahead() -> None:
    """Claim for the free slots only: the running mean of calls freed per claim stays 0, so
    `CallLimit.claimable` is the limit itself."""
    from service.worker import pacing

    pacing.FREED_WEIGHT = 0.0  # type: ignore[misc]


def _no_scope_reuse() -> None:
    """Ask which scopes have work every round: a cached list is always too old."""
    from service.worker import pacing

    pacing.ELIGIBLE_REUSE_S = -1.0  # type: ignore[misc]


def _no_late_halving() -> None:
    """The calls allowed in flight never drop below `concurrency` after a late start."""
    from service.worker import pacing

    pacing.MIN_CALLS_IN_FLIGHT = 10**9  # type: ignore[misc]


def _no_grouped_writes() -> None:
    """One completion (and one hand-back) per statement, flushed as soon as it waits."""
    from service.worker import pending_writes

    pending_writes.WRITES_PER_FLUSH = 1  # type: ignore[misc]


def _no_round_cap() -> None:
    """A round claims as many items as there are free slots, from as many scopes."""
    from service.worker import pool

    pool.MAX_ITEMS_PER_ROUND = 100_000  # type: ignore[misc]
    pool.SCOPES_ASKED = 100_001  # type: ignore[misc]


def _no_held_connections() -> None:
    """Every admission and completion statement checks out a pooled connection (the path the
    ledger ports take outside a running loop) instead of the pool's two held ones."""
    from service.worker import postgres

    @contextlib.asynccontextmanager
    async def hold_nothing(self: postgres.PostgresLedger) -> AsyncIterator[None]:
        yield

    postgres.PostgresLedger.hold = hold_nothing  # type: ignore[method-assign]


def _no_target_bytes() -> None:
    """Every call's URL parsed by httpx.URL, as for a path that is not plain."""
    from service.upstreams import request_urls

    request_urls._PLAIN_PATH = NEVER_MATCHES  # type: ignore[misc]


def _no_proxy_cache() -> None:
    """The environment's proxy looked up on every call: the transport's per-host route map
    forgets what it is told."""
    from service.protocols import transport

    class Forgetful(dict[Any, Any]):
        def __setitem__(self, key: Any, value: Any) -> None:
            pass

    original = transport.Http1Transport.__init__

    def init(self: transport.Http1Transport, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._routes = Forgetful()

    transport.Http1Transport.__init__ = init  # type: ignore[method-assign]


def _no_fresh_wait() -> None:
    """A new connection writes its first request at once (two turns of the loop only)."""
    from service.protocols import transport

    transport.FRESH_WAIT_MIN_S = 0.0  # type: ignore[misc]
    transport.FRESH_WAIT_MAX_S = 0.0  # type: ignore[misc]


# name -> (the rule switched off, as design-notes.md names it; the switch)
SWITCHES: dict[str, tuple[str, Callable[[], None]]] = {
    # the same worker through this launcher with nothing off: an A/A control, whose spread
    # against `on` is what the machine's noise alone does to a comparison
    "control": ("Nothing switched off (an A/A control)", lambda: None),
    "claim-ahead": ("Claiming ahead of free slots (pacing.FREED_WEIGHT = 0)",
                    _no_claim_ahead),
    "scope-reuse": ("Reusing a complete list of scopes with work (ELIGIBLE_REUSE_S = -1)",
                    _no_scope_reuse),
    "late-halving": ("Fewer calls in flight after a late start (MIN_CALLS_IN_FLIGHT = "
                     "10**9)", _no_late_halving),
    "grouped-writes": ("Grouped writes (WRITES_PER_FLUSH = 1)", _no_grouped_writes),
    "round-cap": ("At most 64 items a round (MAX_ITEMS_PER_ROUND = 100,000)", _no_round_cap),
    "held-connections": ("Admissions and completions on held connections (a pooled "
                         "checkout per statement)", _no_held_connections),
    "target-bytes": ("Target bytes instead of a URL parse (every URL parsed)",
                     _no_target_bytes),
    "proxy-once": ("A host's proxy chosen once (looked up per call)", _no_proxy_cache),
    "fresh-wait": ("A new connection's fresh wait (FRESH_WAIT_MIN_S = FRESH_WAIT_MAX_S = 0)",
                   _no_fresh_wait),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.realistic_worker",
                                     description=__doc__)
    parser.add_argument("--off", action="append", default=[], choices=sorted(SWITCHES),
                        help="a rule to switch off (repeatable)")
    args = parser.parse_args(argv)
    for name in args.off:
        SWITCHES[name][1]()
    from service.commands.cli import main as sweeper

    return sweeper(["worker"])


if __name__ == "__main__":
    sys.exit(main())
