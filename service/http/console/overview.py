"""The console's overview, read at most once per OVERVIEW_MAX_AGE_S per process and shared
by every viewer: however many browsers poll it, the ledger sees one reading per interval.
The charts' series are shared the same way (`SharedReadings`, CHART_MAX_AGE_S).

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
READING_KEYS: Final = 256  # readings kept at most (charts by path and query)


@dataclass(frozen=True)
class Overview:
    """One reading of everything the overview shows."""

    ledger: LedgerSnapshot
    policies: list[dict[str, Any]]
    succeeded_per_second: float
    scopes: list[dict[str, Any]]
    runs: list[dict[str, Any]]


class SharedReadings:
    """Readings by key, each read at most once per `max_age_s` (on `monotonic`, seconds)
    per process, whatever the number of viewers polling it: a reading in progress is
    awaited by the others, a failed one is not kept. At most READING_KEYS are kept."""

    def __init__(self, max_age_s: float, monotonic: Callable[[], float] = time.monotonic
                 ) -> None:
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
            while len(self._kept) > READING_KEYS:
                del self._kept[next(iter(self._kept))]
        # shielded: a viewer that goes away does not cancel the reading the others await
        return await asyncio.shield(kept[1])


class OverviewCache:
    """The last Overview, shared (a SharedReadings of one key)."""

    def __init__(self, max_age_s: float = OVERVIEW_MAX_AGE_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._shared = SharedReadings(max_age_s, monotonic)

    @property
    def readings(self) -> int:
        return self._shared.readings

    async def get(self, runtime: Runtime) -> Overview:
        overview: Overview = await self._shared.get("overview", lambda: _read(runtime))
        return overview


async def _read(runtime: Runtime) -> Overview:
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
                    scopes=await operator_reads.troubled_scopes(runtime.engine), runs=recent)

