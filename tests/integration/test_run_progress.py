"""Run progress is counted over every item and attempt of a run, so the API shares one
count among its callers for a short while instead of counting per request, and counts the
runs a list lacks together, in one statement."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.ledger import claims, item_selection
from service.runs import progress, publication, trigger
from tests.conftest import LiveServer, test_settings
from tests.fakes.clock import ManualClock
from tests.integration.test_pipeline import make_policies, register, release_all

V: Final = progress.RunVersion("published", 3)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each real count's run ids, in order (one count may take several runs)."""
    calls: list[int] = []
    real = progress.runs_progress

    async def count(engine: AsyncEngine, run_ids: Sequence[int], *, attempts: bool = True
                    ) -> dict[int, dict[str, Any]]:
        calls.extend(run_ids)
        return await real(engine, run_ids, attempts=attempts)

    monkeypatch.setattr(progress, "runs_progress", count)
    return calls


async def test_callers_share_one_count_until_it_is_too_old(engine: AsyncEngine,
                                                           counted: list[int]) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 30)
    run_id = await release_all(engine)
    clock = ManualClock()
    cache = progress.ProgressCache(max_age_s=1.5, monotonic=clock)

    answers = await asyncio.gather(*(progress.run_status(engine, run_id,
                                                         cache) for _ in range(5)))
    assert counted == [run_id]
    assert all(a is not None and a["items"] == {"pending": 30} for a in answers)
    clock.advance(1.5)
    await progress.run_status(engine, run_id, cache)
    assert counted == [run_id]

    clock.advance(0.01)
    assert (await progress.run_status(engine, run_id, cache) or {})["items"] == {"pending": 30}
    assert counted == [run_id, run_id]


async def test_a_count_from_before_the_run_row_changed_is_not_shown(
        engine: AsyncEngine, counted: list[int]) -> None:
    # counted when the run was created (nothing released yet), then published: the old
    # (empty) count beside the new row would say "published, nothing left to do"
    await register(engine, make_policies("http://127.0.0.1:9"), 5)
    cache = progress.ProgressCache(max_age_s=60)
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    before = await progress.run_status(engine, run_id, cache)
    assert before is not None and before["items"] == {}
    assert await publication.publish(engine, run_id, batch_size=50)
    after = await progress.run_status(engine, run_id, cache)
    assert after is not None and after["state"] == "published"
    assert after["items"] == {"pending": 5} and counted == [run_id, run_id]
    cache.forget()
    await progress.run_status(engine, run_id, cache)
    assert counted == [run_id] * 3


async def test_a_failed_count_is_not_kept(engine: AsyncEngine,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 3)
    run_id = await release_all(engine)
    real, failures = progress.runs_progress, [OSError("database went away")]

    async def flaky(engine: AsyncEngine, run_ids: Sequence[int], *, attempts: bool = True
                    ) -> dict[int, dict[str, Any]]:
        if failures:
            raise failures.pop()
        return await real(engine, run_ids, attempts=attempts)

    monkeypatch.setattr(progress, "runs_progress", flaky)
    cache = progress.ProgressCache()
    with pytest.raises(OSError, match="went away"):
        await cache.get(engine, run_id, V)
    assert (await cache.get(engine, run_id, V))["items"] == {"pending": 3}


async def test_a_caller_that_leaves_does_not_cancel_the_others_count(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 3)
    run_id = await release_all(engine)
    real, begun, finish_count = progress.runs_progress, asyncio.Event(), asyncio.Event()
    counted: list[int] = []

    async def held_count(engine: AsyncEngine, run_ids: Sequence[int], *,
                         attempts: bool = True) -> dict[int, dict[str, Any]]:
        counted.extend(run_ids)
        begun.set()
        await finish_count.wait()  # in progress until both callers wait for it
        return await real(engine, run_ids, attempts=attempts)

    monkeypatch.setattr(progress, "runs_progress", held_count)
    cache = progress.ProgressCache()
    leaving = asyncio.create_task(cache.get(engine, run_id, V))
    staying = asyncio.create_task(cache.get(engine, run_id, V))
    await begun.wait()  # both callers asked before the count began (they came first)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    finish_count.set()
    assert (await staying)["items"] == {"pending": 3}
    assert counted == [run_id]


async def test_the_cache_holds_a_bounded_number_of_runs(engine: AsyncEngine) -> None:
    cache = progress.ProgressCache(max_runs=3)
    for run_id in range(1, 6):
        await cache.get(engine, run_id, V)  # no such runs: empty counts, still cached
    assert sorted(cache._counts) == [(3, True), (4, True), (5, True)]


async def finish(engine: AsyncEngine, run_id: int, n: int, status: str, outcome: str,
                 *, before_0024: bool = False) -> None:
    """`n` of the run's pending items finished as a worker leaves them, one attempt each: a
    success without an attempt row, its call's start on the item (`before_0024`: as a
    worker before migration 0024 left them, with a row and no start)."""
    async with engine.begin() as conn:
        await conn.execute(text("""
            WITH chosen AS (
                SELECT i.id FROM items i JOIN batches b ON b.id = i.batch_id
                WHERE b.run_id = :run AND i.status = 'pending' ORDER BY i.id LIMIT :n
            ),
            done AS (
                UPDATE items i SET status = CAST(:status AS text), completed_at = now(),
                    attempts = 1, last_outcome = CAST(:outcome AS text),
                    last_started_at = CASE WHEN CAST(:before AS boolean) THEN NULL
                                           ELSE now() END,
                    dead_reason = CASE WHEN CAST(:status AS text) = 'dead'
                                       THEN 'http_422' END
                FROM chosen WHERE i.id = chosen.id RETURNING i.id
            )
            INSERT INTO attempts (item_id, attempt_no, worker, lease_token, started_at,
                                  finished_at, outcome, latency_ms)
            SELECT id, 1, 'test', gen_random_uuid(), now(), now(), CAST(:outcome AS text), 1
            FROM done WHERE CAST(:outcome AS text) <> 'succeeded' OR CAST(:before AS boolean)
            """), {"run": run_id, "n": n, "status": status, "outcome": outcome,
                   "before": before_0024})


async def three_runs(engine: AsyncEngine) -> list[int]:
    """Three published runs, oldest first: 2 items (1 succeeded), 3 (all dead), 4 pending."""
    policies = make_policies("http://127.0.0.1:9")
    run_ids = []
    for tenant, n in (("a", 2), ("b", 3), ("c", 4)):
        await register(engine, policies, n, tenant=tenant)
        run_ids.append(await release_all(engine))
    await finish(engine, run_ids[0], 1, "succeeded", "succeeded")
    await finish(engine, run_ids[1], 3, "dead", "permanent")
    return run_ids


async def test_a_success_counts_once_with_or_without_its_attempt_row(
        engine: AsyncEngine) -> None:
    # a success has no attempt row since migration 0024; one from before has: each counts once
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 3, tenant="a")
    run_id = await release_all(engine)
    await finish(engine, run_id, 1, "succeeded", "succeeded", before_0024=True)
    await finish(engine, run_id, 1, "succeeded", "succeeded")
    status = await progress.run_status(engine, run_id, progress.ProgressCache()) or {}
    assert (status["items"], status["attempts"]) == ({"succeeded": 2, "pending": 1},
                                                     {"succeeded": 2})


async def test_leased_items_count_as_leased_held_or_not(engine: AsyncEngine) -> None:
    # a leased item is pending with a lease in the ledger (migration 0024); a run's progress
    # counts it as leased, under a hold or not, as it did when leased was a status
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 4, tenant="a")
    run_id = await release_all(engine)
    got = await claims.admit(engine, owner="w", wants={"tenant:a": 2}, lease_seconds={})
    assert len(got.leases) == 2
    async with engine.begin() as conn:
        hold = (await conn.execute(text(
            "INSERT INTO holds (tenant_id, reason, reference, placed_by, placed_at) "
            "VALUES ('a', 'r', 'R-1', 'test', now()) RETURNING id"))).scalar_one()
        await conn.execute(text("UPDATE items SET hold_id = :h WHERE id IN (:a, :b)"), {
            "h": hold, "a": got.leases[0].item_id, "b": min(
                set(range(1, 5)) - {x.item_id for x in got.leases})})
    status = await progress.run_status(engine, run_id, progress.ProgressCache()) or {}
    assert status["items"] == {"leased": 2, "held": 1, "pending": 1}


EXPECTED: Final = [  # three_runs's, newest first
    ({"pending": 4}, {}),
    ({"dead": 3}, {"permanent": 3}),
    ({"succeeded": 1, "pending": 1}, {"succeeded": 1}),
]


async def test_a_list_counts_the_runs_it_lacks_in_one_statement(
        engine: AsyncEngine, counted: list[int]) -> None:
    first, second, third = await three_runs(engine)
    cache = progress.ProgressCache(monotonic=ManualClock())  # no count gets too old meanwhile
    assert (await progress.run_status(engine, first, cache) or {})["items"] == EXPECTED[2][0]
    listed = await progress.list_runs(engine, limit=10, before=None, progress=cache)
    assert [r["id"] for r in listed] == [third, second, first]
    assert [(r["items"], r["attempts"]) for r in listed] == EXPECTED
    assert listed[1]["oldest_remaining_due_at"] is None  # nothing left to do
    assert all("last_action" not in run for run in listed)
    # the first run's count was shared; the other two were counted in one statement
    assert counted == [first, third, second]
    assert (cache.statements, cache.runs_counted) == (2, 3)
    assert await progress.list_runs(engine, limit=10, before=None, progress=cache) == listed
    assert (cache.statements, cache.runs_counted) == (2, 3)
    # pages count only their own runs
    page = await progress.list_runs(engine, limit=1, before=third,
                                    progress=progress.ProgressCache())
    assert [r["id"] for r in page] == [second] and counted[3:] == [second]
    for run in listed:  # the same figures as a count of each run alone
        assert {k: run[k] for k in ("items", "attempts", "oldest_remaining_due_at")} == \
            (await progress.runs_progress(engine, [run["id"]]))[run["id"]]


async def test_a_drained_runs_count_is_kept_longer_until_an_operator_acts(
        engine: AsyncEngine, counted: list[int]) -> None:
    first, second, third = await three_runs(engine)
    clock = ManualClock()
    cache = progress.ProgressCache(max_age_s=0.05, drained_max_age_s=60, monotonic=clock)
    await progress.list_runs(engine, limit=10, before=None, progress=cache)
    assert counted == [third, second, first]
    clock.advance(0.1)
    # the run still pending and the half-done one are counted again; the drained one is not
    await progress.list_runs(engine, limit=10, before=None, progress=cache)
    assert counted[3:] == [third, first]
    # a re-drive (an operator action, here on another replica: this cache is not told)
    # puts the drained run's items back to pending: its count is not shared any more
    assert len(await item_selection.redrive(engine, item_selection.ItemFilter(policy="carts"),
                                            actor="test", reason="fixed", limit=10)) == 3
    status = await progress.run_status(engine, second, cache)
    assert status is not None and status["items"] == {"pending": 3}
    assert counted[5:] == [second]


# -- over HTTP: GET /v1/runs shows what GET /v1/runs/{id} shows, from the same counts ------

@contextlib.asynccontextmanager
async def served(db_url: str, clock: ManualClock | None = None
                 ) -> AsyncIterator[httpx.AsyncClient]:
    """A replica (API only) on the test's database, its counts aged on `clock` (one that
    stands still unless given), and a client for it."""
    async with LiveServer(test_settings(db_url), make_policies("http://127.0.0.1:9"),
                          db_url) as live:
        live.runtime.run_progress.monotonic = clock or ManualClock()
        async with live.client() as api:
            yield api


async def listing(api: httpx.AsyncClient) -> dict[int, dict[str, Any]]:
    answer = await api.get("/v1/runs")
    assert answer.status_code == 200, answer.text
    return {run["id"]: run for run in answer.json()["runs"]}


async def test_the_run_list_shows_each_runs_counts(db_url: str, engine: AsyncEngine) -> None:
    run_ids = await three_runs(engine)
    async with served(db_url) as api:
        listed = await listing(api)
        assert [(listed[r]["items"], listed[r]["attempts"]) for r in reversed(run_ids)] == \
            EXPECTED
        assert listed[run_ids[2]]["oldest_remaining_due_at"] == "2026-01-01T00:00:00Z"
        assert listed[run_ids[1]]["oldest_remaining_due_at"] is None
        for run_id in run_ids:
            assert (await api.get(f"/v1/runs/{run_id}")).json() == listed[run_id]


async def test_list_requests_within_the_window_share_one_count(db_url: str,
                                                               engine: AsyncEngine) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 5)
    run_id = await release_all(engine)
    clock = ManualClock()
    async with served(db_url, clock) as api:
        # an operator action: no count this replica took before it is shared after it
        assert (await api.post("/v1/workers/resume")).status_code == 200
        before = (await listing(api))[run_id]
        await finish(engine, run_id, 1, "succeeded", "succeeded")  # as a worker does
        clock.advance(progress.PROGRESS_MAX_AGE_S)
        again = (await listing(api))[run_id]
        single = (await api.get(f"/v1/runs/{run_id}")).json()
        # not counted again: the item that succeeded in between is not seen yet
        assert again == single == before
        clock.advance(0.01)
        after = (await listing(api))[run_id]
        assert after["items"]["succeeded"] == before["items"].get("succeeded", 0) + 1
        assert (await api.get(f"/v1/runs/{run_id}")).json() == after


async def test_a_drained_runs_count_waits_for_an_operator_action_on_any_replica(
        db_url: str, engine: AsyncEngine) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 3)
    run_id = await release_all(engine)
    await finish(engine, run_id, 3, "dead", "permanent")
    clock = ManualClock()
    async with served(db_url, clock) as one, served(db_url) as other:
        assert (await listing(one))[run_id]["attempts"] == {"permanent": 3}
        # a late completion fenced out after the run drained: an attempt row, nothing else
        async with engine.begin() as conn:
            await conn.execute(text(
                "INSERT INTO attempts (item_id, attempt_no, worker, lease_token, started_at, "
                "finished_at, outcome, latency_ms, fenced) SELECT min(id), 1, 'late', "
                "gen_random_uuid(), now(), now(), 'succeeded', 1, true FROM items"))
        clock.advance(progress.PROGRESS_MAX_AGE_S + 0.01)
        kept = (await listing(one))[run_id]  # drained: the count is kept longer
        assert (kept["items"], kept["attempts"]) == ({"dead": 3}, {"permanent": 3})
        redriven = await other.post("/v1/items/redrive", json={
            "policy": "carts", "reason": "http_422", "why": "upstream fixed"})
        assert redriven.status_code == 200 and redriven.json()["count"] == 3
        # the other replica's re-drive is an operator action: this one counts again at once
        seen = (await listing(one))[run_id]
        assert seen["items"] == {"pending": 3}
        assert seen["attempts"] == {"permanent": 3, "succeeded": 1}


async def test_a_list_without_attempts_reads_none_and_shares_a_full_count(
        engine: AsyncEngine, counted: list[int]) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), 4)
    run_id = await release_all(engine)
    await finish(engine, run_id, 2, "dead", "permanent")
    cache = progress.ProgressCache()
    light = await cache.get_many(engine, {run_id: V}, attempts=False)
    assert light[run_id]["items"] == {"pending": 2, "dead": 2}
    assert light[run_id]["attempts"] == {}
    full = await cache.get(engine, run_id, V)  # a page that shows attempts counts them
    assert full["attempts"] == {"permanent": 2}
    # a list after it shares the full count rather than counting again
    assert (await cache.get_many(engine, {run_id: V}, attempts=False))[run_id] == full
    assert counted == [run_id, run_id]
