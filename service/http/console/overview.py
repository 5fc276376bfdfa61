"""The console's overview, read at most once per OVERVIEW_MAX_AGE_S per process and shared
by every viewer: however many browsers poll it, the ledger sees one reading per interval.

Its parts come from the caches that already exist (the metrics' ledger snapshot: backlog
age, eligible and dead items per policy, workers paused; the run progress cache: recent
runs) and two bounded reads of its own (succeeded per second over a short window through
the finished-items index, and the closed or paused scopes with their reasons)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from service.ledger import operator_reads
from service.ledger.gauges import LedgerSnapshot
from service.runs import progress
from service.runtime import Runtime

OVERVIEW_MAX_AGE_S: Final = 2.0
RECENT_RUNS: Final = 8
CHART_MAX_AGE_S: Final = 5.0  # the minutes change every 10 s (service/history/tally.py)
CHART_KEYS: Final = 256


@dataclass(frozen=True)
class Overview:
    """One reading of everything the overview shows."""

    ledger: LedgerSnapshot
    policies: list[dict[str, Any]]
    succeeded_per_second: float
    scopes: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    read_at: float  # on the cache's monotonic clock, when the reading was done


class OverviewCache:
    """The last Overview, shared; one reading at a time, readers arriving meanwhile wait.
    Ages are read on `monotonic` (seconds)."""

    def __init__(self, max_age_s: float = OVERVIEW_MAX_AGE_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.readings = 0  # since the process started
        self._monotonic = monotonic
        self._last: Overview | None = None
        self._lock = asyncio.Lock()

    async def get(self, runtime: Runtime) -> Overview:
        async with self._lock:
            last = self._last
            if last is None or self._monotonic() - last.read_at >= self.max_age_s:
                last = self._last = await _read(runtime, self._monotonic)
                self.readings += 1
            return last


async def _read(runtime: Runtime, monotonic: Callable[[], float]) -> Overview:
    collector = runtime.exporter.collector
    await collector.refresh()
    snap = collector.snapshot
    rates = await operator_reads.succeeded_per_second(runtime.engine)
    names = sorted(set(runtime.policies.policies) | set(snap.eligible) | set(snap.dead)
                   | set(rates))
    policies = [{"name": name,
                 "oldest_eligible_s": snap.oldest_eligible_s.get(name),
                 "eligible": snap.eligible.get(name, 0),
                 "leased": snap.leased.get(name, 0),
                 "dead": snap.dead.get(name, 0),
                 "held": snap.held.get(name, 0),
                 "succeeded_per_second": rates.get(name, 0.0)} for name in names]
    recent = await progress.list_runs(runtime.engine, limit=RECENT_RUNS, before=None,
                                      progress=runtime.run_progress, attempts=False)
    return Overview(ledger=snap, policies=policies,
                    succeeded_per_second=sum(rates.values()),
                    scopes=await operator_reads.troubled_scopes(runtime.engine), runs=recent,
                    read_at=monotonic())


class ChartReadings:
    """Each chart's series read at most once per `max_age_s` per process, whatever the
    number of viewers polling it: a reading in progress is awaited by the others, a failed
    one is not kept. At most CHART_KEYS charts (by path and query) are kept."""

    def __init__(self, max_age_s: float = CHART_MAX_AGE_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.readings = 0  # since the process started
        self._monotonic = monotonic
        self._kept: dict[str, tuple[float, asyncio.Future[Any]]] = {}

    async def get(self, key: str, read: Callable[[], Awaitable[Any]]) -> Any:
        now = self._monotonic()
        kept = self._kept.get(key)
        if kept is None or now - kept[0] >= self.max_age_s or (
                kept[1].done() and (kept[1].cancelled() or kept[1].exception() is not None)):
            self.readings += 1
            kept = (now, asyncio.ensure_future(read()))
            self._kept.pop(key, None)
            self._kept[key] = kept
            while len(self._kept) > CHART_KEYS:
                del self._kept[next(iter(self._kept))]
        # shielded: a viewer that goes away does not cancel the reading the others await
        return await asyncio.shield(kept[1])
