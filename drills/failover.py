"""A managed PostgreSQL failing over mid-drain: a primary and its streaming standby, which the
drill creates on loopback ports (pg_basebackup), and Sweeper given both hosts in the libpq
form such services hand out (`postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write`).
The primary is lost (an immediate shutdown, as a host gone) and the standby promoted.

With synchronous replication every commit Sweeper was told of is on the standby, so nothing
acknowledged is lost: items in flight at the loss had their leases committed, and outcomes
not yet written are written to the new primary. With asynchronous replication the tail the
standby had not received is lost: those items are claimed and called again, under the same
key (`failover-async` reports how many)."""

from __future__ import annotations

import time

import httpx

from drills.base import Drill, Facts, check
from drills.history import judge
from drills.pgserver import PrivateServer
from drills.scratch import create_database
from drills.stage import Stage, free_port

ITEMS = 300
RATE, BURST = 60, 5
LEASE_S = 8
RECONNECT_LIMIT_S = 15.0
# replication on; the primary waits for the standby before a commit returns once it has
# one (synchronous_standby_names, set after the copy: before, every commit would wait)
PRIMARY_CONF = ("wal_level = replica\nmax_wal_senders = 5\nhot_standby = on\n"
                "synchronous_commit = on\n")
# promoted, the standby has no standby of its own: it must not wait for one
STANDBY_CONF = "synchronous_standby_names = ''\n"


async def _pair(stage: Stage, synchronous: bool) -> tuple[PrivateServer, PrivateServer]:
    primary = PrivateServer(stage.workdir / "primary", free_port(), conf=PRIMARY_CONF)
    standby = PrivateServer(stage.workdir / "standby", free_port(), conf=STANDBY_CONF)
    stage.cleanups += [primary.destroy, standby.destroy]
    await primary.start()
    # the database exists before the copy: the standby has the schema from its first byte
    await create_database(primary.url, "sweeper")
    await standby.follow(primary)
    stage.db_url = (f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
                    "/sweeper?target_session_attrs=read-write")

    if synchronous:
        await stage.fetch("ALTER SYSTEM SET synchronous_standby_names = '*'")
        await stage.fetch("SELECT pg_reload_conf()")
    state = "sync" if synchronous else "async"

    async def streaming() -> bool:
        rows = await stage.fetch("SELECT sync_state FROM pg_stat_replication "
                                 "WHERE state = 'streaming'")
        return [r["sync_state"] for r in rows] == [state]

    await stage.wait_for(f"the standby streaming, {state}", streaming, 30)
    return primary, standby


async def failover(stage: Stage, synchronous: bool = True) -> Facts:
    primary, standby = await _pair(stage, synchronous)
    upstream = stage.start_upstream()
    stage.write_policies(rate=RATE, burst=BURST, lease=LEASE_S, timeout=3)
    keys = await stage.register([f"o{i}" for i in range(ITEMS)])
    api = await stage.start_api({"SWEEPER_DB_POOL_TIMEOUT_SECONDS": "2"})
    workers = [stage.start_worker(workers=4) for _ in range(2)]
    await stage.wait_started(*workers)
    await stage.release()

    async def some_done() -> bool:
        return len(upstream.calls()) >= 60

    await stage.wait_for("calls before the failover", some_done, 30, 0.02)
    await primary.crash()
    lost_at, lost_wall = time.monotonic(), time.time()
    calls_at_loss = len(upstream.calls())
    await standby.promote()
    promoted_s = time.monotonic() - lost_at

    async def calling_again() -> bool:
        return len(upstream.calls()) > calls_at_loss + 5

    reconnect_s = promoted_s + await stage.wait_for("workers calling again", calling_again,
                                                    60, 0.05)
    async with stage.api_client(api, timeout=10) as client:
        async def api_writes() -> bool:
            try:
                answer = await client.post("/v1/runs", json={"policy": "drill", "dry_run": True})
            except httpx.HTTPError:
                return False
            return answer.status_code in (200, 202)

        api_s = promoted_s + await stage.wait_for("the API writing again", api_writes, 60)
    await stage.wait_all_finished(ITEMS, 120)
    facts = await judge(stage, upstream.calls(), keys, rate=RATE, burst=BURST,
                        lease_s=LEASE_S, failover_at=lost_wall)
    facts.update({"calls_before_loss": calls_at_loss, "promoted_after_s": round(promoted_s, 2),
                  "workers_calling_after_s": round(reconnect_s, 2),
                  "api_writing_after_s": round(api_s, 2)})
    stage.facts.update(facts)
    check(facts["statuses"] == {"succeeded": ITEMS}, f"items {facts['statuses']}")
    in_flight = 2 * 4  # two worker processes of four calls each
    check(facts["called_twice"] <= in_flight, f"{facts['called_twice']} objects called "
                                              f"twice: more than the {in_flight} in flight")
    check(reconnect_s <= RECONNECT_LIMIT_S,
          f"workers took {reconnect_s:.1f} s to call again after the loss")
    check(api_s <= RECONNECT_LIMIT_S, f"the API took {api_s:.1f} s to write again")
    await stage.stop_all([*workers, api])
    return facts


async def failover_async(stage: Stage) -> Facts:
    return await failover(stage, synchronous=False)


DRILLS = [
    Drill(21, "failover",
          "a primary and a synchronous streaming standby on loopback ports, both hosts in "
          f"the service's URL (libpq form, read-write); {ITEMS} items at 60/s, 2 worker "
          f"processes and an API process; leases of {LEASE_S} s",
          "the primary shut down immediately mid-drain, the standby promoted",
          f"workers and API write to the new primary within {RECONNECT_LIMIT_S:.0f} s; "
          "every item succeeds; none lost; an object is called twice only if its call was "
          "in flight at the loss (same key), never three times; the history checker's "
          "invariants (drills/history.py)", failover),
    Drill(22, "failover-async",
          "as failover, the standby asynchronous: commits do not wait for it",
          "the primary shut down immediately mid-drain, the standby promoted",
          "as failover: a tail of commits the standby had not received is lost, and what it "
          "costs is reported (objects called twice, under the same key); nothing is lost and "
          "no object is called three times", failover_async),
]
