"""The pipeline end to end on a real database and the fake upstream over loopback:
register -> run -> publish -> claim -> call -> classify -> fenced completion."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.policies import Policies
from service.db.statements import item_status
from service.ledger import claims, completions, registration
from service.protocols.egress import public_roots
from service.runs import progress, publication, trigger
from service.upstreams.deletion_api import Upstreams
from service.worker import WorkerPool, database_pool
from tests.conftest import TOKEN_A, LiveServer, policies_from, test_settings
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration import db_clock

PAST = datetime(2026, 1, 1, tzinfo=UTC)
SCOPE = "tenant:acme"


def make_policies(base_url: str, **policy: Any) -> Policies:
    cfg: dict[str, Any] = {"version": 1, "upstream": "shop", "path": "/carts/{object_id}",
                           "scope": "tenant:{tenant_id}", "rate": {"per_second": 1000,
                                                                   "burst": 1000},
                           "lease_seconds": 30, "max_attempts": 3,
                           "backoff": {"base_seconds": 0.01, "max_seconds": 0.05}}
    cfg.update(policy)
    return policies_from({"upstreams": {"shop": {"base_url": base_url, "timeout_seconds": 2}},
                          "policies": {"carts": cfg}})


async def register(engine: AsyncEngine, policies: Policies, n: int, tenant: str = "acme",
                   due: datetime = PAST) -> None:
    pol = policies.policies["carts"]
    await registration.register(engine, [registration.Registration(tenant, f"cart-{i}", pol, due)
                                   for i in range(n)])


async def release_all(engine: AsyncEngine) -> int:
    request = trigger.RunRequest(None, None, None, False, None)
    run_id, _ = await trigger.create_run(engine, request, None)
    assert await publication.publish(engine, run_id, batch_size=50)
    return run_id


async def statuses(engine: AsyncEngine) -> dict[str, int]:
    """Items by status as operators read it (`leased`: pending with a lease)."""
    async with engine.connect() as conn:
        return dict((await conn.execute(text(
            f"SELECT {item_status('items')}, count(*) FROM items GROUP BY 1"))).all())


# Released pending items: how many are leased, and in how many seconds (database clock) the
# soonest of the others is due (negative: overdue, -infinity: at once; NULL: none).
_OPEN = text("""
    SELECT count(*) FILTER (WHERE lease_token IS NOT NULL),
           (extract(epoch FROM min(next_attempt_at) FILTER (WHERE lease_token IS NULL))
            - extract(epoch FROM clock_timestamp()))::float8
    FROM items WHERE status = 'pending' AND released_at IS NOT NULL""")
PATIENCE_S: Final = 2.0  # a drain leaves items due later than this pending
PAUSE_S: Final = 0.02  # after a round that claimed nothing


async def drain(pool: WorkerPool, engine: AsyncEngine, rounds: int = 200) -> None:
    """Admission rounds until no released item is leased or due within PATIENCE_S; a round
    that claims nothing is followed by a pause, as in the pool's own loop (a scope it holds
    back locally, a token not yet due, a backoff not yet over)."""
    for _ in range(rounds):
        claimed = await pool.run_once()
        await pool.drain()
        async with engine.connect() as conn:
            leased, due_in = (await conn.execute(_OPEN)).one()
        if not leased and (due_in is None or due_in > PATIENCE_S):
            return
        if not claimed:
            await asyncio.sleep(min(max(due_in or 0.0, pool.token_wait or 0.0, PAUSE_S), 0.05))



async def test_register_run_drain_each_item_once(engine: AsyncEngine, upstream: FakeUpstream
                                                 ) -> None:
    policies = make_policies(upstream.base_url)
    await register(engine, policies, 120)
    run_id = await release_all(engine)
    ups = Upstreams(policies.upstreams)
    pool = database_pool(engine, policies, ups, concurrency=8)
    await drain(pool, engine)
    await ups.aclose()
    assert await statuses(engine) == {"succeeded": 120}
    keys = [c.idempotency_key for c in upstream.calls()]
    assert len(keys) == 120 and len(set(keys)) == 120
    assert set(keys) == {registration.operation_key("acme", f"cart-{i}", "carts", 1)
                         for i in range(120)}
    status = await progress.run_status(engine, run_id, progress.ProgressCache())
    assert status is not None
    assert status["released"] == 120 and status["batches"] == 3  # batch_size 50
    assert status["items"] == {"succeeded": 120}
    assert status["attempts"] == {"succeeded": 120}


async def test_ids_stay_in_their_path_segment(engine: AsyncEngine, upstream: FakeUpstream
                                              ) -> None:
    policies = make_policies(upstream.base_url)
    pol = policies.policies["carts"]
    ids = ["a/b", "../../admin", "x?y=1", "frag#1", "ünï", "%2F", "' OR 1=1 --"]
    await registration.register(engine, [registration.Registration("acme", i, pol,
                                                                   PAST) for i in ids])
    await release_all(engine)
    ups = Upstreams(policies.upstreams)
    await drain(database_pool(engine, policies, ups, concurrency=4), engine)
    await ups.aclose()
    paths = sorted(c.path for c in upstream.calls())
    assert all(p.startswith("/carts/") and p.count("/") == 2 for p in paths), paths
    assert "/carts/a%2Fb" in paths and "/carts/..%2F..%2Fadmin" in paths


def succeeded(lease: claims.Lease) -> completions.Completion:
    now = datetime.now(UTC)
    return completions.Completion(lease=lease, worker="test", outcome="succeeded",
                                  status="succeeded", reason="test", http_status=204,
                                  retry_after_seconds=None, retry_in_seconds=0,
                                  refund_attempt=False, started_at=now, finished_at=now,
                                  latency_ms=1)


async def test_concurrent_claimers_never_share_an_item(engine: AsyncEngine) -> None:
    # Eight admitters drain one scope; a quarter of what each claims goes back uncalled,
    # behind the scope's claim position. No item is ever leased to two of them at once,
    # and every item is claimed until it succeeds, exactly once.
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 400)
    await release_all(engine)
    rng = random.Random(7)
    holder: dict[int, str] = {}  # item id -> who holds its lease now
    done: list[int] = []

    async def claimer(name: str) -> None:
        while len(done) < 400:
            admitted = await claims.admit(engine, owner=name, wants={SCOPE: 7},
                                          lease_seconds={})
            assert len(admitted.leases) <= 7
            for lease in admitted.leases:
                assert lease.item_id not in holder, (lease.item_id, holder[lease.item_id])
                holder[lease.item_id] = name
            back = [x for x in admitted.leases if rng.random() < 0.25]
            kept = [x for x in admitted.leases if x not in back]
            # given up before the statements commit: another claimer may take them at once
            for lease in admitted.leases:
                del holder[lease.item_id]
            await claims.hand_back(engine, back)
            assert await completions.complete(engine, [succeeded(x) for x in kept]) == []
            done.extend(x.item_id for x in kept)
            if not admitted.leases:
                await asyncio.sleep(0.005)

    async with asyncio.timeout(60):
        await asyncio.gather(*(claimer(f"w{n}") for n in range(8)))
    assert len(done) == 400 and len(set(done)) == 400
    assert await statuses(engine) == {"succeeded": 400}
    async with engine.connect() as conn:
        attempts = dict((await conn.execute(text(
            "SELECT attempts, count(*) FROM items GROUP BY attempts"))).all())
    assert attempts == {1: 400}  # an uncalled lease handed back costs no attempt


async def test_expired_lease_is_reclaimed_unexpired_never(engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 1)
    await release_all(engine)
    first = await claims.admit(engine, owner="a", wants={SCOPE: 5},
                               lease_seconds={"carts": 30})
    assert len(first.leases) == 1
    lease = first.leases[0]
    # before expiry: nothing to take (the microsecond boundary: test_claim_properties)
    early = await claims.admit(engine, owner="b", wants={SCOPE: 5}, lease_seconds={})
    assert early.leases == []
    await db_clock.advance(engine, 30)  # the lease's length on the database's clock
    late = await claims.admit(engine, owner="b", wants={SCOPE: 5}, lease_seconds={})
    assert [x.item_id for x in late.leases] == [lease.item_id]
    assert late.reclaimed == 1 and late.leases[0].lease_token != lease.lease_token
    assert late.leases[0].attempt == 2


async def test_expired_lease_on_the_last_attempt_goes_dead(engine: AsyncEngine) -> None:
    # a worker that dies on every call of an item must not make it loop (drill 14)
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 2)
    await release_all(engine)
    limits = {"carts": 2}
    first = await claims.admit(engine, owner="a", wants={SCOPE: 2}, lease_seconds={},
                               max_attempts=limits)
    assert [x.attempt for x in first.leases] == [1, 1]
    await db_clock.advance(engine, 60)  # the default lease's length: both leases run out
    second = await claims.admit(engine, owner="b", wants={SCOPE: 1}, lease_seconds={},
                                max_attempts=limits)
    assert [x.attempt for x in second.leases] == [2]
    await db_clock.advance(engine, 60)
    third = await claims.admit(engine, owner="c", wants={SCOPE: 2}, lease_seconds={},
                               max_attempts=limits)
    # the item on its second (last) attempt went dead; the other one is leased again
    assert [x.attempt for x in third.leases] == [2]
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT status, attempts, dead_reason, lease_owner FROM items ORDER BY status"
        ))).all()
    assert [tuple(r) for r in rows] == [("dead", 2, "max_attempts:lease_expired", None),
                                        ("pending", 2, None, "c")]


async def test_an_expired_lease_allowed_one_attempt_goes_dead_at_once(
        engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 1)
    await release_all(engine)
    limits = {"carts": 1}
    first = await claims.admit(engine, owner="a", wants={SCOPE: 1}, lease_seconds={},
                               max_attempts=limits)
    assert [x.attempt for x in first.leases] == [1]
    await db_clock.advance(engine, 60)  # the default lease's length
    again = await claims.admit(engine, owner="b", wants={SCOPE: 1}, lease_seconds={},
                               max_attempts=limits)
    assert again.leases == []
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT status, dead_reason FROM items"))).one()
    assert tuple(row) == ("dead", "max_attempts:lease_expired")


async def test_late_completion_is_fenced(engine: AsyncEngine, upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url)
    await register(engine, policies, 1)
    await release_all(engine)
    stale = (await claims.admit(engine, owner="stale", wants={SCOPE: 1},
                                lease_seconds={})).leases[0]
    await db_clock.advance(engine, 60)  # the default lease's length: the stale one ran out
    fresh = (await claims.admit(engine, owner="fresh", wants={SCOPE: 1},
                                lease_seconds={})).leases[0]

    def done(lease: claims.Lease, outcome: str, status: str) -> completions.Completion:
        now = datetime.now(UTC)
        return completions.Completion(lease=lease, worker=lease.scope, outcome=outcome,
                                      status=status, reason="test", http_status=None,
                                      retry_after_seconds=None, retry_in_seconds=0,
                                      refund_attempt=False, started_at=now, finished_at=now,
                                      latency_ms=1)

    assert await completions.complete(engine, [done(fresh, "succeeded", "succeeded")]) == []
    # the stalled worker wakes up with a permanent failure: it must change nothing
    assert await completions.complete(engine, [done(stale, "permanent", "dead")]) == [stale.item_id]
    assert await statuses(engine) == {"succeeded": 1}
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT outcome, fenced FROM attempts ORDER BY id"))).all()
    # the success is on its item (no attempt row); the fenced attempt has its row
    assert [tuple(r) for r in rows] == [("permanent", True)]


async def test_permanent_is_dead_at_once(engine: AsyncEngine, upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url)
    await register(engine, policies, 1)
    await release_all(engine)
    upstream.inject(Fault.STATUS, status=422)
    ups = Upstreams(policies.upstreams)
    await drain(database_pool(engine, policies, ups, concurrency=1), engine)
    await ups.aclose()
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT status, attempts, dead_reason FROM items"))).one()
    assert tuple(row) == ("dead", 1, "http_422")
    assert len(upstream.calls()) == 1


async def test_transient_backs_off_then_dies_with_the_same_key(engine: AsyncEngine,
                                                               upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url, max_attempts=3)
    await register(engine, policies, 1)
    await release_all(engine)
    upstream.inject(Fault.STATUS, times=None, status=503)
    ups = Upstreams(policies.upstreams)
    await drain(database_pool(engine, policies, ups, concurrency=1, rng=random.Random(1)),
                engine)
    await ups.aclose()
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT status, attempts, dead_reason FROM items"))).one()
    assert tuple(row) == ("dead", 3, "max_attempts:http_503")
    calls = upstream.calls()
    assert len(calls) == 3 and len({c.idempotency_key for c in calls}) == 1


async def test_reset_after_send_is_unknown_and_retried_with_same_key(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url)
    await register(engine, policies, 1)
    await release_all(engine)
    upstream.inject(Fault.RESET)
    ups = Upstreams(policies.upstreams)
    await drain(database_pool(engine, policies, ups, concurrency=1), engine)
    await ups.aclose()
    async with engine.connect() as conn:
        outcomes = (await conn.execute(text(
            "SELECT outcome FROM attempts ORDER BY id"))).scalars().all()
    assert outcomes == ["unknown"]  # then the success, recorded on the item
    assert len({c.idempotency_key for c in upstream.calls()}) == 1


async def test_429_refunds_the_attempt(engine: AsyncEngine, upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url, max_attempts=1)
    await register(engine, policies, 1)
    await release_all(engine)
    upstream.inject(Fault.STATUS, times=3, status=429, headers={"Retry-After": "0"})
    ups = Upstreams(policies.upstreams)
    await drain(database_pool(engine, policies, ups, concurrency=1), engine)
    await ups.aclose()
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT status, attempts FROM items"))).one()
    # three throttles did not use up the single allowed attempt
    assert tuple(row) == ("succeeded", 1)


async def test_crash_mid_publication_resumes_without_duplicates(engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 130)
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    # publish two chunks of one batch each, then "crash" (stop between transactions)
    original = publication._release_chunk
    calls = 0

    async def two_chunks(conn: Any, run: Any, batch_size: int, term: int | None) -> int:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise RuntimeError("crash")
        return await original(conn, run, batch_size, term, max_batches=1)

    publication._release_chunk = two_chunks  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError):
            await publication.publish(engine, run_id, batch_size=50)
    finally:
        publication._release_chunk = original  # type: ignore[assignment]
    assert await publication.publish_pending(engine, batch_size=50) == 1
    async with engine.connect() as conn:
        released = (await conn.execute(text(
            "SELECT count(*), count(DISTINCT batch_id) FROM items WHERE released_at IS NOT NULL"
        ))).one()
        run = (await conn.execute(text("SELECT released, batches, state FROM runs"))).one()
    assert tuple(released) == (130, 3)
    assert tuple(run) == (130, 3, "published")


@pytest.mark.slow
async def test_api_register_trigger_and_drain(db_url: str, upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url)
    settings = test_settings(db_url, workers=4)
    async with LiveServer(settings, policies, db_url) as live:
        live.count_progress_afresh()
        async with live.client() as api:
            items = [{"tenant_id": "acme", "object_id": f"c{i}", "policy": "carts",
                      "due_at": "2026-01-01T00:00:00Z"} for i in range(30)]
            first = await api.post("/v1/items", json={"items": items + items[:5]})
            assert first.status_code == 200, first.text
            assert first.json() == {"inserted": 30, "advanced": 0, "unchanged": 5}
            again = await api.post("/v1/items", json={"items": items})
            assert again.json() == {"inserted": 0, "advanced": 0, "unchanged": 30}

            dry = await api.post("/v1/runs", json={"dry_run": True})
            assert dry.status_code == 202
            trigger = await api.post("/v1/runs", json={}, headers={"Idempotency-Key": "slot-1"})
            assert trigger.status_code == 202, trigger.text
            dup = await api.post("/v1/runs", json={}, headers={"Idempotency-Key": "slot-1"})
            assert dup.status_code == 200 and dup.json()["id"] == trigger.json()["id"]
            conflict = await api.post("/v1/runs", json={"dry_run": True},
                                      headers={"Idempotency-Key": "slot-1"})
            assert conflict.status_code == 409

            run_url = f"/v1/runs/{trigger.json()['id']}"
            for _ in range(200):
                run = (await api.get(run_url)).json()
                if run["items"].get("succeeded") == 30:
                    break
                await asyncio.sleep(0.05)
            assert run["state"] == "published" and run["items"] == {"succeeded": 30}
            dry_run = (await api.get(f"/v1/runs/{dry.json()['id']}")).json()
            assert dry_run["state"] == "published" and dry_run["released"] == 0
            assert dry_run["candidates"] == 30
            listing = (await api.get("/v1/runs", params={"limit": 1})).json()
            assert len(listing["runs"]) == 1 and listing["next_before"] is not None
    assert len(upstream.calls()) == 30


@pytest.mark.parametrize(
    ("item", "field"),
    [({"object_id": ""}, "object_id"), ({"object_id": "x" * 513}, "object_id"),
     ({"tenant_id": "a\x01b"}, "tenant_id"), ({"policy": "nope"}, "policy"),
     ({"object_id": "é" * 257}, "object_id"), ({"object_id": ".."}, "object_id"),
     # fits as an id, but not inside its limiter scope ("tenant:{tenant_id}")
     ({"tenant_id": "t" * 510}, "tenant_id")],
)
async def test_bad_items_are_named_and_nothing_is_written(db_url: str, item: dict[str, str],
                                                          field: str) -> None:
    policies = make_policies("http://127.0.0.1:9")
    async with LiveServer(test_settings(db_url), policies, db_url) as live:
        async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url, headers={
                "Authorization": f"Bearer {TOKEN_A}"}) as api:
            good = {"tenant_id": "acme", "object_id": "ok", "policy": "carts",
                    "due_at": "2026-01-01T00:00:00Z"}
            response = await api.post("/v1/items", json={"items": [good, {**good, **item}]})
            assert response.status_code == 422, response.text
            assert response.json()["errors"][0]["loc"] == ["body", "items", "1", field]
            big = await api.post("/v1/items", json={"items": [good] * 10_001})
            assert big.status_code == 422
            naive = await api.post("/v1/items", json={"items": [{**good,
                                                                 "due_at": "2026-01-01T00:00"}]})
            assert naive.status_code == 422
            huge_id = await api.get("/v1/runs/99999999999999999999999")
            assert huge_id.status_code == 422
    engine_settings = test_settings(db_url)
    from service.config.settings import async_url
    from service.db.engine import make_engine
    eng = make_engine(async_url(db_url), engine_settings)
    assert await statuses(eng) == {}
    await eng.dispose()


@pytest.mark.parametrize("lanes", [1, 2, 4])
async def test_parallel_lanes_release_each_item_once(engine: AsyncEngine, lanes: int) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 1_003)
    await register(engine, policies, 40, tenant="other")
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    assert await publication.publish(engine, run_id, batch_size=20, lanes=lanes)
    status = await progress.run_status(engine, run_id, progress.ProgressCache())
    assert status is not None
    assert (status["state"], status["released"], status["remaining"]) == ("published", 1_043, 0)
    async with engine.connect() as conn:
        batches = (await conn.execute(text(
            "SELECT b.seq, b.item_count, count(i.id) AS items FROM batches b "
            "LEFT JOIN items i ON i.batch_id = b.id WHERE b.run_id = :id "
            "GROUP BY b.id ORDER BY b.seq"), {"id": run_id})).all()
        unreleased = (await conn.execute(text(
            "SELECT count(*) FROM items WHERE released_at IS NULL OR batch_id IS NULL"))
        ).scalar_one()
    assert unreleased == 0
    assert status["batches"] == len(batches) == len({b.seq for b in batches})
    assert all(b.item_count == b.items and 0 < b.items <= 20 for b in batches)
    assert sum(b.items for b in batches) == 1_043


async def test_max_items_leaves_the_rest_for_the_next_run(engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 70)
    await register(engine, policies, 5, tenant="other")
    first, _ = await trigger.create_run(engine, trigger.RunRequest(None, "acme", None,
                                                                   False, 60),
                                        None)
    assert await publication.publish(engine, first, batch_size=25)
    status = await progress.run_status(engine, first, progress.ProgressCache())
    assert status is not None
    assert (status["released"], status["batches"], status["remaining"]) == (60, 3, 10)
    assert status["candidates"] == 70  # the tenant filter kept 'other' out
    second, _ = await trigger.create_run(engine, trigger.RunRequest(None, "acme", None,
                                                                    False,
                                                                    None), None)
    assert await publication.publish(engine, second, batch_size=25)
    status = await progress.run_status(engine, second, progress.ProgressCache())
    assert status is not None
    assert (status["released"], status["remaining"]) == (10, 0)
    async with engine.connect() as conn:
        unreleased = (await conn.execute(text(
            "SELECT tenant_id, count(*) FROM items WHERE released_at IS NULL "
            "GROUP BY tenant_id"))).all()
    assert [tuple(r) for r in unreleased] == [("other", 5)]


async def test_future_items_wait_for_a_later_cutoff(engine: AsyncEngine) -> None:
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, 3, due=datetime.now(UTC) + timedelta(days=2))
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    assert await publication.publish(engine, run_id, batch_size=50)
    status = await progress.run_status(engine, run_id, progress.ProgressCache())
    assert status is not None and status["released"] == 0
    later, _ = await trigger.create_run(
        engine, trigger.RunRequest(None, None, datetime.now(UTC) + timedelta(days=3), False,
                                   None), None)
    assert await publication.publish(engine, later, batch_size=50)
    status = await progress.run_status(engine, later, progress.ProgressCache())
    assert status is not None and status["released"] == 3
