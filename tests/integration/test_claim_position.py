"""Admissions read a scope's released items from its claim position (after the last item
its last claim took), and from the front once a second or once a claim comes up short:
items behind the position (hand-backs, retries, webhook releases) and expired leases are
never stranded."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import buckets
from service.ledger import claims
from service.ledger.claims import Admission
from service.runs import publication, trigger
from tests.integration.db_clock import advance
from tests.integration.test_pipeline import SCOPE, make_policies, register


async def publish_batches(engine: AsyncEngine, n: int, batch_size: int) -> list[int]:
    """Register and publish n items in batches of batch_size; the batch ids, in order."""
    await register(engine, make_policies("http://127.0.0.1:9"), n)
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    assert await publication.publish(engine, run_id, batch_size=batch_size, lanes=1)
    async with engine.connect() as conn:
        return list((await conn.execute(text("SELECT id FROM batches ORDER BY id"))).scalars())


async def admit(engine: AsyncEngine, n: int) -> Admission:
    return await claims.admit(engine, owner="w", wants={SCOPE: n}, lease_seconds={})


async def batches_of(engine: AsyncEngine, admission: Admission) -> list[int | None]:
    async with engine.connect() as conn:
        return list((await conn.execute(text(
            "SELECT batch_id FROM items WHERE id = ANY(:ids) ORDER BY batch_id NULLS FIRST"),
            {"ids": [x.item_id for x in admission.leases]})).scalars())


async def position(engine: AsyncEngine) -> tuple[int, int, datetime | None]:
    """The scope's claim position (batch, item id) and its last read from the front."""
    async with engine.connect() as conn:
        row = (await conn.execute(text(
            "SELECT ready_after_batch, ready_after_id, front_scanned_at FROM scopes"
            " WHERE name = :s"), {"s": SCOPE})).one()
    return int(row[0]), int(row[1]), row[2]


async def front_scan_due(engine: AsyncEngine) -> None:
    """As if FRONT_SCAN_EVERY_S had passed since the last claim from the front."""
    await advance(engine, claims.FRONT_SCAN_EVERY_S + 1, scopes=[SCOPE])


async def test_claims_continue_after_the_last_item_claimed(engine: AsyncEngine) -> None:
    b = await publish_batches(engine, 20, batch_size=5)
    first = await admit(engine, 7)
    assert await batches_of(engine, first) == [b[0]] * 5 + [b[1]] * 2
    last = max(x.item_id for x in first.leases)
    batch, item, scanned = await position(engine)
    assert (batch, item, scanned is not None) == (b[1], last, True)

    second = await admit(engine, 5)
    assert await batches_of(engine, second) == [b[1]] * 3 + [b[2]] * 2
    assert min(x.item_id for x in second.leases) > last
    assert (await position(engine))[:2] == (b[2], max(x.item_id for x in second.leases))


async def test_an_item_handed_back_behind_the_position_waits_for_the_front_read(
        engine: AsyncEngine) -> None:
    b = await publish_batches(engine, 20, batch_size=5)
    first = await admit(engine, 7)
    back = first.leases[0]
    await claims.hand_back(engine, [back])

    # the front was read a moment ago: this claim reads after the position
    from_position = await admit(engine, 1)
    assert await batches_of(engine, from_position) == [b[1]]

    await front_scan_due(engine)
    from_front = await admit(engine, 1)
    assert [x.item_id for x in from_front.leases] == [back.item_id]
    assert (await position(engine))[:2] == (b[0], back.item_id)


async def test_a_claim_that_comes_up_short_reads_from_the_front_next(engine: AsyncEngine
                                                                      ) -> None:
    b = await publish_batches(engine, 10, batch_size=5)
    everything = await admit(engine, 10)
    assert len(everything.leases) == 10
    assert (await position(engine))[0] == b[1]
    back = everything.leases[0]  # batch b[0], behind the position
    await claims.hand_back(engine, [back])

    # nothing after the position: the scope still has work, found from the front ...
    assert await buckets.eligible_scopes(engine, cursor="", limit=5) == [(SCOPE, 1)]
    # ... and the claim from the position finds none, so the next one reads the front
    short = await admit(engine, 2)
    assert short.leases == []
    assert (await position(engine))[:2] == (0, 0)
    again = await admit(engine, 2)
    assert [x.item_id for x in again.leases] == [back.item_id]
    assert (await position(engine))[:2] == (0, 0)  # short again: one item for two tokens


async def test_expired_leases_are_taken_over_on_the_front_read(engine: AsyncEngine) -> None:
    b = await publish_batches(engine, 20, batch_size=5)
    first = await admit(engine, 7)
    stalled = first.leases[0]
    async with engine.begin() as conn:
        # its worker died: the lease ran out
        await conn.execute(text("UPDATE items SET lease_expires_at = now() - interval '1 s'"
                                " WHERE id = :id"), {"id": stalled.item_id})

    from_position = await admit(engine, 1)
    assert from_position.reclaimed == 0
    assert await batches_of(engine, from_position) == [b[1]]

    await front_scan_due(engine)
    from_front = await admit(engine, 1)
    assert [(x.item_id, x.reclaimed) for x in from_front.leases] == [(stalled.item_id, True)]


async def test_webhook_releases_go_first_on_the_next_front_read(engine: AsyncEngine) -> None:
    b = await publish_batches(engine, 10, batch_size=5)
    await admit(engine, 6)
    assert (await position(engine))[0] == b[1]
    async with engine.begin() as conn:
        # a webhook made an unpublished item due: released without a batch
        await conn.execute(text("""
            INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                               scope, due_at, released_at)
            VALUES ('acme', 'hooked', 'carts', 1, repeat('a', 64), :s, now(), now())"""),
            {"s": SCOPE})

    assert await batches_of(engine, await admit(engine, 1)) == [b[1]]
    await front_scan_due(engine)
    assert await batches_of(engine, await admit(engine, 2)) == [None, b[1]]


async def test_a_scope_granted_nothing_keeps_its_position(engine: AsyncEngine) -> None:
    b = await publish_batches(engine, 10, batch_size=5)
    await admit(engine, 6)
    before = await position(engine)
    assert before[0] == b[1]
    async with engine.begin() as conn:
        await conn.execute(text(
            "UPDATE scopes SET tokens = 0, rate_per_second = 0.001 WHERE name = :s"),
            {"s": SCOPE})
    nothing = await admit(engine, 3)
    assert [g.granted for g in nothing.grants] == [0]
    assert await position(engine) == before
