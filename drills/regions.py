"""Drills of regions (service/config/regions.py), in each execution mode: two tenants pinned
to two regions share one scope (one budget), a worker process of each region drains them,
and every worker of one region is SIGKILLed mid-drain and another started in its place.

Judged from the upstream's log as the other drills are (drills/history.py), and by who
called whom: each call's path names the worker that made it (`/<worker>/t/<tenant>/...`),
so a call to a tenant by a worker of another region is seen where it happened."""

from __future__ import annotations

import signal
from collections import Counter

from drills.base import Drill, Facts, check
from drills.broker_stage import BrokerStage
from drills.history import judge
from drills.links import worker
from drills.stage import Stage
from drills.upstream import Call, FakeUpstream
from service.config.policies import load_policies

LEASE_S = 6
RATE, BURST = 80, 5
PER_TENANT = 600
# the workers of each region, by the name their calls carry; `f` replaces the killed `e`
WORKERS = {"eu": ("e", "f"), "us": ("u",)}


def _pin(stage: Stage) -> None:
    """The drill's policy with one scope for both tenants (so both regions' workers share
    one budget) and each tenant pinned to its region."""
    assert stage.policies_file is not None
    text = stage.policies_file.read_text(encoding="utf-8").replace(
        'scope = "tenant:{tenant_id}"', 'scope = "upstream:{upstream}"')
    stage.policies_file.write_text(
        f'{text}\n[regions]\neu = ["{stage.tenant("eu")}"]\nus = ["{stage.tenant("us")}"]\n',
        encoding="utf-8")
    stage.policies = load_policies(stage.policies_file)


def _wrong_region(stage: Stage, calls: list[Call]) -> list[str]:
    """Calls a worker made to a tenant of another region than its own."""
    region_of = {stage.tenant(region): region for region in WORKERS}
    wrong = []
    for call in calls:
        parts = call.path.split("/")  # "", worker, "t", tenant, object
        if parts[1] not in WORKERS[region_of[parts[3]]]:
            wrong.append(call.path)
    return wrong


async def _region_killed(stage: Stage, broker: BrokerStage | None) -> Facts:
    upstream: FakeUpstream = stage.start_upstream()
    stage.write_policies(rate=RATE, burst=BURST, lease=LEASE_S, timeout=3)
    _pin(stage)
    env = {} if broker is None else broker.env
    keys = [key for region in WORKERS for key in await stage.register(
        [f"{region}{i}" for i in range(PER_TENANT)], stage.tenant(region))]
    eu = worker(stage, "e", {**env, "SWEEPER_REGION": "eu"})
    us = worker(stage, "u", {**env, "SWEEPER_REGION": "us"})
    await stage.wait_started(eu, us)
    await stage.release()

    async def both_calling() -> bool:
        seen = Counter(call.path.split("/")[1] for call in upstream.calls())
        return seen["e"] >= 50 and seen["u"] >= 50

    await stage.wait_for("both regions calling", both_calling, 60, 0.05)
    eu.signal(signal.SIGKILL)  # every worker of region eu
    facts: Facts = {"calls_at_kill": len(upstream.calls())}
    await stage.wait_started(worker(stage, "f", {**env, "SWEEPER_REGION": "eu"}))
    await stage.wait_all_finished(2 * PER_TENANT, 180)
    calls = upstream.calls()
    facts.update(await judge(stage, calls, keys, rate=RATE, burst=BURST, lease_s=LEASE_S))
    wrong = _wrong_region(stage, calls)
    check(not wrong, f"{len(wrong)} calls by a worker of another region, e.g. {wrong[:2]}")
    check(facts["statuses"] == {"succeeded": 2 * PER_TENANT}, f"items {facts['statuses']}")
    evidence = await stage.fetch(
        "SELECT i.tenant_id, i.region, count(*) AS n FROM items i GROUP BY 1, 2")
    check({(r["tenant_id"], r["region"]) for r in evidence}
          == {(stage.tenant(region), region) for region in WORKERS},
          f"items by tenant and region {[tuple(r) for r in evidence]}")
    if broker is not None:
        await stage.stop_all([p for p in stage.procs if p.alive()], exited_ok=True)
        left = await broker.take_all()
        open_ = await stage.fetch(
            "SELECT id FROM items WHERE id = ANY($1::bigint[]) "
            "AND status NOT IN ('succeeded', 'dead')",
            sorted({i for work in left for i in work.item_ids}))
        check(not open_, f"{len(open_)} unfinished items in messages left in the broker")
        facts["messages_left"] = len(left)
    return facts


async def region_killed(stage: Stage) -> Facts:
    """Database mode: the eu worker SIGKILLed; its leases run out and the new eu worker
    takes them over; the us worker never touches them."""
    return await _region_killed(stage, None)


async def broker_region_killed(stage: Stage) -> Facts:
    """Broker mode: the same, each region on its own queues."""
    return await _region_killed(stage, await BrokerStage.open(stage))


_SETUP = ("two tenants pinned to regions eu and us sharing one scope at 80/s, 600 items "
          "each, a worker process of each region")
_FAULT = "SIGKILL every eu worker mid-drain, then start another eu worker"
_ASSERTION = ("0 lost, 0 succeeded twice, none called 3 times (twice only after a lease), no "
              "second over rate + burst, and no call by a worker of another region")
DRILLS = [
    Drill(38, "region-workers-killed", _SETUP, _FAULT, _ASSERTION, region_killed),
    Drill(39, "broker-region-workers-killed", f"broker mode: {_SETUP}", _FAULT,
          f"{_ASSERTION}; every message settled", broker_region_killed),
]
