"""The console's charts and overview are read once per few seconds per process, whatever the
number of viewers: concurrent viewers share one reading, a failed reading is not kept, and
the kept readings are bounded."""

from __future__ import annotations

import asyncio

import pytest

from service.http.console import overview
from service.http.console.overview import SharedReadings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_viewers_share_a_reading_until_it_is_too_old() -> None:
    clock, reads = Clock(), 0
    gate = asyncio.Event()

    async def read() -> dict[str, int]:
        nonlocal reads
        reads += 1
        await gate.wait()
        return {"reading": reads}

    charts = SharedReadings(max_age_s=5.0, monotonic=clock)
    viewers = [asyncio.create_task(charts.get("/c/outcomes?window=hour", read))
               for _ in range(8)]
    await asyncio.sleep(0)
    gate.set()
    assert [await v for v in viewers] == [{"reading": 1}] * 8
    clock.now = 4.9
    assert await charts.get("/c/outcomes?window=hour", read) == {"reading": 1}
    assert await charts.get("/c/outcomes?window=day", read) == {"reading": 2}  # another chart
    clock.now = 5.0
    assert await charts.get("/c/outcomes?window=hour", read) == {"reading": 3}
    assert charts.readings == 3


async def test_a_failed_reading_is_read_again_and_the_kept_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    failures = [OSError("database went away")]

    async def read() -> str:
        if failures:
            raise failures.pop()
        return "ok"

    charts = SharedReadings(5.0, monotonic=Clock())
    with pytest.raises(OSError, match="went away"):
        await charts.get("k", read)
    assert await charts.get("k", read) == "ok"
    monkeypatch.setattr(overview, "READING_KEYS", 3)
    for i in range(5):
        await charts.get(f"k{i}", read)
    assert len(charts._kept) == 3
