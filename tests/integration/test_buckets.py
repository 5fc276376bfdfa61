"""The shared budget on a real database: token math on the database clock, closures,
pauses, budgets changed at run time, and the pool obeying them against the fake upstream.

Where only the database's clock has to pass (a refill, a closure's end), the tests move it
(tests/integration/db_clock.py) instead of sleeping; the pool's tests run in real time, as
the pool and the fake upstream do."""

from __future__ import annotations

import asyncio
import math
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import buckets, rules
from service.ledger import claims
from service.protocols.egress import public_roots
from service.upstreams.deletion_api import Upstreams
from service.worker import WorkerPool, database_pool
from tests.conftest import TOKEN_A, LiveServer, eventually, test_settings
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.db_clock import advance
from tests.integration.test_pipeline import (
    SCOPE,
    make_policies,
    register,
    release_all,
    statuses,
)


async def make_scope(engine: AsyncEngine, name: str, rate: float, burst: int) -> None:
    async with engine.begin() as conn:
        await buckets.ensure_scopes(conn, {name: (rate, burst, 1)})


async def scope_rows(engine: AsyncEngine) -> dict[str, tuple[float, int, float]]:
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT name, rate_per_second, burst, tokens FROM scopes"))
        return {r.name: (r.rate_per_second, r.burst, r.tokens) for r in rows}


async def test_a_policy_budget_change_reaches_only_rows_no_operator_set(engine: AsyncEngine
                                                                       ) -> None:
    await make_scope(engine, "policy", rate=10, burst=8)
    await make_scope(engine, "operator", rate=10, burst=8)
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE scopes SET rate_per_second = 3, burst = 2, tokens = 2, "
                                "budget_from_policy = false WHERE name = 'operator'"))
    await make_scope(engine, "policy", rate=5, burst=4)
    await make_scope(engine, "operator", rate=5, burst=4)
    await make_scope(engine, "new", rate=7, burst=6)
    # tokens never exceed the new burst; an operator's budget stands; a new row starts full
    assert await scope_rows(engine) == {"policy": (5, 4, 4), "operator": (3, 2, 2),
                                        "new": (7, 6, 6)}


async def test_ensuring_an_unchanged_scope_leaves_its_row_unlocked(engine: AsyncEngine
                                                                  ) -> None:
    """Registration ensures its scopes in the transaction that inserts its items. A row
    whose budget stands is neither locked nor waited for: workers take tokens from it
    meanwhile, and a token take in flight does not hold up the registration."""
    await make_scope(engine, "s", rate=10, burst=8)
    async with engine.begin() as registering:
        await buckets.ensure_scopes(registering, {"s": (10, 8, 1)})
        async with engine.connect() as worker:
            await worker.execute(text("SET lock_timeout = '2s'"))
            await worker.execute(text("UPDATE scopes SET tokens = 1 WHERE name = 's'"))
            async with engine.connect() as other:
                await other.execute(text("SET lock_timeout = '2s'"))
                await buckets.ensure_scopes(other, {"s": (10, 8, 1)})
                await other.commit()
            await worker.commit()
    assert await scope_rows(engine) == {"s": (10, 8, 1)}


async def with_items(engine: AsyncEngine, scope: str, n: int) -> None:
    """n released items in `scope`, due now (released by a webhook: no batch)."""
    async with engine.begin() as conn:
        await conn.execute(text("""
            INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,
                               scope, due_at, released_at)
            SELECT 'acme', 'o-' || g, 'carts', 1,
                   encode(sha256(convert_to(:scope || '/' || g, 'UTF8')), 'hex'), :scope,
                   now(), now()
            FROM generate_series(1, :n) g"""), {"scope": scope, "n": n})


async def admit(engine: AsyncEngine, wants: dict[str, int], lookahead_s: float
                ) -> claims.Admission:
    return await claims.admit(engine, owner="w", wants=wants, lease_seconds={},
                              lookahead_s=lookahead_s)


async def test_admission_grants_burst_then_refills_at_rate(engine: AsyncEngine) -> None:
    await make_scope(engine, "s", rate=10, burst=5)
    await with_items(engine, "s", 20)
    first = await admit(engine, {"s": 8}, lookahead_s=0)
    [grant] = first.grants
    # the burst less one token that may be spent late (late_tolerance(10/s) = 0.1 s)
    assert grant.granted == len(first.leases) == 4 and 0 < grant.wait_seconds <= 0.1
    [empty] = (await admit(engine, {"s": 8}, lookahead_s=0)).grants
    assert empty.granted == 0
    await advance(engine, 0.35)
    later = await admit(engine, {"s": 8}, lookahead_s=0)
    [refilled] = later.grants
    # exactly the 0.35 s the clock moved at 10/s, plus the real time between the grants
    # (a few ms), at most the spendable burst
    real = refilled.granted_at - empty.granted_at
    assert refilled.available == pytest.approx(
        min(4.0, empty.available + 10 * (0.35 + real)), abs=1e-3)
    assert 3 <= refilled.granted == len(later.leases) == math.floor(refilled.available) <= 4
    await claims.hand_back(engine, later.leases[:2])
    back = await admit(engine, {"s": 2}, lookahead_s=0)
    assert back.grants[0].granted == len(back.leases) == 2


async def test_an_admission_is_charged_only_for_the_items_it_claims(engine: AsyncEngine
                                                                   ) -> None:
    await make_scope(engine, "s", rate=10, burst=5)
    await with_items(engine, "s", 1)
    first = await admit(engine, {"s": 4}, lookahead_s=0)
    [grant] = first.grants
    assert (grant.granted, len(first.leases)) == (4, 1)
    # the three tokens no item used never left the bucket
    async with engine.connect() as conn:
        tokens = (await conn.execute(text("SELECT tokens FROM scopes"))).scalar_one()
    assert tokens == grant.available - 1


async def test_reservations_lend_only_the_lookahead_and_carry_due_times(engine: AsyncEngine
                                                                       ) -> None:
    await make_scope(engine, "s", rate=20, burst=1)
    await with_items(engine, "s", 10)
    lent = await admit(engine, {"s": 10}, lookahead_s=0.1)
    [g] = lent.grants
    # one token now, two more due within the next 100 ms at 20/s
    assert g.granted == len(lent.leases) == 3
    assert [round(g.due_in(i), 3) for i in range(3)] == [0.0, 0.05, 0.1]
    # the lent tokens are owed: the next admission sees the bucket in debt by them, and is
    # granted only what refilled since (none if it came within 50 ms), within its lookahead
    [later] = (await admit(engine, {"s": 10}, lookahead_s=0.1)).grants
    assert later.available == pytest.approx(
        min(1.0, g.available - 3 + 20 * (later.granted_at - g.granted_at)), abs=1e-3)
    assert later.granted == max(0, min(10, math.floor(later.available + 20 * 0.1 + 1e-6)))
    if later.granted == 0:
        assert later.wait_seconds > 0
    # reserved tokens handed back with their leases cancel the debt, not turned into
    # credit: the bucket holds its one token less the ones spent, plus the refill since
    # the first grant
    await claims.hand_back(engine, lent.leases[1:])
    [again] = (await admit(engine, {"s": 10}, lookahead_s=0)).grants
    assert again.available == pytest.approx(min(
        1.0, g.available - 1 - later.granted + 20 * (again.granted_at - g.granted_at)),
        abs=1e-3)
    assert again.granted == math.floor(again.available)
    async with engine.connect() as conn:
        tokens = (await conn.execute(text("SELECT tokens FROM scopes"))).scalar_one()
    assert tokens <= 1


async def test_admission_refills_and_records_the_same_instant(engine: AsyncEngine) -> None:
    # Tokens are conserved across an admission: what the bucket held, plus the refill up to
    # the recorded refill time, minus what was claimed. Reading the clock once for the
    # refill and again when writing the row lost the refill of the whole claim in between
    # (at 100/s about 3% of the budget). A huge rate makes a microsecond of it visible.
    await register(engine, make_policies("http://127.0.0.1:9"), 64)
    await release_all(engine)
    rate = 100_000.0
    async with engine.begin() as conn:
        await conn.execute(text(
            "UPDATE scopes SET rate_per_second = :rate, burst = 1000000000, tokens = 0, "
            "budget_from_policy = false"), {"rate": rate})
    query = text("SELECT tokens, refilled_at, extract(epoch FROM refilled_at)::float8 AS at "
                 "FROM scopes")
    async with engine.connect() as conn:
        before = (await conn.execute(query)).one()
    admitted = await claims.admit(engine, owner="w", wants={SCOPE: 64}, lease_seconds={})
    async with engine.connect() as conn:
        after = (await conn.execute(query)).one()
    [grant] = admitted.grants
    assert len(admitted.leases) == grant.granted == 64
    assert abs(grant.granted_at - after.at) < 1e-6
    # (the elapsed time from the timestamps themselves: epoch floats near 1.8e9 s carry
    # only ~0.2 us, 0.02 tokens at this rate; the bug lost tens of microseconds)
    elapsed = (after.refilled_at - before.refilled_at).total_seconds()
    assert abs(grant.available - (before.tokens + rate * elapsed)) < 0.01
    assert abs(after.tokens - (grant.available - 64)) < 1e-6


async def test_stock_leaves_room_for_tokens_spent_late(engine: AsyncEngine) -> None:
    # a token may be spent up to late_tolerance after its moment; a full stock on top of
    # it would put rate + burst + rate x lateness into one second at the upstream
    await make_scope(engine, "fast", rate=1000, burst=50)
    await make_scope(engine, "slow", rate=2, burst=3)
    await make_scope(engine, "tiny", rate=10, burst=1)
    await advance(engine, 3600)  # however long the buckets sat unused
    grants = {g.scope: g.granted for g in (await admit(
        engine, {"fast": 100, "slow": 10, "tiny": 10}, lookahead_s=0)).grants}
    assert grants == {"fast": 50 - 20, "slow": 3 - 1, "tiny": 1}
    assert rules.late_tolerance(1000) == rules.LATE_TOLERANCE_MIN_S
    assert rules.late_tolerance(2) == 0.5


async def test_concurrent_admitters_never_exceed_the_budget(engine: AsyncEngine) -> None:
    await make_scope(engine, "hot", rate=50, burst=5)
    await with_items(engine, "hot", 200)  # more than a second's budget
    started = await database_clock(engine)
    leased = 0

    async def admitter() -> None:
        nonlocal leased
        admitted = await claims.admit(engine, owner="w", wants={"hot": 3}, lease_seconds={})
        [g] = admitted.grants
        assert len(admitted.leases) == g.granted  # items to spare: every token used
        leased += g.granted

    # a second of the database's clock in steps, eight admitters racing for each step's
    # refill (and the real time the rounds take, which refills too: read on the database's
    # clock, the one the bucket refills on)
    steps, step_s = 10, 0.1
    for _ in range(steps):
        await advance(engine, step_s)
        await asyncio.gather(*(admitter() for _ in range(8)))
    elapsed = steps * step_s + await database_clock(engine) - started
    # an admission may also lend the tokens due within the look-ahead (reservations)
    assert leased <= 5 + 50 * (elapsed + rules.LOOKAHEAD_S) + 1
    assert leased >= 0.8 * 50 * steps * step_s  # and the budget is used, not wasted


async def database_clock(engine: AsyncEngine) -> float:
    """The database's clock (clock_timestamp()), in seconds."""
    async with engine.connect() as conn:
        return float((await conn.execute(text(
            "SELECT extract(epoch FROM clock_timestamp())"))).scalar_one())


async def call_starts(engine: AsyncEngine) -> list[float]:
    """When each call recorded in the ledger started (its attempt's started_at, or a
    succeeded item's last_started_at: a success has no attempt row), in seconds on the
    database's clock's scale."""
    async with engine.connect() as conn:
        return [float(t) for t in (await conn.execute(text(
            "SELECT extract(epoch FROM started_at) AS t FROM attempts UNION ALL "
            "SELECT extract(epoch FROM last_started_at) FROM items "
            "WHERE status = 'succeeded' ORDER BY t"))).scalars()]


async def test_closed_until_only_moves_later_and_blocks_tokens(engine: AsyncEngine) -> None:
    await make_scope(engine, "s", rate=10, burst=10)
    async with engine.connect() as conn:
        before = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
    await buckets.close(engine, {"s": rules.Closure(5.0, 1.0, 60.0)})
    async with engine.connect() as conn:
        after = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
    assert (await admit(engine, {"s": 3}, lookahead_s=rules.LOOKAHEAD_S)).grants == []
    async with engine.connect() as conn:
        first = (await conn.execute(text("SELECT closed_until FROM scopes"))).scalar_one()
    # 5 s from the closing statement's clock, plus jitter of at most 10% of the delay
    jitter = timedelta(seconds=rules.JITTER_SHARE * 5.0)
    assert before + timedelta(seconds=5) <= first <= after + timedelta(seconds=5) + jitter
    await buckets.close(engine, {"s": rules.Closure(1.0, 1.0, 60.0)})  # shorter: ignored
    async with engine.connect() as conn:
        second = (await conn.execute(text("SELECT closed_until FROM scopes"))).scalar_one()
        db_now = (await conn.execute(text("SELECT now()"))).scalar_one()
    assert second == first

    # a second before closed_until on the database's clock: still closed
    left = (first - db_now).total_seconds()
    await advance(engine, left - 1.0)
    assert (await admit(engine, {"s": 3}, lookahead_s=0)).grants == []
    # past it: open again, and the bucket restarted empty at closed_until: it holds only
    # the refill since then (10/s for the 0.3 s moved past it, plus the real time), not
    # its spendable burst of 9
    await advance(engine, 1.3)
    [reopened] = (await admit(engine, {"s": 30}, lookahead_s=0)).grants
    async with engine.connect() as conn:
        until = (await conn.execute(text(
            "SELECT extract(epoch FROM closed_until)::float8 FROM scopes"))).scalar_one()
    assert reopened.available == pytest.approx(
        min(9.0, 10 * (reopened.granted_at - until)), abs=1e-3)
    assert 3 <= reopened.granted == math.floor(reopened.available) < 9


async def test_backoff_without_retry_after_grows_per_scope(engine: AsyncEngine) -> None:
    await make_scope(engine, "s", rate=100, burst=10)
    closures = []
    for _ in range(3):
        async with engine.begin() as conn:  # reopen so each closure starts from now
            await conn.execute(text("UPDATE scopes SET closed_until = NULL"))
        await buckets.close(engine, {"s": rules.Closure(None, 1.0, 60.0)})
        async with engine.connect() as conn:
            closures.append((await conn.execute(text(
                "SELECT extract(epoch FROM closed_until - now()), backoff_level FROM scopes"
            ))).one())
    assert [level for _, level in closures] == [1, 2, 3]
    # measured a few milliseconds after each close
    assert 0.9 <= closures[0][0] < 1.2 and 1.9 <= closures[1][0] < 2.3
    assert 3.9 <= closures[2][0] < 4.5
    await buckets.recovered(engine, ["s"])
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT backoff_level FROM scopes"))).scalar() == 0


async def test_429s_of_calls_sent_before_a_closure_are_one_step(engine: AsyncEngine) -> None:
    """A burst of calls in flight meets the same throttle: their 429s arrive one by one
    while the first one's closure holds, and each would otherwise double the backoff (seven
    answers of one burst once closed a scope for 2^7 s)."""
    await make_scope(engine, "s", rate=100, burst=10)
    async with engine.connect() as conn:  # the closures' lengths count from here, so slow
        before = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
    for _ in range(5):
        await buckets.close(engine, {"s": rules.Closure(None, 1.0, 60.0)})
    async with engine.connect() as conn:  # statements on a busy machine do not shorten it
        wait, level = (await conn.execute(text(
            "SELECT extract(epoch FROM closed_until - :before), backoff_level FROM scopes"
        ), {"before": before})).one()
    assert level == 1 and 1.0 <= wait < 1.9  # a second step would close it for 2 s


async def test_answers_refund_and_lower_buckets(engine: AsyncEngine) -> None:
    """buckets.adjust: a refund adds to the bucket as of now (never past its spendable
    burst, 10 - 1 here), a cap lowers it, and both apply to every replica's next grant."""
    await make_scope(engine, "s", rate=0.001, burst=10)
    await make_scope(engine, "t", rate=0.001, burst=10)

    async def tokens() -> dict[str, float]:
        return {name: row[2] for name, row in (await scope_rows(engine)).items()}

    async with engine.begin() as conn:
        await conn.execute(text("UPDATE scopes SET tokens = 2, refilled_at = now()"))
    await buckets.adjust(engine, {"s": 1.5, "t": -0.5}, {})
    got = await tokens()
    assert got["s"] == pytest.approx(3.5, abs=0.01) and got["t"] == pytest.approx(1.5, abs=0.01)
    await buckets.adjust(engine, {"s": 100}, {"t": 0.25})
    got = await tokens()
    assert got["s"] == pytest.approx(9.0) and got["t"] == pytest.approx(0.25)
    await buckets.adjust(engine, {}, {"s": 50})  # a cap above the bucket changes nothing
    assert (await tokens())["s"] == pytest.approx(9.0, abs=0.01)
    await buckets.adjust(engine, {"t": -1e12}, {})  # never below minus the burst
    assert (await tokens())["t"] == pytest.approx(-10.0)
    # a closed scope restarts empty when it reopens: answers do not refill it meanwhile
    await buckets.close(engine, {"s": rules.Closure(30.0, 1.0, 60.0)})
    await buckets.adjust(engine, {"s": 5.0}, {})
    assert (await tokens())["s"] == 0.0


async def drain_with(pool: WorkerPool, engine: AsyncEngine, seconds: float) -> None:
    task = asyncio.create_task(pool.run())
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        s = await statuses(engine)
        if not s.get("pending") and not s.get("leased"):
            break
        await asyncio.sleep(0.05)
    pool.stop()
    await task


@pytest.mark.slow
async def test_429_with_retry_after_closes_only_its_scope(engine: AsyncEngine) -> None:
    async with FakeUpstream(scope_fn=lambda _m, path, _h: path.split("/")[2]) as upstream:
        policies = make_policies(upstream.base_url, path="/t/{tenant_id}/{object_id}",
                                 rate={"per_second": 20, "burst": 1})
        await register(engine, policies, 30, tenant="a")
        await register(engine, policies, 30, tenant="b")
        await release_all(engine)
        upstream.inject(Fault.STATUS, status=429, headers={"Retry-After": "2"},
                        match=lambda c: c.scope == "a")
        ups = Upstreams(policies.upstreams)
        await drain_with(database_pool(engine, policies, ups, concurrency=4), engine, 15)
        await ups.aclose()
    calls = upstream.calls()
    a = [c.received_at for c in calls if c.scope == "a"]
    b = [c.received_at for c in calls if c.scope == "b"]
    assert await statuses(engine) == {"succeeded": 60}
    gap = a[1] - a[0]
    assert 2.0 <= gap < 3.5, gap  # nothing to scope a until Retry-After passed (+ jitter)
    # b kept its pace meanwhile: at 20/s its 30 calls fit in a's 2 s closure, and at most
    # the first round's went out before a's first call
    during = [t for t in b if a[0] < t < a[0] + 2.0]
    assert len(during) >= 30 * 0.9, (len(during), len(b))
    assert b[-1] - a[0] < 2.0  # b was never held back by a's closure


@pytest.mark.slow
async def test_429_with_http_date_closes_until_that_date(engine: AsyncEngine) -> None:
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url, rate={"per_second": 50, "burst": 1})
        await register(engine, policies, 3)
        await release_all(engine)
        when = datetime.now(UTC) + timedelta(seconds=3)
        upstream.inject(Fault.STATUS, status=429,
                        headers={"Retry-After": format_datetime(when, usegmt=True)})
        ups = Upstreams(policies.upstreams)
        await drain_with(database_pool(engine, policies, ups, concurrency=2), engine, 15)
        await ups.aclose()
    walls = [c.wall_time for c in upstream.calls()]
    assert len(walls) == 4
    # whole seconds in the date: the next call is no earlier than the date itself
    assert walls[1] >= when.replace(microsecond=0).timestamp() - 0.05


@pytest.mark.slow
async def test_401_pauses_only_its_scope_and_resume_reopens(db_url: str) -> None:
    async with FakeUpstream(scope_fn=lambda _m, path, _h: path.split("/")[2]) as upstream:
        policies = make_policies(upstream.base_url, path="/t/{tenant_id}/{object_id}")
        upstream.inject(Fault.STATUS, status=401, times=None,
                        match=lambda c: c.scope == "bad")
        async with LiveServer(test_settings(db_url, workers=4), policies, db_url) as live:
            async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url, headers={
                    "Authorization": f"Bearer {TOKEN_A}"}, timeout=10) as api:
                items = [{"tenant_id": t, "object_id": f"o{i}", "policy": "carts",
                          "due_at": "2026-01-01T00:00:00Z"} for t in ("bad", "good")
                         for i in range(5)]
                await api.post("/v1/items", json={"items": items})
                run = (await api.post("/v1/runs", json={})).json()
                for _ in range(100):
                    body = (await api.get(f"/v1/runs/{run['id']}")).json()
                    if body["items"].get("succeeded") == 5:
                        break
                    await asyncio.sleep(0.05)
                listing = {s["name"]: s for s in (await api.get("/v1/scopes")).json()["scopes"]}
                assert listing["tenant:bad"]["paused"] is True
                assert listing["tenant:bad"]["paused_reason"] == "unauthorized"
                assert listing["tenant:bad"]["eligible"] == 5
                assert listing["tenant:good"]["paused"] is False
                body = (await api.get(f"/v1/runs/{run['id']}")).json()
                assert body["items"] == {"succeeded": 5, "pending": 5}
                # the 401'd item was not punished
                pending = (await api.get("/v1/items", params={"status": "pending"})).json()
                assert {i["attempts"] for i in pending["items"]} == {0}
                upstream.clear_faults()  # the credential is fixed
                resumed = await api.post("/v1/scopes/tenant:bad/resume",
                                         json={"reason": "credential rotated"})
                assert resumed.status_code == 200 and resumed.json()["paused"] is False
                for _ in range(100):
                    body = (await api.get(f"/v1/runs/{run['id']}")).json()
                    if body["items"].get("succeeded") == 10:
                        break
                    await asyncio.sleep(0.05)
                assert body["items"] == {"succeeded": 10}
                missing = await api.post("/v1/scopes/nope/pause")
                assert missing.status_code == 404


@pytest.mark.slow
async def test_budget_set_at_run_time_holds(db_url: str, engine: AsyncEngine) -> None:
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url, rate={"per_second": 100, "burst": 1})
        async with LiveServer(test_settings(db_url, workers=8), policies, db_url) as live:
            async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url, headers={
                    "Authorization": f"Bearer {TOKEN_A}"}, timeout=10) as api:
                items = [{"tenant_id": "acme", "object_id": f"o{i}", "policy": "carts",
                          "due_at": "2026-01-01T00:00:00Z"} for i in range(400)]
                await api.post("/v1/items", json={"items": items})
                await api.post("/v1/runs", json={})
                await eventually(lambda: len(upstream.calls()) >= 20, "the run under way")
                changed = await api.put("/v1/scopes/tenant:acme", json={
                    "rate_per_second": 10, "burst": 1, "reason": "upstream asked us to"})
                assert changed.status_code == 200
                assert changed.json()["budget_from_policy"] is False
                changed_at = await database_clock(engine)  # the change has committed
                await asyncio.sleep(3.0)  # the window below, at the new budget
                bad = await api.put("/v1/scopes/tenant:acme", json={"rate_per_second": 0,
                                                                     "burst": 1})
                assert bad.status_code == 422
        # within a second of the change the new budget holds: 10/s (+1 burst), counted over
        # the next two seconds of the calls' recorded starts (however long the sleep took)
        started = await call_starts(engine)
    after = [t for t in started if changed_at + 1.0 < t <= changed_at + 3.0]
    assert len(after) <= 10 * 2 + 2, len(after)
    assert len(after) >= 10 * 2 * 0.8


@pytest.mark.slow
async def test_workers_pause_stops_claims_and_resume_continues(db_url: str,
                                                               engine: AsyncEngine) -> None:
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url, rate={"per_second": 50, "burst": 1})
        async with LiveServer(test_settings(db_url, workers=4), policies, db_url) as live:
            async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url, headers={
                    "Authorization": f"Bearer {TOKEN_A}"}, timeout=10) as api:
                items = [{"tenant_id": "acme", "object_id": f"o{i}", "policy": "carts",
                          "due_at": "2026-01-01T00:00:00Z"} for i in range(100)]
                await api.post("/v1/items", json={"items": items})
                run = (await api.post("/v1/runs", json={})).json()
                await eventually(lambda: upstream.calls(), "the run under way")
                paused = await api.post("/v1/workers/pause", json={"reason": "incident"})
                assert paused.json()["workers_paused"] is True
                paused_at = await database_clock(engine)  # the pause has committed
                count = len(upstream.calls())
                await asyncio.sleep(1.5)  # long enough for any claim to have been tried
                # nothing starts once the pause has committed, but a call claimed just
                # before it: its token's look-ahead, its lateness, and clock calibration
                slack = rules.LOOKAHEAD_S + rules.late_tolerance(50) + 0.05
                late = [t - paused_at for t in await call_starts(engine)
                        if t > paused_at + slack]
                assert late == []
                assert 0 < count < 100
                await api.post("/v1/workers/resume")
                for _ in range(200):
                    body = (await api.get(f"/v1/runs/{run['id']}")).json()
                    if body["items"].get("succeeded") == 100:
                        break
                    await asyncio.sleep(0.05)
                assert body["items"] == {"succeeded": 100}
    assert len(upstream.calls()) == 100


async def test_scopes_listing_paginates(db_url: str) -> None:
    policies = make_policies("http://127.0.0.1:9")
    async with LiveServer(test_settings(db_url), policies, db_url) as live:
        async with httpx.AsyncClient(verify=public_roots(), base_url=live.base_url, headers={
                "Authorization": f"Bearer {TOKEN_A}"}, timeout=10) as api:
            items = [{"tenant_id": f"t{i}", "object_id": "o", "policy": "carts",
                      "due_at": "2026-01-01T00:00:00Z"} for i in range(5)]
            await api.post("/v1/items", json={"items": items})
            page = (await api.get("/v1/scopes", params={"limit": 3})).json()
            assert [s["name"] for s in page["scopes"]] == ["tenant:t0", "tenant:t1", "tenant:t2"]
            rest = (await api.get("/v1/scopes", params={"after": page["next_after"]})).json()
            assert [s["name"] for s in rest["scopes"]] == ["tenant:t3", "tenant:t4"]
            assert rest["scopes"][0]["rate_per_second"] == 1000
            assert rest["scopes"][0]["eligible"] == 0  # registered, not yet released
            workers = (await api.get("/v1/workers")).json()
            assert workers["workers_paused"] is False

