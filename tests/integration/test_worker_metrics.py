"""The worker's Prometheus series, read back from service.observability.metrics.REGISTRY: a pool
drains items against the fake upstream with a permanent failure, transient failures, a 429, a
lease that expired under a crashed worker (reclaimed) and a call whose lease is taken over
while it is in flight (its completion fenced out). Counters are process-wide, so the test
compares deltas."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.ledger import registration
from service.observability.metrics import REGISTRY, LeaseReturn
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.conftest import eventually
from tests.fakes.upstream import FakeUpstream, Fault
from tests.integration.test_pipeline import PAST, make_policies, release_all, statuses

POLICY = "carts"
PLAIN = [f"cart-{i}" for i in range(6)]
SPECIAL = ["cart-dead", "cart-flaky", "cart-throttled", "cart-fenced", "cart-reclaimed"]

SERIES: dict[str, tuple[str, dict[str, str]]] = {
    "claimed": ("sweeper_items_claimed_total", {"policy": POLICY}),
    "reclaimed": ("sweeper_lease_expiries_reclaimed_total", {"policy": POLICY}),
    "succeeded": ("sweeper_completions_total", {"policy": POLICY, "outcome": "succeeded"}),
    "permanent": ("sweeper_completions_total", {"policy": POLICY, "outcome": "permanent"}),
    "transient": ("sweeper_completions_total", {"policy": POLICY, "outcome": "transient"}),
    "throttled": ("sweeper_completions_total", {"policy": POLICY, "outcome": "throttled"}),
    "unknown": ("sweeper_completions_total", {"policy": POLICY, "outcome": "unknown"}),
    "late": ("sweeper_late_completions_total", {"policy": POLICY}),
    "dead_422": ("sweeper_items_dead_total", {"policy": POLICY, "reason": "http_422"}),
    **{f"returned_{r.value}": ("sweeper_leases_returned_total", {"reason": r.value})
       for r in LeaseReturn},
    "calls_succeeded": ("sweeper_upstream_request_duration_seconds_count",
                        {"policy": POLICY, "outcome": "succeeded"}),
    "calls_unknown": ("sweeper_upstream_request_duration_seconds_count",
                      {"policy": POLICY, "outcome": "unknown"}),
    "in_flight": ("sweeper_upstream_in_flight", {}),
    "granted": ("sweeper_limiter_tokens_granted_total", {}),
    "returned_tokens": ("sweeper_limiter_tokens_returned_total", {}),
    "signal_throttled": ("sweeper_scope_signals_total", {"reason": "throttled"}),
}


def snapshot() -> dict[str, float]:
    return {key: REGISTRY.get_sample_value(name, labels) or 0.0
            for key, (name, labels) in SERIES.items()}


async def ledger_shows(engine: AsyncEngine, expected: dict[str, int]) -> bool:
    return await statuses(engine) == expected


async def scalar(engine: AsyncEngine, sql: str, **params: Any) -> Any:
    async with engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar_one()


async def test_pool_metrics_count_what_the_ledger_shows(engine: AsyncEngine) -> None:
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url, max_attempts=3)
        pol = policies.policies[POLICY]
        await registration.register(engine, [registration.Registration("acme", o, pol, PAST)
                                       for o in PLAIN + SPECIAL])
        await release_all(engine)
        # a worker crashed holding this one: its lease has expired
        async with engine.begin() as conn:
            await conn.execute(text(
                "UPDATE items SET lease_owner = 'crashed', "
                "lease_token = gen_random_uuid(), attempts = 1, "
                "lease_expires_at = now() - interval '1 second' "
                "WHERE object_id = 'cart-reclaimed'"))
        upstream.inject(Fault.STATUS, status=422, match="cart-dead")
        upstream.inject(Fault.STATUS, status=503, times=2, match="cart-flaky")
        upstream.inject(Fault.STATUS, status=429, headers={"Retry-After": "0"},
                        match="cart-throttled")
        upstream.inject(Fault.HANG, match="cart-fenced")  # until the test ends it
        before = snapshot()
        ups = Upstreams(policies.upstreams)
        pool = database_pool(engine, policies, ups, concurrency=8)
        task = asyncio.create_task(pool.run())
        try:
            # while the fenced item's call hangs, its lease moves on (expired and re-claimed
            # elsewhere: a new token); then the call ends, unanswered
            await eventually(lambda: any("cart-fenced" in c.path for c in upstream.calls()),
                             "the call to hang")
            async with engine.begin() as conn:
                stolen = (await conn.execute(text(
                    "UPDATE items SET lease_token = gen_random_uuid(), lease_owner = 'thief', "
                    "lease_expires_at = now() + interval '1 hour' "
                    "WHERE object_id = 'cart-fenced' AND lease_token IS NOT NULL"))).rowcount
            assert stolen == 1
            assert upstream.end_hangs() == 1
            # the ledger's last state, not merely no item pending: a retry claimed and not
            # yet called is not pending either, and stop() would hand it back unstarted
            final = {"succeeded": 9, "dead": 1, "leased": 1}  # leased: the thief's
            await eventually(lambda: pool.fenced == 1, "the late completion fenced out")
            await eventually(lambda: ledger_shows(engine, final), "the ledger's last state")
        finally:
            pool.stop()
            await task
            await ups.aclose()
    after = snapshot()
    delta = {k: after[k] - before[k] for k in SERIES}

    assert await statuses(engine) == final
    rows = await scalar(engine, "SELECT count(*) FROM attempts WHERE worker = :w",
                        w=pool.name)
    # 11 items, plus retries after two 503s and a 429: 14 calls, of which the 9 successes
    # have no attempt row (their items record them)
    assert rows == 14 - 9
    called = rows + 9
    returned = sum(delta[f"returned_{r.value}"] for r in LeaseReturn)
    # every claim was either called or handed back unstarted (under load, some calls come
    # due too late and go back: claimed then exceeds the 14 calls)
    assert delta["claimed"] == called + returned
    # every token granted was spent on a call, refunded, or lost with a call that would
    # have started too late or past its lease (their refills are not given back:
    # service/worker/pending_writes.py, PendingWrites._hand_back)
    lost = delta["returned_late_token"] + delta["returned_lease_ending"]
    assert delta["granted"] - delta["returned_tokens"] == called + lost
    assert delta["reclaimed"] == 1 and pool.reclaimed == 1
    assert delta["late"] == 1 and pool.fenced == 1
    assert (delta["succeeded"], delta["permanent"], delta["transient"], delta["throttled"],
            delta["unknown"]) == (9, 1, 2, 1, 0)
    assert delta["dead_422"] == 1
    assert delta["calls_succeeded"] == 9 and delta["calls_unknown"] == 1
    assert delta["signal_throttled"] == 1
    assert delta["in_flight"] == 0
    # the labels stay bounded: no tenant, scope or object id anywhere in the output
    from prometheus_client import generate_latest

    exposition = generate_latest(REGISTRY).decode()
    assert "acme" not in exposition
    assert not [o for o in PLAIN + SPECIAL if o in exposition]


async def test_admit_charges_only_claimed_items_and_hand_back_refunds(engine: AsyncEngine
                                                                      ) -> None:
    from service.ledger import claims

    # burst 11: the bucket's stock stops one token short (late_tolerance(1/s) is 1 s)
    policies = make_policies("http://127.0.0.1:9", rate={"per_second": 1, "burst": 11})
    pol = policies.policies[POLICY]
    await registration.register(engine, [registration.Registration("acme", o, pol,
                                                                   PAST) for o in PLAIN])
    await release_all(engine)
    scope = "tenant:acme"
    tokens = "SELECT tokens FROM scopes WHERE name = :s"
    # ten tokens asked for six items: only six leave the bucket
    admitted = await claims.admit(engine, owner="w", wants={scope: 10},
                                  lease_seconds={POLICY: 60}, lookahead_s=0)
    assert [g.granted for g in admitted.grants] == [10] and len(admitted.leases) == 6
    assert 4.0 <= await scalar(engine, tokens, s=scope) < 4.1
    await claims.hand_back(engine, admitted.leases[:2])
    assert 6.0 <= await scalar(engine, tokens, s=scope) < 6.1
    assert await statuses(engine) == {"pending": 2, "leased": 4}
    assert await scalar(engine, "SELECT sum(attempts) FROM items") == 4  # refunded
    # a lease that moved on is not released, but its unspent token still goes back
    await claims.hand_back(engine, admitted.leases[:1])
    assert await statuses(engine) == {"pending": 2, "leased": 4}
    assert 7.0 <= await scalar(engine, tokens, s=scope) < 7.1
