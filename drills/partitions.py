"""Drills where the network fails rather than a process: links to PostgreSQL or to the
upstream blackholed (nothing arrives, nothing is refused) through the drill's fault proxy
(drills/faultproxy.py), for one replica or for all, longer than the leases, then healed.

Judged from outside (drills/history.py): the upstream's own log of calls (which replica made
each: every worker process calls the upstream under a path prefix of its own) against the
ledger's final state and the leases' length."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
from sqlalchemy.engine import make_url

from drills.base import Drill, Facts, check
from drills.faultproxy import FaultProxy
from drills.history import judge
from drills.stage import Proc, Stage, worst_window
from drills.upstream import Call

LEASE_S = 6
CUT_S = 2.5 * LEASE_S  # longer than any lease the cut replica holds
BLACKHOLE_S = 30.0
SLACK_S = 1.0  # a call started within a second of its lease's end is the call's own write


def _server(url: str) -> tuple[str, int]:
    """Where the drill's PostgreSQL listens: its host and port, or its socket directory
    (an embedded server's `?host=/dir`) and port."""
    parsed = make_url(url)
    return str(parsed.host or parsed.query.get("host") or "127.0.0.1"), int(parsed.port or 5432)


async def _through(stage: Stage, proxy: FaultProxy) -> str:
    """The drill database's URL through `proxy` (started here)."""
    await proxy.start()
    url = make_url(stage.db_url)
    query = {k: v for k, v in url.query.items() if k != "host"}  # not a socket any more
    return url.set(host="127.0.0.1", port=proxy.port, query=query).render_as_string(
        hide_password=False)


def _by_worker(calls: list[Call]) -> dict[str, list[Call]]:
    out: dict[str, list[Call]] = {}
    for call in calls:
        out.setdefault(call.path.split("/")[1], []).append(call)
    return out


async def replica_cut_from_database(stage: Stage, *, requests_lost: bool = True) -> Facts:
    """Scenario 1: one replica loses PostgreSQL for longer than its leases while its
    upstream link stays up: both directions, or (`requests_lost` False) only the answers,
    so its statements still commit and it never learns so."""
    upstream = stage.start_upstream()
    stage.write_policies(rate=80, burst=5, lease=LEASE_S, timeout=3)
    n = 1500
    keys = await stage.register([f"o{i}" for i in range(n)])
    cut_proxy = FaultProxy(*_server(stage.db_url))
    cut_url = await _through(stage, cut_proxy)
    stage.cleanups.append(cut_proxy.close)
    cut = _worker(stage, "cut", {"SWEEPER_DATABASE_URL": cut_url})
    other = _worker(stage, "other", {})
    await stage.wait_started(cut, other)
    await stage.release()

    async def both_calling() -> bool:
        seen = _by_worker(upstream.calls())
        return len(seen.get("cut", [])) >= 50 and len(seen.get("other", [])) >= 50

    await stage.wait_for("both replicas calling", both_calling, 30, 0.05)
    cut_proxy.cut(to_target=requests_lost)
    cut_at = time.time()
    await asyncio.sleep(CUT_S)
    cut_proxy.heal()
    healed_at = time.time()
    await stage.wait_all_finished(n, 120)
    calls = upstream.calls()
    by_worker = _by_worker(calls)
    other_during = [c for c in by_worker["other"] if cut_at + LEASE_S < c.wall_time < healed_at]
    during_cut = [c.wall_time for c in by_worker["cut"] if cut_at <= c.wall_time < healed_at]
    # None: the cut replica made no call in the cut
    last_into_cut = max(during_cut) - cut_at if during_cut else None
    facts = await judge(stage, calls, keys, rate=80, burst=5)
    facts.update({
        "cut_s": CUT_S, "lease_s": LEASE_S, "cut_replica_calls_in_cut": len(during_cut),
        "cut_replica_last_call_into_cut_s": None if last_into_cut is None
        else round(last_into_cut, 2), "other_calls_while_cut": len(other_during)})
    stage.facts.update(facts)
    check(last_into_cut is None or last_into_cut <= LEASE_S + SLACK_S,
          f"the cut replica called {last_into_cut} s into the cut, after its leases "
          f"({LEASE_S} s) could have expired")
    check(len(other_during) > 0, "the other replica did not take the items over")
    check(facts["statuses"] == {"succeeded": n}, f"items {facts['statuses']}")
    await stage.stop_all([cut, other])
    return facts


async def replica_answers_lost(stage: Stage) -> Facts:
    return await replica_cut_from_database(stage, requests_lost=False)


def _worker(stage: Stage, name: str, env: dict[str, str], *, metrics: bool = False) -> Proc:
    """A worker process calling the upstream under its own path prefix (`/name/...`)."""
    policies = stage.workdir / f"policies-{name}.toml"
    assert stage.policies_file is not None
    assert stage.upstream_url is not None
    policies.write_text(stage.policies_file.read_text(encoding="utf-8").replace(
        stage.upstream_url, f"{stage.upstream_url}/{name}"), encoding="utf-8")
    return stage.start_worker(workers=8, env={"SWEEPER_POLICIES_FILE": str(policies), **env},
                              metrics=metrics)


async def _late_tokens(procs: list[Proc]) -> int:
    """Leases the workers handed back because their token's moment had passed."""
    total = 0.0
    async with httpx.AsyncClient(timeout=5) as client:
        for proc in procs:
            text = (await client.get(f"http://127.0.0.1:{proc.port}/metrics")).text
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("sweeper_leases_returned_total{")
                         and 'reason="late_token"' in line)
    return int(total)


async def database_blackholed(stage: Stage) -> Facts:
    """Scenario 3: PostgreSQL blackholed for every process for BLACKHOLE_S, then healed."""
    upstream = stage.start_upstream()
    stage.write_policies(rate=50, burst=5, lease=LEASE_S, timeout=3)
    n = 1000
    keys = await stage.register([f"o{i}" for i in range(n)])
    proxy = FaultProxy(*_server(stage.db_url))
    direct = stage.db_url
    stage.db_url = await _through(stage, proxy)  # every process's URL
    stage.cleanups.append(proxy.close)
    api = await stage.start_api({"SWEEPER_DB_POOL_TIMEOUT_SECONDS": "2"})
    workers = [_worker(stage, f"w{i}", {}) for i in (1, 2)]
    await stage.wait_started(*workers)
    stage.db_url = direct  # the drill's own reads go around the proxy
    await stage.release()

    async def calling() -> bool:
        return len(upstream.calls()) >= 100

    await stage.wait_for("calls before the blackhole", calling, 30, 0.05)
    facts: Facts = {"blackhole_s": BLACKHOLE_S}
    async with stage.api_client(api, timeout=5) as client:
        proxy.cut()
        cut_at = time.monotonic()
        not_ready = await stage.wait_for("/readyz false", _readiness(client, False), 20)
        facts["readyz_false_after_s"] = round(not_ready, 2)
        await asyncio.sleep(max(0.0, BLACKHOLE_S - (time.monotonic() - cut_at)))
        calls_at_heal = len(upstream.calls())
        # healed as a firewall that forgot the connections: each one across the cut is
        # reset, and only new ones work
        proxy.heal(reset=True)
        ready = await stage.wait_for("/readyz true", _readiness(client, True), 60)
        facts["readyz_true_after_heal_s"] = round(ready, 2)

        async def calling_again() -> bool:
            return len(upstream.calls()) > calls_at_heal

        facts["calling_after_heal_s"] = round(
            await stage.wait_for("workers calling again", calling_again, 60, 0.05), 2)
    await stage.wait_all_finished(n, 120)
    facts.update(await judge(stage, upstream.calls(), keys, rate=50, burst=5))
    facts["alive"] = all(p.alive() for p in [api, *workers])
    stage.facts.update(facts)
    check(facts["alive"], "a process died in the blackhole")
    check(facts["statuses"] == {"succeeded": n}, f"items {facts['statuses']}")
    await stage.stop_all([*workers, api])
    return facts


async def upstream_blackholed(stage: Stage) -> Facts:
    """Scenario 2: a worker's upstream connections blackholed mid-call (no RST) for longer
    than the call deadline, then healed with those connections forgotten."""
    rate, burst, timeout = 40.0, 5, 3.0
    upstream = stage.start_upstream()
    proxy = FaultProxy("127.0.0.1", int(upstream.base_url.rsplit(":", 1)[1]))
    await proxy.start()
    stage.cleanups.append(proxy.close)
    stage.upstream_url = f"http://127.0.0.1:{proxy.port}"  # the worker calls through it
    stage.write_policies(rate=rate, burst=burst, lease=LEASE_S, timeout=timeout,
                         backoff_base=0.5, backoff_max=2.0, max_attempts=20)
    n = 800
    keys = await stage.register([f"o{i}" for i in range(n)])
    worker = stage.start_worker(workers=8)
    await stage.wait_started(worker)
    await stage.release()

    async def calling() -> bool:
        return len(upstream.calls()) >= 100

    await stage.wait_for("calls before the blackhole", calling, 30, 0.05)
    proxy.cut()
    await asyncio.sleep(CUT_S)
    proxy.heal(reset=True)
    healed_at = time.time()
    await stage.wait_all_finished(n, 120)
    timed_out = await stage.fetch(
        "SELECT latency_ms FROM attempts WHERE outcome = 'unknown'")
    after_heal = [c.wall_time for c in upstream.calls() if c.wall_time >= healed_at]
    worst = worst_window(after_heal)
    facts = await judge(stage, upstream.calls(), keys, rate=rate, burst=burst)
    facts.update({"cut_s": CUT_S, "calls_unknown": len(timed_out),
                  "slowest_unknown_s": round(max((r["latency_ms"] for r in timed_out),
                                                 default=0) / 1000, 2),
                  "worst_second_after_heal": worst})
    stage.facts.update(facts)
    check(len(timed_out) > 0, f"no call ended unknown in a {CUT_S:.0f} s blackhole")
    check(facts["slowest_unknown_s"] <= timeout + SLACK_S,
          f"a call outlived its {timeout} s deadline: {facts['slowest_unknown_s']} s")
    check(facts["statuses"] == {"succeeded": n}, f"items {facts['statuses']}")
    await stage.stop_all([worker])
    return facts


LATENCY_S = (0.04, 0.08)  # added each way: 80-160 ms more per round trip
LATENCY_FOR_S = 30.0


async def database_latency(stage: Stage) -> Facts:
    """PostgreSQL 80-160 ms further away (latency with jitter, each way) for every process
    for LATENCY_FOR_S, then near again."""
    rate, burst = 50.0, 5
    upstream = stage.start_upstream()
    stage.write_policies(rate=rate, burst=burst, lease=10, timeout=3)
    n = 1500
    keys = await stage.register([f"o{i}" for i in range(n)])
    proxy = FaultProxy(*_server(stage.db_url))
    direct = stage.db_url
    stage.db_url = await _through(stage, proxy)
    stage.cleanups.append(proxy.close)
    workers = [_worker(stage, f"w{i}", {}, metrics=True) for i in (1, 2)]
    await stage.wait_started(*workers)
    stage.db_url = direct
    await stage.release()

    async def calling() -> bool:
        return len(upstream.calls()) >= 100

    await stage.wait_for("calls before the latency", calling, 30, 0.05)
    late_before = await _late_tokens(workers)
    proxy.slow(LATENCY_S)
    slowed_at = time.time()
    await asyncio.sleep(LATENCY_FOR_S)
    proxy.slow(None)
    late_while_slow = await _late_tokens(workers) - late_before
    await stage.wait_all_finished(n, 120)
    calls = upstream.calls()
    facts = await judge(stage, calls, keys, rate=rate, burst=burst)
    while_slow = [c for c in calls if slowed_at <= c.wall_time < slowed_at + LATENCY_FOR_S]
    facts.update({"latency_each_way_ms": [int(x * 1000) for x in LATENCY_S],
                  "calls_while_slow_per_s": round(len(while_slow) / LATENCY_FOR_S, 1),
                  "late_tokens_returned_while_slow": late_while_slow})
    stage.facts.update(facts)
    check(facts["statuses"] == {"succeeded": n} and facts["called_twice"] == 0,
          f"items {facts['statuses']}, {facts['called_twice']} called twice (a lease of 10 s "
          "outlives any round trip here)")
    await stage.stop_all(workers)
    return facts


SLOW_S = 30.0


async def upstream_slowed(stage: Stage) -> Facts:
    """Scenario 5: the upstream answers five times slower for SLOW_S, then recovers."""
    rate, burst, concurrency = 40.0, 5, 8
    upstream = stage.start_upstream(latency=(0.04, 0.08))
    stage.write_policies(rate=rate, burst=burst, lease=30, timeout=5)
    n = 1500
    keys = await stage.register([f"o{i}" for i in range(n)])
    worker = stage.start_worker(workers=concurrency)
    await stage.wait_started(worker)
    await stage.release()

    async def calling() -> bool:
        return len(upstream.calls()) >= 200

    await stage.wait_for("calls before the slowdown", calling, 30, 0.05)
    rss_before = await worker.peak_rss_kib()
    upstream.set_latency((0.2, 0.4))
    slowed_at = time.time()
    await asyncio.sleep(SLOW_S)
    upstream.set_latency((0.04, 0.08))
    rss_after = await worker.peak_rss_kib()
    await stage.wait_all_finished(n, 180)
    calls = upstream.calls()
    while_slow = [c.wall_time for c in calls if slowed_at <= c.wall_time < slowed_at + SLOW_S]
    facts = await judge(stage, calls, keys, rate=rate, burst=burst)
    facts.update({
        "slow_s": SLOW_S, "max_in_flight": upstream.max_in_flight(), "concurrency": concurrency,
        "calls_while_slow_per_s": round(len(while_slow) / SLOW_S, 1),
        "peak_rss_growth_mib": round((rss_after - rss_before) / 1024, 1)})
    stage.facts.update(facts)
    check(facts["max_in_flight"] <= concurrency,
          f"{facts['max_in_flight']} calls in flight at once, beyond the pool's {concurrency}")
    check(facts["peak_rss_growth_mib"] < 20,
          f"the worker's peak memory grew {facts['peak_rss_growth_mib']} MiB while slowed")
    check(facts["statuses"] == {"succeeded": n} and facts["called_twice"] == 0,
          f"items {facts['statuses']}, {facts['called_twice']} called twice (no lease "
          "should expire here)")
    await stage.stop_all([worker])
    return facts


def _readiness(client: httpx.AsyncClient, ready: bool) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        try:
            answer = await client.get("/readyz")
        except httpx.HTTPError:
            return not ready  # no answer at all is not ready
        return (answer.status_code == 200) is ready

    return probe


DRILLS = [
    Drill(23, "replica-cut-from-database",
          f"1,500 items at 80/s, two worker processes of 8 calls each, leases of {LEASE_S} s; "
          "one worker's PostgreSQL connections through the drill's fault proxy",
          f"that worker's link to PostgreSQL blackholed both ways for {CUT_S:.0f} s (its "
          "upstream link stays up), then healed",
          f"the cut worker makes no call later than its leases' length ({LEASE_S} s) into "
          "the cut; the other worker takes the items over; every item succeeds; no object "
          "is called three times", replica_cut_from_database),
    Drill(26, "replica-answers-lost",
          "as replica-cut-from-database",
          f"only PostgreSQL's answers to that worker blackholed for {CUT_S:.0f} s: its "
          "statements still arrive and commit (a claim it never hears of), then healed",
          "as replica-cut-from-database: leases it took without knowing expire and the "
          "other worker calls those items; nothing is called three times",
          replica_answers_lost),
    Drill(24, "database-blackholed",
          "1,000 items at 50/s, two worker processes and an API process, all reaching "
          "PostgreSQL through the drill's fault proxy",
          f"PostgreSQL blackholed for every process for {BLACKHOLE_S:.0f} s (no RST), then "
          "healed with every connection across the cut reset",
          "no process dies or wedges: /readyz goes false during the blackhole and true after "
          "it, workers call again, every item succeeds, none is called three times",
          database_blackholed),
    Drill(25, "upstream-blackholed",
          "800 items at 40/s (burst 5), a worker process of 8 calls whose upstream "
          "connections go through the drill's fault proxy; call deadline 3 s",
          f"the upstream link blackholed mid-call for {CUT_S:.0f} s (no RST), then healed "
          "with the connections across the cut forgotten",
          "calls end by their deadline as unknown (retried under the same key); after the "
          "heal no second at the upstream exceeds rate + burst; every item succeeds",
          upstream_blackholed),
    Drill(27, "upstream-slowed",
          "1,500 items at 40/s (burst 5), a worker process of 8 calls; the upstream answers in "
          "40-80 ms",
          f"the upstream answers five times slower (200-400 ms) for {SLOW_S:.0f} s, then "
          "recovers",
          "calls in flight never exceed the pool's concurrency, no second exceeds rate + "
          "burst, the worker's memory stays flat, every item succeeds once",
          upstream_slowed),
    Drill(28, "database-latency",
          "1,500 items at 50/s, two worker processes reaching PostgreSQL through the drill's "
          "fault proxy",
          f"PostgreSQL {int(LATENCY_S[0] * 1000)}-{int(LATENCY_S[1] * 1000)} ms further away "
          f"each way (latency with jitter) for {LATENCY_FOR_S:.0f} s",
          "no second over rate + burst, no lease lost (nothing called twice), every item "
          "succeeds; the drill reports the calls per second the round trips allow",
          database_latency),
]
