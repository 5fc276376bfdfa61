"""Run progress is counted over every item and attempt of a run, so the API shares one
count among its callers for a short while instead of counting per request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service import runs
from tests.integration.test_pipeline import make_policies, register, release_all


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each real count's run id, in order; each count takes at least 50 ms."""
    calls: list[int] = []
    real = runs.run_progress

    async def slow_count(engine: AsyncEngine, run_id: int) -> dict[str, Any]:
        calls.append(run_id)
        await asyncio.sleep(0.05)
        return await real(engine, run_id)

    monkeypatch.setattr(runs, "run_progress", slow_count)
    return calls


async def test_callers_share_one_count_until_it_is_too_old(engine: AsyncEngine,
                                                           counted: list[int]) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 30)
    run_id = await release_all(engine)
    cache = runs.ProgressCache(max_age_s=0.3)

    answers = await asyncio.gather(*(runs.run_status(engine, run_id, cache) for _ in range(5)))
    assert counted == [run_id]
    assert all(a is not None and a["items"] == {"pending": 30} for a in answers)
    await runs.run_status(engine, run_id, cache)
    assert counted == [run_id]

    await asyncio.sleep(0.35)
    assert (await runs.run_status(engine, run_id, cache) or {})["items"] == {"pending": 30}
    assert counted == [run_id, run_id]


async def test_a_count_from_before_the_run_row_changed_is_not_shown(
        engine: AsyncEngine, counted: list[int]) -> None:
    # counted when the run was created (nothing released yet), then published: the old
    # (empty) count beside the new row would say "published, nothing left to do"
    await register(engine, make_policies("http://127.0.0.1:9"), 5)
    cache = runs.ProgressCache(max_age_s=60)
    run_id, _ = await runs.create_run(engine, runs.RunRequest(None, None, None, False, None),
                                      None)
    before = await runs.run_status(engine, run_id, cache)
    assert before is not None and before["items"] == {}
    assert await runs.publish(engine, run_id, batch_size=50)
    after = await runs.run_status(engine, run_id, cache)
    assert after is not None and after["state"] == "published"
    assert after["items"] == {"pending": 5} and counted == [run_id, run_id]
    cache.forget()
    await runs.run_status(engine, run_id, cache)
    assert counted == [run_id] * 3


async def test_a_failed_count_is_not_kept(engine: AsyncEngine,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 3)
    run_id = await release_all(engine)
    real, failures = runs.run_progress, [OSError("database went away")]

    async def flaky(engine: AsyncEngine, run_id: int) -> dict[str, Any]:
        if failures:
            raise failures.pop()
        return await real(engine, run_id)

    monkeypatch.setattr(runs, "run_progress", flaky)
    cache = runs.ProgressCache()
    with pytest.raises(OSError, match="went away"):
        await cache.get(engine, run_id, "v")
    assert (await cache.get(engine, run_id, "v"))["items"] == {"pending": 3}


async def test_a_caller_that_leaves_does_not_cancel_the_others_count(
        engine: AsyncEngine, counted: list[int]) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 3)
    run_id = await release_all(engine)
    cache = runs.ProgressCache()
    leaving = asyncio.create_task(cache.get(engine, run_id, "v"))
    staying = asyncio.create_task(cache.get(engine, run_id, "v"))
    await asyncio.sleep(0.01)
    leaving.cancel()
    assert (await staying)["items"] == {"pending": 3}
    assert counted == [run_id]


async def test_the_cache_holds_a_bounded_number_of_runs(engine: AsyncEngine) -> None:
    cache = runs.ProgressCache(max_runs=3)
    for run_id in range(1, 6):
        await cache.get(engine, run_id, "v")  # no such runs: empty counts, still cached
    assert sorted(cache._counts) == [3, 4, 5]
