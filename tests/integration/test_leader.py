"""One leader for the cluster's once-only loops (service/cluster/leader.py): elected through the
`leader` row, replaced once its lease lapses, fenced by its term, stepping down by its own
clock when its renewals cannot get through, and shown in GET /v1/workers and
sweeper_leader."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.cluster.leader import Duty, Elector, current
from service.errors import NotLeader
from service.observability.metrics import LEADER, LEADER_TERM
from service.observability.metrics import REGISTRY as METRICS
from service.runs import publication, trigger
from tests.conftest import LiveServer, test_settings
from tests.integration.test_pipeline import make_policies, register


async def lapse(engine: AsyncEngine) -> None:
    """As if the database clock passed the lease's end: the holder stopped renewing."""
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE leader SET expires_at = now() - interval '1 s'"))


async def test_one_leader_then_a_successor_in_a_new_term(engine: AsyncEngine) -> None:
    first, second = Elector(engine, "a"), Elector(engine, "b")
    assert await first.step()
    assert not await second.step()  # the lease is in force: nobody takes it over
    assert await first.step()  # renewed
    found = await current(engine)
    assert found is not None and (found.holder, found.term) == ("a", 1)

    await lapse(engine)  # `a` died: its lease runs out
    assert await current(engine) is None
    assert await second.step()
    assert second.term == 2
    assert not await first.step()  # its renewal finds the term over: it steps down
    assert first.term is None and not first.leading()


async def test_a_chunk_of_an_ended_term_writes_nothing(engine: AsyncEngine) -> None:
    """The fence: publication under term 1 after term 2 was elected releases nothing and
    leaves the run publishing for the new leader (not `failed`)."""
    await register(engine, make_policies("http://127.0.0.1:9"), 30)
    old = Elector(engine, "old")
    assert await old.step()
    await lapse(engine)
    assert await Elector(engine, "new").step()
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    with pytest.raises(NotLeader):
        await publication.publish_pending(engine, batch_size=10, term=old.term)
    async with engine.connect() as conn:
        state, released = (await conn.execute(text(
            "SELECT state, released FROM runs WHERE id = :id"), {"id": run_id})).one()
        unreleased = (await conn.execute(text(
            "SELECT count(*) FROM items WHERE released_at IS NULL"))).scalar_one()
    assert (state, released, unreleased) == ("publishing", 0, 30)
    assert await publication.publish_pending(engine, batch_size=10, term=2) == 1


def duty(started: asyncio.Event, stopped: asyncio.Event) -> Duty:
    async def body(_term: int) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()
    return body


async def test_a_follower_takes_over_when_the_leader_dies(engine: AsyncEngine) -> None:
    events = {name: (asyncio.Event(), asyncio.Event()) for name in ("a", "b")}
    duties: Mapping[str, Mapping[str, Duty]] = {
        name: {"d": duty(*pair)} for name, pair in events.items()}
    a = asyncio.create_task(Elector(engine, "a").run(duties["a"]))
    async with asyncio.timeout(10):
        await events["a"][0].wait()
    b_elector = Elector(engine, "b", renew_every_s=0.1)
    b = asyncio.create_task(b_elector.run(duties["b"]))
    try:
        # `a` shuts down: its duties stop first, then it resigns, and `b` starts at its
        # next attempt instead of after the lease
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        assert events["a"][1].is_set()
        async with asyncio.timeout(5):
            await events["b"][0].wait()
        assert b_elector.term == 2
        assert LEADER.collect()[0].samples[0].value == 1
        assert LEADER_TERM.collect()[0].samples[0].value == 2
    finally:
        b.cancel()
        await asyncio.gather(b, return_exceptions=True)
    assert LEADER.collect()[0].samples[0].value == 0


@pytest.mark.slow  # waits for a real lease to run out
async def test_a_partitioned_leader_stops_before_its_lease_ends(engine: AsyncEngine,
                                                                db_url: str) -> None:
    """A renewal that cannot get through (here: it waits on a row lock, as a partition
    would leave it hanging) ends the duties by the leader's own estimate of its lease,
    while the lease is still in force on the database clock: no successor can have begun."""
    started, stopped = asyncio.Event(), asyncio.Event()
    elector = Elector(engine, "a", lease_s=3.0, renew_every_s=0.2, margin_s=1.0)
    task = asyncio.create_task(elector.run({"d": duty(started, stopped)}))
    try:
        async with asyncio.timeout(10):
            await started.wait()
        async with engine.connect() as blocker:
            await blocker.execute(text("SELECT * FROM leader FOR UPDATE"))
            async with asyncio.timeout(10):
                await stopped.wait()
            async with engine.connect() as probe:
                in_force = (await probe.execute(text(
                    "SELECT expires_at > clock_timestamp() FROM leader"))).scalar_one()
            assert in_force  # stopped before the lease ended
            assert not elector.leading()
            await blocker.rollback()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_workers_route_and_metric_show_the_leader(db_url: str) -> None:
    async with LiveServer(test_settings(db_url), make_policies("http://127.0.0.1:9"),
                          db_url) as live:
        async with live.client() as client:
            async with asyncio.timeout(10):
                while True:
                    body = (await client.get("/v1/workers")).json()
                    if body["leader"] is not None:
                        break
                    await asyncio.sleep(0.05)
            assert body["leader"]["term"] >= 1 and body["leader"]["name"]
            assert body["leader"]["lease_expires_at"]
            exposed = (await client.get("/metrics")).text
    assert "sweeper_leader 1.0" in exposed
    assert METRICS.get_sample_value("sweeper_leader_term") == body["leader"]["term"]
