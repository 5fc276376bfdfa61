"""Unexpected errors that a long-running loop catches and survives.

A loop that must keep going (a worker's flush, the LISTEN connection, the leader's
election) catches what it did not expect, but never silently: each one is counted in
`sweeper_internal_errors_total{where}` and logged with its class, once per kind (place and
class) per LOG_AGAIN_S, so a bug that fires a thousand times a second is one line, not a
thousand. The line names the class and the code location that raised it, never the
exception's text, which may quote request values (an object id, a tenant, SQL parameters).

The database being out of reach or busy (`service.db.engine.is_unavailable` / `is_busy`)
is expected, not internal: callers report those as the outage they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from service.db.engine import is_busy, is_unavailable
from service.observability.metrics import INTERNAL_ERRORS, Where

LOG_AGAIN_S: Final = 300.0  # a kind already logged is logged again after this long


def expected(exc: BaseException) -> bool:
    """An outage the caller reports as one: the database unavailable or busy."""
    return is_unavailable(exc) or is_busy(exc)


def _origin(exc: BaseException) -> str:
    """Where the error was raised: module file and line of the innermost frame."""
    tb = exc.__traceback__
    if tb is None:
        return "unknown"
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}"


class InternalErrors:
    """One owner's (a pool's, an elector's) record of the kinds it has logged."""

    def __init__(self, logger: logging.Logger,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._monotonic = monotonic
        self._logged: dict[tuple[Where, str], float] = {}

    def caught(self, where: Where, exc: BaseException, **extra: object) -> None:
        """Count `exc`, caught at `where`, and log it if its kind was not logged lately.
        `extra` adds fields that carry no request values (counts, names of our own)."""
        INTERNAL_ERRORS.labels(where).inc()
        kind = (where, type(exc).__name__)
        now = self._monotonic()
        last = self._logged.get(kind)
        if last is not None and now - last < LOG_AGAIN_S:
            return
        self._logged[kind] = now
        self._log.error("internal error", extra={
            "where": where.value, "error_type": type(exc).__name__, "origin": _origin(exc),
            **extra})


async def repeat(step: Callable[[], Awaitable[object]], *, every_s: float, what: str,
                 logger: logging.Logger, where: Where = Where.MAINTENANCE) -> None:
    """Run `step`, sleep `every_s`, again until cancelled (a process's background loops). A
    database out of reach or busy is a warning and is tried again next time; any other
    failure is an internal error (counted, its kind logged) and is tried again too."""
    errors = InternalErrors(logger)
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if expected(exc):
                logger.warning("%s: database unavailable or busy", what)
            else:
                errors.caught(where, exc, loop=what)
        await asyncio.sleep(every_s)
