"""The leader's sampling of the backlog into the ledger's minutes: each policy's eligible
items and the age of the oldest, once per SAMPLE_EVERY_S, read through the metrics' cached
ledger snapshot (a scrape in the same moments reads the database once for both)."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.history import minutes
from service.ledger.gauges import LedgerCollector
from service.observability.failures import repeat

log = logging.getLogger(__name__)

SAMPLE_EVERY_S: Final = 30.0  # two samples a minute: a missed one leaves no hole


async def sample_once(engine: AsyncEngine, collector: LedgerCollector,
                      policies: Collection[str]) -> None:
    """Record every configured policy's backlog now (none eligible: 0)."""
    await collector.refresh()
    snap = collector.snapshot
    if not snap.up:  # the ledger could not be read: nothing to record
        return
    names = set(policies) | set(snap.eligible)
    await minutes.sample(engine, {p: (snap.eligible.get(p, 0), snap.oldest_eligible_s.get(p, 0.0))
                                  for p in names})


async def sampling_loop(engine: AsyncEngine, collector: LedgerCollector,
                        policies: Collection[str]) -> None:
    """Sample, sleep SAMPLE_EVERY_S, repeat until cancelled; outages are retried."""
    await repeat(lambda: sample_once(engine, collector, policies), every_s=SAMPLE_EVERY_S,
                 what="minutes sampling", logger=log)
