"""Drills where the network fails rather than a process: links to PostgreSQL or to the
upstream blackholed (nothing arrives, nothing is refused) through the drill's fault proxy
(drills/faultproxy.py), for one replica or for all, longer than the leases, then healed; and
the same cuts made in the kernel, with the replica on a host of its own (drills/netns.py).

Judged from outside (drills/history.py): the upstream's own log of calls (which replica made
each: every worker process calls the upstream under a path prefix of its own) against the
ledger's final state and the leases' length."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx

from drills.base import Drill, Facts, check
from drills.faultproxy import FaultProxy
from drills.history import judge
from drills.links import by_worker, server, through, upstream_at, url_at, worker
from drills.netns import LinkName, Namespace
from drills.stage import Proc, Stage, worst_window
from drills.upstream import FakeUpstream

LEASE_S = 6
CUT_S = 2.5 * LEASE_S  # longer than any lease the cut replica holds
BLACKHOLE_S = 30.0
SLACK_S = 1.0  # a call started within a second of its lease's end is the call's own write


class _CutLink:
    """A replica's link to PostgreSQL or its upstream (`name`, reaching `target`): through
    the drill's fault proxy, or (`host`) from its own network namespace, cut in the kernel."""

    def __init__(self, stage: Stage, host: Namespace | None, name: LinkName,
                 target: tuple[str, int]) -> None:
        self.stage, self.host, self.name = stage, host, name
        self.proxy = FaultProxy(*target)

    async def worker(self, upstream: FakeUpstream, env: dict[str, str]) -> Proc:
        """The replica whose link to PostgreSQL this is (with `env` besides)."""
        if self.host is None:
            url = await through(self.stage, self.proxy)
            self.stage.cleanups.append(self.proxy.close)
            return worker(self.stage, "cut", {**env, "SWEEPER_DATABASE_URL": url})
        self.stage.cleanups.append(self.host.close)
        await self.host.open({"database": server(self.stage.db_url),
                              "upstream": upstream_at(upstream)})
        url = url_at(self.stage.db_url, *self.host.address("database"))
        relay, port = self.host.address("upstream")
        return worker(self.stage, "cut", {**env, "SWEEPER_DATABASE_URL": url}, host=self.host,
                      upstream_url=f"http://{relay}:{port}")

    async def cut(self, *, requests: bool = True) -> None:
        if self.host is None:
            self.proxy.cut(to_target=requests)
        else:
            await self.host.cut(self.name, requests=requests)

    async def heal(self, *, reset: bool = False) -> None:
        """`reset`: the proxy forgets the connections across the cut (the kernel does not:
        in a namespace they carry on)."""
        if self.host is None:
            self.proxy.heal(reset=reset)
        else:
            await self.host.heal(self.name)


async def replica_cut_from_database(stage: Stage, *, requests_lost: bool = True,
                                    host: Namespace | None = None,
                                    env: dict[str, str] | None = None) -> Facts:
    """Scenario 1: one replica loses PostgreSQL for longer than its leases while its
    upstream link stays up: both directions, or (`requests_lost` False) only the answers,
    so its statements still commit and it never learns so. With `host`, that replica runs
    in its own network namespace and the link is cut in the kernel; `env` for both
    replicas (broker mode's, drills/brokers.py)."""
    upstream = stage.start_upstream()
    stage.write_policies(rate=80, burst=5, lease=LEASE_S, timeout=3)
    n = 1500
    keys = await stage.register([f"o{i}" for i in range(n)])
    link = _CutLink(stage, host, "database", server(stage.db_url))
    cut = await link.worker(upstream, env or {})
    other = worker(stage, "other", env or {})
    await stage.wait_started(cut, other)
    await stage.release()

    async def both_calling() -> bool:
        seen = by_worker(upstream.calls())
        return len(seen.get("cut", [])) >= 50 and len(seen.get("other", [])) >= 50

    await stage.wait_for("both replicas calling", both_calling, 30, 0.05)
    await link.cut(requests=requests_lost)
    cut_at = time.time()
    await asyncio.sleep(CUT_S)
    await link.heal()
    healed_at = time.time()
    await stage.wait_all_finished(n, 120)
    calls = upstream.calls()
    per_worker = by_worker(calls)
    other_during = [c for c in per_worker["other"] if cut_at + LEASE_S < c.wall_time < healed_at]
    during_cut = [c.wall_time for c in per_worker["cut"] if cut_at <= c.wall_time < healed_at]
    # None: the cut replica made no call in the cut
    last_into_cut = max(during_cut) - cut_at if during_cut else None
    facts = await judge(stage, calls, keys, rate=80, burst=5, lease_s=LEASE_S)
    facts.update({
        "link": "proxy" if host is None else "namespace", "cut_s": CUT_S, "lease_s": LEASE_S,
 "cut_replica_calls_in_cut": len(during_cut),
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


async def host_cut_from_database(stage: Stage) -> Facts:
    return await replica_cut_from_database(stage, host=Namespace(1))


async def host_answers_lost(stage: Stage) -> Facts:
    return await replica_cut_from_database(stage, requests_lost=False, host=Namespace(1))


async def database_blackholed(stage: Stage) -> Facts:
    """Scenario 3: PostgreSQL blackholed for every process for BLACKHOLE_S, then healed."""
    upstream = stage.start_upstream()
    stage.write_policies(rate=50, burst=5, lease=LEASE_S, timeout=3)
    n = 1000
    keys = await stage.register([f"o{i}" for i in range(n)])
    proxy = FaultProxy(*server(stage.db_url))
    direct = stage.db_url
    stage.db_url = await through(stage, proxy)  # every process's URL
    stage.cleanups.append(proxy.close)
    api = await stage.start_api({"SWEEPER_DB_POOL_TIMEOUT_SECONDS": "2"})
    workers = [worker(stage, f"w{i}", {}) for i in (1, 2)]
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
    facts.update(await judge(stage, upstream.calls(), keys, rate=50, burst=5,
                               lease_s=LEASE_S))
    facts["alive"] = all(p.alive() for p in [api, *workers])
    stage.facts.update(facts)
    check(facts["alive"], "a process died in the blackhole")
    check(facts["statuses"] == {"succeeded": n}, f"items {facts['statuses']}")
    await stage.stop_all([*workers, api])
    return facts


async def upstream_blackholed(stage: Stage, host: Namespace | None = None) -> Facts:
    """Scenario 2: a worker's upstream connections blackholed mid-call (no RST) for longer
    than the call deadline, then healed: through the fault proxy, with those connections
    forgotten; or (`host`) with the worker in its own network namespace and its packets
    dropped in the kernel, so that the bytes it sent into the cut arrive when it heals."""
    rate, burst, timeout = 40.0, 5, 3.0
    upstream = stage.start_upstream()
    link = _CutLink(stage, host, "upstream", upstream_at(upstream))
    env: dict[str, str] = {}
    if host is None:
        await link.proxy.start()
        stage.cleanups.append(link.proxy.close)
        stage.upstream_url = f"http://127.0.0.1:{link.proxy.port}"  # the worker calls through it
    else:
        stage.cleanups.append(host.close)
        await host.open({"database": server(stage.db_url), "upstream": upstream_at(upstream)})
        relay, port = host.address("upstream")
        stage.upstream_url = f"http://{relay}:{port}"
        env["SWEEPER_DATABASE_URL"] = url_at(stage.db_url, *host.address("database"))
    stage.write_policies(rate=rate, burst=burst, lease=LEASE_S, timeout=timeout,
                         backoff_base=0.5, backoff_max=2.0, max_attempts=20)
    n = 800
    keys = await stage.register([f"o{i}" for i in range(n)])
    worker = stage.start_worker(workers=8, env=env, host=host)
    await stage.wait_started(worker)
    await stage.release()

    async def calling() -> bool:
        return len(upstream.calls()) >= 100

    await stage.wait_for("calls before the blackhole", calling, 30, 0.05)
    await link.cut()
    await asyncio.sleep(CUT_S)  # the fault's length, not a wait for an event
    await link.heal(reset=True)
    healed_at = time.time()
    await stage.wait_all_finished(n, 120)
    timed_out = await stage.fetch(
        "SELECT latency_ms FROM attempts WHERE outcome = 'unknown'")
    after_heal = [c.wall_time for c in upstream.calls() if c.wall_time >= healed_at]
    worst = worst_window(after_heal)
    facts = await judge(stage, upstream.calls(), keys, rate=rate, burst=burst,
                        lease_s=LEASE_S)
    facts.update({"link": "proxy" if host is None else "namespace", "cut_s": CUT_S,
                  "calls_unknown": len(timed_out),
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


async def host_upstream_blackholed(stage: Stage) -> Facts:
    return await upstream_blackholed(stage, Namespace(1))


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
    Drill(29, "host-cut-from-database",
          "as replica-cut-from-database, but the cut worker runs in a network namespace of "
          "its own, joined to this machine by a veth pair (root, nftables)",
          f"its packets to and from PostgreSQL dropped in the kernel for {CUT_S:.0f} s (TCP "
          "retransmits into the void), then let through again",
          "as replica-cut-from-database", host_cut_from_database),
    Drill(30, "host-answers-lost",
          "as host-cut-from-database",
          f"only PostgreSQL's packets to that worker dropped for {CUT_S:.0f} s, then let through",
          "as replica-answers-lost", host_answers_lost),
    Drill(31, "host-upstream-blackholed",
          "as upstream-blackholed, but the worker runs in a network namespace of its own",
          f"its packets to and from the upstream dropped in the kernel for {CUT_S:.0f} s, then "
          "let through: what it sent into the cut arrives late",
          "as upstream-blackholed: calls end by their deadline as unknown, no second at the "
          "upstream above rate + burst when the link heals", host_upstream_blackholed),
]
