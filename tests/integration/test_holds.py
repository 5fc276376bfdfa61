"""Legal holds on a real database with the fake upstream over loopback: no call starts for a
held item once the hold has taken effect (on any replica), held items wait unpunished and
drain after the release, and the API refuses bad holds."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.policies import Policies
from service.db.engine import make_engine
from service.ledger import gauges, holds
from service.ledger import registration as ledger
from service.runs import progress, publication, trigger
from service.upstreams.deletion_api import Upstreams
from service.webhooks import intake
from service.worker import WorkerPool, database_pool
from tests.conftest import LiveServer, eventually, policies_from, test_settings
from tests.fakes.upstream import Call, FakeUpstream, Fault
from tests.integration import test_webhooks as hooks

PAST = datetime(2026, 1, 1, tzinfo=UTC)
ACTOR = "test"


def make_policies(base_url: str) -> Policies:
    policy = {"version": 1, "upstream": "shop", "scope": "tenant:{tenant_id}",
              "rate": {"per_second": 5000, "burst": 1000}, "lease_seconds": 30,
              "max_attempts": 3, "backoff": {"base_seconds": 0.01, "max_seconds": 0.05}}
    return policies_from({
        "upstreams": {"shop": {"base_url": base_url, "timeout_seconds": 5}},
        "policies": {"carts": {**policy, "path": "/carts/{tenant_id}/{object_id}"},
                     "exports": {**policy, "path": "/exports/{tenant_id}/{object_id}"}}})


def called(call: Call) -> tuple[str, str, str]:
    """(policy, tenant, object id) of a call to make_policies' paths."""
    policy, tenant, object_id = call.path.strip("/").split("/")
    return {"carts": "carts", "exports": "exports"}[policy], tenant, object_id


async def register(engine: AsyncEngine, policies: Policies,
                   keys: list[tuple[str, str, str]]) -> None:
    await ledger.register(engine, [ledger.Registration(t, o, policies.policies[p], PAST)
                                   for p, t, o in keys])


async def release_all(engine: AsyncEngine) -> int:
    run_id, _ = await trigger.create_run(engine, trigger.RunRequest(None, None, None,
                                                                    False, None),
                                         None)
    assert await publication.publish(engine, run_id, batch_size=50)
    return run_id


async def items(engine: AsyncEngine) -> dict[tuple[str, str, str], dict[str, Any]]:
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT id, policy, tenant_id, object_id, hold_id, attempts, "
            "CASE WHEN lease_token IS NOT NULL THEN 'leased' ELSE status END AS status "
            "FROM items"))
        ).all()
    return {(r.policy, r.tenant_id, r.object_id): dict(r._mapping) for r in rows}


async def drain(pools: list[WorkerPool], engine: AsyncEngine, *, leave: int = 0,
                rounds: int = 400) -> None:
    """Run admission rounds until at most `leave` items are pending or leased."""
    for _ in range(rounds):
        for pool in pools:
            await pool.run_once()
        for pool in pools:
            await pool.drain()
        open_items = sum(1 for i in (await items(engine)).values()
                         if i["status"] in ("pending", "leased"))
        if open_items <= leave:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the drain did not finish")



async def test_held_items_wait_unpunished_and_drain_after_the_release(
        engine: AsyncEngine, upstream: FakeUpstream, db_url: str) -> None:
    policies = make_policies(upstream.base_url)
    keys = ([("carts", "acme", f"cart-{n}") for n in range(20)]
            + [("exports", "acme", f"cart-{n}") for n in range(5)]
            + [("carts", "globex", f"cart-{n}") for n in range(10)])
    await register(engine, policies, keys)
    hold = await holds.place(engine, holds.HoldSpec(
        tenant_id="acme", policy="carts", object_id_prefix="cart-1", reason="litigation",
        reference="CASE-1"), actor=ACTOR)
    covered = {("carts", "acme", "cart-1")} | {("carts", "acme", f"cart-1{n}")
                                                for n in range(10)}
    assert hold["items_held"] == 11 and hold["in_flight"] == 0 and hold["active"]
    assert hold["effective_at"] is not None and hold["placed_at"] <= hold["effective_at"]
    # registered after the hold: covered too, by registration and by a webhook hint
    await register(engine, policies, [("carts", "acme", "cart-100")])
    webhook_policies = hooks.make_policies(upstream.base_url)
    shop_hold = await holds.place(engine, holds.HoldSpec(
        tenant_id=hooks.SHOP, object_ids=["777"], reason="regulator", reference="DPA-9"),
        actor=ACTOR)
    box = intake.Intake()
    try:
        receipt = await box.apply(engine.url, test_settings(db_url), hooks.verified(
            webhook_policies, hooks.shopify("orders/cancelled", {"id": 777})))
    finally:
        await box.aclose()
    assert len(receipt.item_ids) == 1  # recorded (and released: it is due now)
    covered.add(("carts", "acme", "cart-100"))
    report_only, _ = await trigger.create_run(
        engine, trigger.RunRequest(None, None, None, True, None), None)
    assert await publication.publish(engine, report_only, batch_size=50)
    report = (await progress.run_status(engine, report_only,
                                        progress.ProgressCache()) or {})["report"]
    assert {p: f["held"] for p, f in report["policies"].items()} == {
        "carts": len(covered), "exports": 0}
    run_id = await release_all(engine)

    ups = Upstreams(policies.upstreams)
    pool = database_pool(engine, policies, ups, concurrency=8)
    try:
        await drain([pool], engine, leave=len(covered) + 1)
        state = await items(engine)
        held = {k for k, i in state.items() if i["hold_id"] is not None}
        assert held == covered | {("carts", hooks.SHOP, "777")}
        assert all(state[k]["status"] == "pending" and state[k]["attempts"] == 0 for k in held)
        assert {called(c) for c in upstream.calls()} == set(state) - held
        assert all(i["status"] == "succeeded" for k, i in state.items() if k not in held)

        status = await progress.run_status(engine, run_id, progress.ProgressCache())
        assert status is not None and status["items"]["held"] == len(covered)
        snap = await gauges.read_ledger(engine)
        assert snap.held == {"carts": len(covered) + 1} and snap.holds_active == 2

        released = await holds.release(engine, hold["id"], why="settled", actor=ACTOR)
        assert released["items_freed"] == len(covered) and not released["active"]
        with pytest.raises(holds.HoldAlreadyReleased):
            await holds.release(engine, hold["id"], why="again", actor=ACTOR)
        with pytest.raises(holds.HoldNotFound):
            await holds.release(engine, 10**12, why="nothing", actor=ACTOR)
        # released by the run and due: claimable at once
        await drain([pool], engine, leave=1)
    finally:
        await ups.aclose()
    state = await items(engine)
    assert {k for k, i in state.items() if i["status"] != "succeeded"} == {
        ("carts", hooks.SHOP, "777")}
    async with engine.connect() as conn:
        actions = (await conn.execute(text(
            "SELECT action, reason, details->>'hold_id' FROM operator_actions ORDER BY id"))
        ).all()
    assert [tuple(a) for a in actions] == [
        ("hold.place", "litigation", str(hold["id"])),
        ("hold.place", "regulator", str(shop_hold["id"])),
        ("hold.release", "settled", str(hold["id"]))]


async def test_a_hold_placed_during_a_drain_on_two_replicas(
        db_url: str, engine: AsyncEngine, upstream: FakeUpstream) -> None:
    """Two replicas (an engine and a pool each) drain at full speed with calls in flight
    (every answer takes 5 ms); a hold placed meanwhile: no call for a held item reaches the
    upstream after the hold took effect unless the hold lists it as in flight, every
    unheld item drains, and after the release the held ones do."""
    upstream.inject(Fault.STATUS, times=None, status=204, delay=0.005)
    policies = make_policies(upstream.base_url)
    tenants = ("acme", "globex", "initech")
    keys = [("carts", t, f"o-{n}") for t in tenants for n in range(300)]
    await register(engine, policies, keys)
    await release_all(engine)
    other = make_engine(engine.url, test_settings(db_url))
    ups = [Upstreams(policies.upstreams), Upstreams(policies.upstreams)]
    pools = [database_pool(engine, policies, ups[0], concurrency=16),
             database_pool(other, policies, ups[1], concurrency=16)]
    runners = [asyncio.create_task(p.run()) for p in pools]
    try:
        await eventually(lambda: len(upstream.calls()) >= 150, "150 calls made")
        hold = await holds.place(engine, holds.HoldSpec(
            tenant_id="globex", reason="litigation", reference="CASE-2"), actor=ACTOR)
        effective = hold["effective_at"].timestamp()
        state = await _wait_until(engine, lambda s: all(
            i["status"] == "succeeded" for k, i in s.items() if k[1] != "globex")
            and not any(i["status"] == "leased" for i in s.values()))
        in_flight = set(hold["in_flight_item_ids"])
        assert hold["in_flight"] == len(in_flight)
        late = [c for c in upstream.calls() if called(c)[1] == "globex"
                and c.wall_time >= effective
                and state[called(c)]["id"] not in in_flight]
        assert late == []
        held = {k for k, i in state.items() if k[1] == "globex" and i["status"] == "pending"}
        assert held and all(state[k]["hold_id"] == hold["id"] for k in held)
        assert len(held) <= hold["items_held"] <= len(held) + len(in_flight)
        released = await holds.release(engine, hold["id"], why="settled", actor=ACTOR)
        assert released["items_freed"] == len(held)
        await _wait_until(engine, lambda s: all(i["status"] == "succeeded"
                                                for i in s.values()))
    finally:
        for p in pools:
            p.stop()
        await asyncio.gather(*runners)
        for u in ups:
            await u.aclose()
        await other.dispose()
    keys_called = [c.idempotency_key for c in upstream.calls()]
    assert len(keys_called) == len(set(keys_called)) == len(keys)


async def _wait_until(engine: AsyncEngine, done: Any, timeout_s: float = 60.0
                      ) -> dict[tuple[str, str, str], dict[str, Any]]:
    async def reached() -> dict[tuple[str, str, str], dict[str, Any]] | None:
        state = await items(engine)
        return state if done(state) else None

    found: dict[tuple[str, str, str], dict[str, Any]] = await eventually(
        reached, "the items' states", timeout_s)
    return found


async def test_an_interrupted_placement_is_enforced_and_finished(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    """A hold whose marking never committed (the process died between its two steps): the
    admission's own check keeps its items from being claimed, and the maintenance pass
    marks them; an expired hold is released by the maintenance pass."""
    policies = make_policies(upstream.base_url)
    await register(engine, policies, [("carts", "acme", f"c-{n}") for n in range(6)])
    async with engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO holds (tenant_id, object_ids, reason, reference, placed_by, "
            "placed_at) VALUES ('acme', '{c-1,c-2}', 'crash', 'CASE-3', 'test', "
            "now() - interval '2 minutes')"))
        # what step 1 commits with the hold: its object ids, indexed for the item-side checks
        await conn.execute(text(
            "INSERT INTO hold_objects SELECT 'acme', o, id FROM holds, unnest(object_ids) o"))
    await release_all(engine)
    ups = Upstreams(policies.upstreams)
    pool = database_pool(engine, policies, ups, concurrency=4)
    try:
        await drain([pool], engine, leave=2)
        state = await items(engine)
        assert {k[2] for k, i in state.items() if i["status"] == "pending"} == {"c-1", "c-2"}
        assert all(i["hold_id"] is None for i in state.values())
        assert await holds.maintain(engine) == (0, 1)
        state = await items(engine)
        assert {k[2] for k, i in state.items() if i["hold_id"] is not None} == {"c-1", "c-2"}
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE holds SET expires_at = now() - interval '1 s'"))
        assert await holds.maintain(engine) == (1, 0)
        [hold] = await holds.list_holds(engine, tenant_id="acme", active=None, before=None,
                                        limit=10)
        assert hold["release_why"] == "expired" and hold["released_by"] == holds.SYSTEM_ACTOR
        await drain([pool], engine)
    finally:
        await ups.aclose()
    assert {i["status"] for i in (await items(engine)).values()} == {"succeeded"}


async def test_an_item_registered_while_a_hold_is_placed_is_never_claimed(
        engine: AsyncEngine, upstream: FakeUpstream) -> None:
    """A registration whose statement began before the hold committed does not mark its
    item, and the hold's marking cannot see an insert not yet committed: the admission's
    own check of the active holds keeps the item unclaimed."""
    policies = make_policies(upstream.base_url)
    await register(engine, policies, [("carts", "acme", "seed")])  # creates the scope row
    item = ("carts", "acme", "late")
    async with engine.connect() as registration:
        await registration.execute(text(
            "INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key, "
            "scope, due_at, hold_id) VALUES ('acme', 'late', 'carts', 1, :key, "
            "'tenant:acme', :due, NULL)"),
            {"key": ledger.operation_key(*item[1:], item[0], 1), "due": PAST})
        hold = await holds.place(engine, holds.HoldSpec(
            tenant_id="acme", object_ids=["late"], reason="race", reference="CASE-4"),
            actor=ACTOR)
        await registration.commit()
    assert hold["items_held"] == 0
    await release_all(engine)
    ups = Upstreams(policies.upstreams)
    pool = database_pool(engine, policies, ups, concurrency=4)
    try:
        await drain([pool], engine, leave=1)
        for _ in range(5):  # more rounds, from the front of the index: still never taken
            await pool.run_once()
            await pool.drain()
        state = await items(engine)
        assert state[item]["status"] == "pending" and state[item]["hold_id"] is None
        assert [called(c) for c in upstream.calls()] == [("carts", "acme", "seed")]
        await holds.release(engine, hold["id"], why="over", actor=ACTOR)
        await drain([pool], engine)
    finally:
        await ups.aclose()
    assert (await items(engine))[item]["status"] == "succeeded"


async def test_marking_goes_chunk_by_chunk_and_counts_every_call_in_flight(
        engine: AsyncEngine) -> None:
    """A hold's items are marked a chunk at a time; the leased ones of every chunk, and
    a covered item that finished after the hold was recorded, are the calls in flight."""
    policies = make_policies("http://127.0.0.1:9")
    await register(engine, policies, [("carts", "acme", f"c-{n:02}") for n in range(11)])
    async with engine.begin() as conn:
        await conn.execute(text(
            "UPDATE items SET released_at = now(), lease_owner = 'w', "
            "lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 min' "
            "WHERE object_id IN ('c-01', 'c-05', 'c-09')"))
        hold_id = (await conn.execute(text(
            "INSERT INTO holds (tenant_id, reason, reference, placed_by, placed_at) "
            "VALUES ('acme', 'chunks', 'CASE-5', 'test', now() - interval '1 s') "
            "RETURNING id"))).scalar_one()
        await conn.execute(text(
            "UPDATE items SET status = 'succeeded', completed_at = now(), "
            "last_outcome = 'succeeded' WHERE object_id = 'c-10'"))
    hold = await holds.mark(engine, hold_id, chunk=3)
    state = await items(engine)
    ids = {k[2]: i["id"] for k, i in state.items()}
    assert {k[2] for k, i in state.items() if i["hold_id"] == hold_id} == {
        f"c-{n:02}" for n in range(10)}
    assert hold["items_held"] == 10 and hold["effective_at"] is not None
    assert hold["in_flight"] == 4
    assert hold["in_flight_item_ids"] == sorted(ids[o] for o in ("c-01", "c-05", "c-09",
                                                                 "c-10"))
    assert await holds.mark(engine, hold_id) == await holds.get(engine, hold_id)


# -- the property: no call starts for an item under a hold in force ----------------------------

_ids = st.sampled_from([f"o-{n}" for n in range(6)] + ["p-1", "p-10"])
_hold = st.fixed_dictionaries({
    "tenant_id": st.sampled_from(["t1", "t2"]),
    "policy": st.sampled_from([None, "carts", "exports"]),
    "selector": st.one_of(st.none(), st.lists(_ids, min_size=1, max_size=3),
                          st.sampled_from(["o-", "p-1", "o-3", "x"]))})
_step = st.one_of(
    st.tuples(st.just("register"), st.sampled_from(["carts", "exports"]),
              st.sampled_from(["t1", "t2"]), _ids),
    st.tuples(st.just("hold"), _hold),
    st.tuples(st.just("release"), st.integers(0, 5)),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.005, 0.02])))
_examples = itertools.count()
_placed: list[dict[str, Any]] = []  # every example's holds: the property is about them all


def _covers(hold: dict[str, Any], key: tuple[str, str, str]) -> bool:
    policy, tenant, object_id = key
    return (hold["tenant_id"] == tenant
            and hold["policy"] in (None, policy)
            and (hold["object_ids"] is None or object_id in hold["object_ids"])
            and (hold["object_id_prefix"] is None
                 or object_id.startswith(hold["object_id_prefix"])))


@pytest.mark.slow  # 25 examples, each a pool draining while holds come and go
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=st.lists(_step, min_size=3, max_size=14))
async def test_no_call_starts_under_a_hold_in_force(
        engine: AsyncEngine, upstream: FakeUpstream, steps: list[Any]) -> None:
    """Random registrations, holds and releases while a worker pool drains continuously:
    every call the upstream received for an item was made while no hold covering it was in
    force (from its effective_at to its release), except the calls the hold listed as in
    flight."""
    example = next(_examples)
    policies = make_policies(upstream.base_url)
    tenant = {"t1": f"e{example}-t1", "t2": f"e{example}-t2"}
    ups = Upstreams(policies.upstreams)
    pool = database_pool(engine, policies, ups, concurrency=4)
    runner = asyncio.create_task(pool.run())
    placed: list[dict[str, Any]] = []
    try:
        for step in steps:
            if step[0] == "register":
                _, policy, t, object_id = step
                await ledger.register(engine, [ledger.Registration(
                    tenant[t], object_id, policies.policies[policy], PAST)])
                await publication.publish(engine, (await trigger.create_run(
                    engine, trigger.RunRequest(None, None, None, False, None), None))[0],
                    batch_size=50)
            elif step[0] == "hold":
                spec = step[1]
                selector = spec["selector"]
                placed.append(await holds.place(engine, holds.HoldSpec(
                    tenant_id=tenant[spec["tenant_id"]], policy=spec["policy"],
                    object_ids=selector if isinstance(selector, list) else None,
                    object_id_prefix=selector if isinstance(selector, str) else None,
                    reason="property", reference=f"E{example}"), actor=ACTOR))
            elif step[0] == "release" and placed:
                hold = placed[step[1] % len(placed)]
                if hold.get("released_at") is None:
                    released = await holds.release(engine, hold["id"], why="done", actor=ACTOR)
                    hold["released_at"] = released["released_at"]
            else:
                # the interleaving is what the property explores: a step may be a pause
                await asyncio.sleep(step[1] if step[0] == "wait" else 0)
        await asyncio.sleep(0.05)  # and the pool runs on a little after the last step
    finally:
        pool.stop()
        await runner
        await ups.aclose()
    _placed.extend(placed)
    state = await items(engine)
    for call in upstream.calls():
        key = called(call)
        item_id = state[key]["id"]
        for hold in _placed:
            end = hold.get("released_at")
            in_force = (hold["effective_at"].timestamp() <= call.wall_time
                        and (end is None or call.wall_time < end.timestamp()))
            assert not (in_force and _covers(hold, key)
                        and item_id not in hold["in_flight_item_ids"]), (call, hold)


# -- the API -----------------------------------------------------------------------------------

@pytest.fixture
async def holds_api(db_url: str) -> AsyncIterator[httpx.AsyncClient]:
    policies = make_policies("http://127.0.0.1:9")
    async with LiveServer(test_settings(db_url), policies, db_url) as live:
        async with live.client() as client:
            yield client


GOOD = {"tenant_id": "acme", "reason": "litigation hold", "reference": "CASE-7"}


async def post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    """POST `body` as ASCII JSON: a lone surrogate travels as its escape, as valid JSON
    allows (httpx's own encoding refuses it)."""
    return await client.post(url, content=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
FUTURE = (datetime.now(UTC) + timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(("body", "field"), [
    ({"reason": "r", "reference": "c"}, "tenant_id"),
    ({**GOOD, "tenant_id": ""}, "tenant_id"),
    ({**GOOD, "tenant_id": "."}, "tenant_id"),
    ({**GOOD, "tenant_id": "\U0001d11e" * 129}, "tenant_id"),  # 516 bytes
    ({**GOOD, "object_id_prefix": ""}, "object_id_prefix"),
    ({**GOOD, "object_id_prefix": "€" * 200}, "object_id_prefix"),  # 600 bytes
    ({**GOOD, "object_ids": []}, "object_ids"),
    ({**GOOD, "object_ids": ["a"] * 1001}, "object_ids"),
    ({**GOOD, "object_ids": ["a"], "object_id_prefix": "a"}, "body"),
    ({**GOOD, "expires_at": "2020-01-01T00:00:00Z"}, "expires_at"),
    ({**GOOD, "expires_at": "10000-01-01T00:00:00Z"}, "expires_at"),
    ({**GOOD, "expires_at": 1893456000}, "expires_at"),
    ({**GOOD, "policy": "no-such-policy"}, "policy"),
    ({**GOOD, "reason": ""}, "reason"),
    ({**GOOD, "reason": "line\nbreak"}, "reason"),
    ({**GOOD, "reference": "x" * 201}, "reference"),
    ({**GOOD, "expiry": FUTURE}, "expiry"),
    ({**GOOD, "object_id_prefix": "\ud800"}, "object_id_prefix"),
    ({**GOOD, "object_ids": ["ok", "\udfff"]}, "1"),
])
async def test_bad_holds_are_refused_naming_the_field(holds_api: httpx.AsyncClient,
                                                      body: dict[str, Any], field: str) -> None:
    r = await post(holds_api, "/v1/holds", body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert any(field in e["loc"] for e in r.json()["errors"]), r.json()
    listed = await holds_api.get("/v1/holds")
    assert listed.json()["holds"] == []


@pytest.mark.parametrize("text_field", ["reason", "reference"])
async def test_text_no_database_can_store_is_refused(holds_api: httpx.AsyncClient,
                                                     text_field: str) -> None:
    r = await post(holds_api, "/v1/holds", {**GOOD, text_field: "a\ud800b"})
    assert r.status_code == 422 and r.headers["content-type"].startswith(
        "application/problem+json"), r.text
    assert (await holds_api.get("/v1/holds")).json()["holds"] == []
    hold = (await holds_api.post("/v1/holds", json=GOOD)).json()
    r = await post(holds_api, f"/v1/holds/{hold['id']}/release", {"why": "\udfff"})
    assert r.status_code == 422, r.text
    assert (await holds_api.get(f"/v1/holds/{hold['id']}")).json()["active"]


async def test_place_list_read_and_release_over_the_api(holds_api: httpx.AsyncClient) -> None:
    registered = await holds_api.post("/v1/items", json={"items": [
        {"tenant_id": "acme", "object_id": o, "policy": "carts",
         "due_at": "2026-01-01T00:00:00Z"} for o in ("c-1", "c-3")]})
    assert registered.status_code == 200, registered.text
    r = await holds_api.post("/v1/holds", json={**GOOD, "policy": "carts",
                                                "object_ids": ["c-1", "c-2"],
                                                "expires_at": FUTURE})
    assert r.status_code == 201, r.text
    hold = r.json()
    assert hold["items_held"] == 1
    listed = (await holds_api.get("/v1/items", params={"tenant_id": "acme"})).json()["items"]
    assert {i["object_id"]: i["hold_id"] for i in listed} == {"c-1": hold["id"], "c-3": None}
    assert hold["active"] and hold["placed_by"] and hold["in_flight"] == {"count": 0,
                                                                          "item_ids": []}
    other = (await holds_api.post("/v1/holds", json={**GOOD, "tenant_id": "globex",
                                                      "object_id_prefix": "c-"})).json()
    assert (await holds_api.get(f"/v1/holds/{hold['id']}")).json() == hold
    page = (await holds_api.get("/v1/holds", params={"limit": 1})).json()
    assert [h["id"] for h in page["holds"]] == [other["id"]]
    page = (await holds_api.get("/v1/holds", params={"before": page["next_before"]})).json()
    assert [h["id"] for h in page["holds"]] == [hold["id"]]
    assert [h["id"] for h in (await holds_api.get(
        "/v1/holds", params={"tenant_id": "globex"})).json()["holds"]] == [other["id"]]

    assert (await holds_api.post(f"/v1/holds/{hold['id']}/release", json={})).status_code == 422
    r = await holds_api.post(f"/v1/holds/{hold['id']}/release", json={"why": "settled"})
    assert r.status_code == 200, r.text
    assert not r.json()["active"] and r.json()["release_why"] == "settled"
    assert r.json()["items_freed"] == 1
    listed = (await holds_api.get("/v1/items", params={"tenant_id": "acme"})).json()["items"]
    assert {i["hold_id"] for i in listed} == {None}
    again = await holds_api.post(f"/v1/holds/{hold['id']}/release", json={"why": "again"})
    assert again.status_code == 409 and again.json()["type"].endswith("hold-already-released")
    missing = await holds_api.post("/v1/holds/999999/release", json={"why": "x"})
    assert missing.status_code == 404 and missing.json()["type"].endswith("hold-not-found")
    assert (await holds_api.get("/v1/holds/999999")).status_code == 404
    assert (await holds_api.get("/v1/holds/0")).status_code == 422
    active = (await holds_api.get("/v1/holds", params={"active": "true"})).json()["holds"]
    assert [h["id"] for h in active] == [other["id"]]
    assert (await holds_api.get("/v1/holds", params={"activ": "true"})).status_code == 422
