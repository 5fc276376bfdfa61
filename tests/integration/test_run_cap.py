"""A run's `max_items` is exact however many publishers work on it at once (issue 44,
defect 1): every replica's publisher used to be able to start its own lane on a capped run
between two of another's chunks, and two lanes reading the same `released` each released up
to the remainder."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.runs import publication, trigger
from tests.integration.test_pipeline import make_policies, register

ITEMS = 120
CAP = 61  # not a multiple of the batch or chunk size: the last chunk must be cut short
BATCH = 2  # small batches make many chunks, so the publishers interleave between them
PUBLISHERS = 3


@pytest.mark.parametrize("attempt", range(20))
async def test_three_publishers_release_exactly_the_cap(engine: AsyncEngine,
                                                         attempt: int) -> None:
    await register(engine, make_policies("http://127.0.0.1:9"), ITEMS)
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, CAP),
                                         None)
    # the production path: each replica's publisher pass, all at once
    await asyncio.gather(*(publication.publish_pending(engine, batch_size=BATCH)
                           for _ in range(PUBLISHERS)))
    async with engine.connect() as conn:
        state, counted = (await conn.execute(text(
            "SELECT state, released FROM runs WHERE id = :id"), {"id": run_id})).one()
        released = (await conn.execute(text(
            "SELECT count(*) FROM items i JOIN batches b ON b.id = i.batch_id "
            "WHERE b.run_id = :id"), {"id": run_id})).scalar_one()
    assert (state, released, counted) == ("published", CAP, CAP)
