"""Drills of the shared budget and the operator's controls: replicas sharing one budget,
budgets changed at run time, pauses, SIGTERM, and duplicate cron triggers."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import httpx

from drills.base import Drill, Facts, check
from drills.stage import Stage, worst_window
from drills.upstream import FakeUpstream
from service.budget.rules import LOOKAHEAD_S, late_tolerance


def pause_slack(rate: float) -> float:
    """How long after a pause committed a call of a `rate` budget may still start: its token
    and lease taken just before (the token look-ahead), started as late as a token may be,
    and the workers' calibration of the database clock."""
    return LOOKAHEAD_S + late_tolerance(rate) + 0.05


def starts_within(starts: list[float], after: float, until: float) -> list[float]:
    """The call starts in (after, until], as seconds after `after`."""
    return [round(t - after, 3) for t in starts if after < t <= until]


async def replicas_share_budget(stage: Stage) -> Facts:
    rate, burst, n, replicas = 20, 1, 160, 5
    # The upstream enforces the same rate with a little more burst than Sweeper's bucket
    # holds, as a real API whose published limit a client configures would (bench/budget.py
    # does the same); Sweeper must never need it, so the window is checked on its own budget.
    upstream = await stage.start_upstream_process(rate=rate, burst=burst + 2)
    stage.write_policies(rate=rate, burst=burst, lease=10)
    await stage.register([f"o{i}" for i in range(n)])
    workers = [stage.start_worker(workers=4, metrics=True) for _ in range(replicas)]
    # release only once every replica is warmed up and claiming: five interpreters
    # importing on two shared cores would otherwise make the first calls late
    await stage.wait_ready(*workers)
    await stage.release()
    await stage.wait_all_finished(n, n / rate * 2 + 30)
    calls = sorted(await upstream.calls(), key=lambda c: c.received_at)
    t0 = calls[0].received_at
    throttled = [round(c.received_at - t0, 3) for c in calls if c.outcome == "throttled"]
    # the budget's windows on the calls' recorded starts, not on the fake's arrival times
    # (a fake process starved of CPU receives calls late and in bunches)
    ok = await stage.call_starts("succeeded")
    achieved = (len(ok) - 1) / (ok[-1] - ok[0])
    # the replicas that made a successful call, from their own metrics (a success has no
    # attempt row to name its worker: its item records it)
    owners = 0
    async with httpx.AsyncClient(timeout=5) as client:
        for w in workers:
            text = (await client.get(f"{w.base_url}/metrics")).text
            owners += any(line.startswith("sweeper_completions_total{")
                          and 'outcome="succeeded"' in line and not line.endswith(" 0.0")
                          for line in text.splitlines())
    facts: Facts = {"throttled_429_at_s": throttled, "worst_1s_window": worst_window(ok),
                    "rate_plus_burst": rate + burst, "achieved_per_s": round(achieved, 2),
                    "budget_used": round(achieved / rate, 3), "replicas_calling": owners}
    stage.facts.update(facts)
    check(await stage.statuses() == {"succeeded": n}, f"items {await stage.statuses()}")
    check(len(ok) == n, f"{len(ok)} successful calls for {n} items")
    check(throttled == [], f"upstream 429s at {throttled} s")
    check(worst_window(ok) <= rate + burst,
          f"worst 1-second window {worst_window(ok)} > rate + burst {rate + burst}")
    check(achieved >= 0.9 * rate, f"{achieved:.1f}/s is under 90% of the {rate}/s budget")
    check(owners == replicas, f"only {owners} of {replicas} replicas called the upstream")
    await stage.stop_all([*workers, upstream.proc], exited_ok=True)
    return facts


async def _lower_budget(client: httpx.AsyncClient, stage: Stage, scope: str) -> float:
    """A lower budget, obeyed from every replica's next take: when the change committed (on
    the database's clock), once its calls have had 2.5 s (counted by _windows)."""
    answer = await client.put(f"/v1/scopes/{scope}", json={
        "rate_per_second": 10, "burst": 1, "reason": "drill: upstream asked"})
    check(answer.status_code == 200, f"budget change answered {answer.status_code}")
    changed = await stage.database_now()  # the change has committed
    await asyncio.sleep(2.5)  # calls at the new budget, counted once all are recorded
    return changed


async def _pause_scope(client: httpx.AsyncClient, stage: Stage, scope: str) -> float:
    """The scope paused: no call starts once the pause has committed (checked by _windows).
    When it committed, on the database's clock."""
    answer = await client.post(f"/v1/scopes/{scope}/pause", json={"reason": "drill"})
    check(answer.status_code == 200, f"scope pause answered {answer.status_code}")
    paused = await stage.database_now()
    await asyncio.sleep(1.5)  # a time to watch for calls, which must not come
    return paused


async def _pause_workers(client: httpx.AsyncClient, stage: Stage, upstream: FakeUpstream,
                         n: int) -> tuple[float, int]:
    """Every worker paused: nothing starts anywhere until the resume (checked by _windows).
    When the pause committed (on the database's clock) and the calls made before it."""
    answer = await client.post("/v1/workers/pause", json={"reason": "drill"})
    check(answer.status_code == 200 and answer.json()["workers_paused"] is True,
          f"workers pause answered {answer.status_code}")
    paused = await stage.database_now()
    done_at_pause = len(upstream.calls())
    await asyncio.sleep(1.5)  # a time to watch for calls, which must not come
    check(done_at_pause < n, "the run finished before the pause; nothing was tested")
    return paused, done_at_pause


async def _windows(stage: Stage, changed: float, scope_paused: float, scope_resumed: float,
                   workers_paused: float, workers_resumed: float) -> int:
    """The budget's window after the change and the pauses' late calls, on the calls'
    recorded starts (every call is recorded by now): the worst 1-second window."""
    starts = await stage.call_starts()
    slow = [t for t in starts if changed + 0.5 < t <= scope_paused]
    check(worst_window(slow) <= 10 + 1,
          f"{worst_window(slow)} calls in one second after the budget went to 10/s")
    late = starts_within(starts, scope_paused + pause_slack(10), scope_resumed)
    check(late == [], f"calls {late} s after the scope pause committed and its slack")
    late = starts_within(starts, workers_paused + pause_slack(40), workers_resumed)
    check(late == [], f"calls {late} s after the workers pause committed and its slack")
    return worst_window(slow)


async def operator_controls(stage: Stage) -> Facts:
    n = 120
    upstream = stage.start_upstream()
    stage.write_policies(rate=30, burst=1, lease=30)
    keys = await stage.register([f"o{i}" for i in range(n)])
    scope = stage.scope()
    api = await stage.start_api()
    workers = [stage.start_worker(workers=4) for _ in range(2)]
    await stage.wait_started(*workers)
    facts: Facts = {}
    async with stage.api_client(api) as client:
        run = (await client.post("/v1/runs", json={"policy": "drill"})).json()

        async def calls_reach(count: int) -> bool:
            return len(upstream.calls()) >= count

        await stage.wait_for("first calls", lambda: calls_reach(20), 30, 0.02)
        changed = await _lower_budget(client, stage, scope)
        scope_paused = await _pause_scope(client, stage, scope)
        # resumed with a higher budget; one replica is stopped (SIGTERM) mid-flight
        await client.put(f"/v1/scopes/{scope}", json={"rate_per_second": 40, "burst": 1})
        scope_resumed = await stage.database_now()
        await client.post(f"/v1/scopes/{scope}/resume", json={"reason": "drill"})
        before = len(upstream.calls())
        await stage.wait_for("calls after resume", lambda: calls_reach(before + 10), 20, 0.02)
        workers[0].signal(signal.SIGTERM)
        code = await workers[0].wait(30)
        check(code == 0, f"the SIGTERMed worker exited with {code}")
        workers_paused, done_at_pause = await _pause_workers(client, stage, upstream, n)
        workers_resumed = await stage.database_now()
        await client.post("/v1/workers/resume", json={"reason": "drill"})
        await stage.wait_all_finished(n, 60)
        status = (await client.get(f"/v1/runs/{run['id']}")).json()
    facts["worst_window_after_budget_change"] = await _windows(
        stage, changed, scope_paused, scope_resumed, workers_paused, workers_resumed)
    check(status["items"] == {"succeeded": n}, f"run items {status['items']}")
    per_key = Counter(c.idempotency_key for c in upstream.calls())
    check(set(per_key) == set(keys) and set(per_key.values()) == {1},
          f"calls per item {sorted(Counter(per_key.values()).items())}")
    await stage.stop_all([*workers, api], exited_ok=True)
    facts.update({"calls": len(upstream.calls()), "lost": 0, "duplicates": 0,
                  "remaining_at_workers_pause": n - done_at_pause})
    return facts


async def concurrent_triggers(stage: Stage) -> Facts:
    n, triggers = 50, 10
    stage.start_upstream()
    stage.write_policies()
    await stage.register([f"o{i}" for i in range(n)])
    api = await stage.start_api()
    key = f"{stage.label}-slot"
    async with stage.api_client(api) as client:
        async def trigger() -> httpx.Response:
            return await client.post("/v1/runs", json={"policy": "drill"},
                                     headers={"Idempotency-Key": key})

        answers = await asyncio.gather(*(trigger() for _ in range(triggers)))
        again = await trigger()

        async def published() -> bool:
            run = (await client.get(f"/v1/runs/{again.json()['id']}")).json()
            return bool(run["state"] == "published")

        await stage.wait_for("run published", published, 30)
    codes = Counter(a.status_code for a in [*answers, again])
    ids = {a.json()["id"] for a in [*answers, again] if a.status_code in (200, 202)}
    check(codes == Counter({202: 1, 200: triggers}), f"answers {dict(codes)}")
    check(len(ids) == 1, f"{len(ids)} different runs")
    runs = await stage.fetchval("SELECT count(*) FROM runs")
    released = await stage.fetchval("SELECT count(*) FROM items WHERE released_at IS NOT NULL")
    # publication lanes may split the 50 into more than one batch (each picks with SKIP
    # LOCKED); released once means the batches hold exactly the items, each in one
    batches = await stage.fetchval("SELECT count(*) FROM batches")
    in_batches = await stage.fetchval("SELECT coalesce(sum(item_count), 0) FROM batches")
    check(runs == 1 and released == n and in_batches == n,
          f"{runs} runs, {released} released, {in_batches} items in {batches} batches")
    await stage.stop_all([api], exited_ok=True)
    return {"triggers": triggers + 1, "runs": runs, "released": released}


DRILLS = [
    Drill(12, "replicas-share-budget",
          "160 items in one scope at 20/s burst 1; 5 worker processes of 4 slots; the "
          "upstream enforces 20/s itself",
          "five replicas draw from one budget row at once",
          "zero upstream 429s, worst 1-second window <= rate + burst, >= 90% of the budget "
          "used, every replica took part", replicas_share_budget),
    Drill(13, "operator-controls",
          "120 items at 30/s, 2 worker processes and an API process",
          "budget cut to 10/s mid-run; scope paused, resumed at 40/s; one worker SIGTERMed "
          "mid-flight; all workers paused, then resumed",
          "the new budget holds within a second; no call starts after a pause commits; the "
          "run completes after resume with one call per item, nothing lost",
          operator_controls),
    Drill(15, "concurrent-cron-triggers",
          "50 registered items and an API process",
          "10 concurrent POST /v1/runs with one Idempotency-Key, then one more",
          "one run (one 202, the rest 200 with its id), its items released once",
          concurrent_triggers),
]
