"""An upstream call's overall deadline (service/upstreams/deadlines.py): asyncio.timeout's
semantics, one timer per tick instead of one per call."""

from __future__ import annotations

import asyncio

import pytest

from service.upstreams.deadlines import TICK_S, deadlines


def calls_inside() -> int:
    """Calls inside a deadline now, as the running loop's ticks hold them (a call that has
    left its block must be in none)."""
    return sum(len(calls) for calls in deadlines()._ticks.values())


async def test_a_call_that_ends_in_time_leaves_nothing_behind() -> None:
    with deadlines().within(5):
        await asyncio.sleep(0)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    assert calls_inside() == 0


async def test_an_overrun_ends_in_timeout_error_never_before_its_deadline() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        with deadlines().within(2 * TICK_S):
            await asyncio.Event().wait()
    assert loop.time() >= started + 2 * TICK_S
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the expiry's cancel taken back
    await asyncio.sleep(0)  # and nothing is left to cancel this task later
    assert calls_inside() == 0


async def test_a_cancellation_from_elsewhere_passes_through_as_it_came() -> None:
    inside = asyncio.Event()

    async def call() -> None:
        with deadlines().within(60):
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(call())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls_inside() == 0


async def test_calls_of_one_tick_time_out_alone_and_the_rest_finish() -> None:
    release = asyncio.Event()

    async def call(overruns: bool) -> str:
        try:
            with deadlines().within(TICK_S):
                await (asyncio.Event().wait() if overruns else release.wait())
        except TimeoutError:
            return "timed out"
        return "answered"

    calls = [asyncio.create_task(call(i % 2 == 0)) for i in range(40)]
    while calls_inside() < len(calls):  # every call inside its deadline
        await asyncio.sleep(0)
    release.set()
    results = await asyncio.gather(*calls)
    assert results == ["timed out", "answered"] * 20
    assert calls_inside() == 0


async def test_a_body_that_swallows_the_expiry_leaves_no_cancellation_pending() -> None:
    async def stubborn() -> str:
        with deadlines().within(0):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                return "kept going"
        return "unreachable"

    task = asyncio.create_task(stubborn())
    assert await task == "kept going"
    assert task.cancelling() == 0


async def test_a_deadline_needs_a_task() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()

    def outside_any_task() -> None:
        try:
            deadlines().within(1)
        except RuntimeError as exc:
            future.set_result(str(exc))

    loop.call_soon(outside_any_task)
    assert await future == "a deadline needs a running task"
