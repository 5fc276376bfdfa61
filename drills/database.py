"""Drills where PostgreSQL goes away or fights back: a restart mid-run, connections cut
again and again, and a saturated pool behind a session idle in a transaction."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any

import asyncpg
import httpx

from drills.base import Drill, Facts, check
from drills.pgserver import PrivateServer
from drills.scratch import create_database
from drills.stage import Stage, free_port

OUTAGE_S = 4.0
RECOVERY_LIMIT_S = 10.0


class Prober:
    """Calls the API every `interval` seconds and counts the answers by status."""

    def __init__(self, client: httpx.AsyncClient, run_id: int, interval: float = 0.1) -> None:
        self.client = client
        self.run_id = run_id
        self.interval = interval
        self.seen: Counter[int] = Counter()
        self.without_retry_after = 0
        self.last_ok = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _request(self, i: int) -> httpx.Response:
        # a read, a write (the same trigger again: one run, then 200s) and readiness
        if i % 3 == 0:
            return await self.client.get(f"/v1/runs/{self.run_id}")
        if i % 3 == 1:
            return await self.client.post("/v1/runs", json={"policy": "drill"},
                                          headers={"Idempotency-Key": "drill-probe"})
        return await self.client.get("/readyz")

    async def _loop(self) -> None:
        i = 0
        while True:
            i += 1
            try:
                answer = await self._request(i)
            except httpx.HTTPError:
                self.seen[0] += 1  # no HTTP answer at all
            else:
                self.seen[answer.status_code] += 1
                if answer.status_code == 503 and "retry-after" not in answer.headers:
                    self.without_retry_after += 1
                if answer.status_code < 300:
                    self.last_ok = time.monotonic()
            await asyncio.sleep(self.interval)

    def __enter__(self) -> Prober:
        self._task = asyncio.create_task(self._loop())
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    async def ok_again(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return (await self.client.get(f"/v1/runs/{self.run_id}")).status_code == 200
        return False


async def database_restart(stage: Stage) -> Facts:
    server = PrivateServer(stage.workdir / "pg", free_port())
    stage.cleanups.append(server.destroy)
    await server.start()
    stage.db_url = await create_database(server.url, "sweeper")
    n = 200
    upstream = stage.start_upstream()
    stage.write_policies(rate=40, burst=1, lease=20, timeout=3)
    keys = await stage.register([f"o{i}" for i in range(n)])
    api = await stage.start_api({"SWEEPER_DB_POOL_TIMEOUT_SECONDS": "2"})
    workers = [stage.start_worker(workers=4) for _ in range(2)]
    await stage.wait_started(*workers)
    run_id = await stage.release()
    facts: Facts = {}
    async with stage.api_client(api, timeout=10) as client:
        async def some_done() -> bool:
            return len(upstream.calls()) >= 40

        await stage.wait_for("calls before the outage", some_done, 30, 0.02)
        with Prober(client, run_id) as prober:
            await server.stop()
            down = time.monotonic()
            before_outage = Counter(prober.seen)
            await asyncio.sleep(OUTAGE_S)
            during = prober.seen - before_outage
            calls_at_restart = len(upstream.calls())
            await server.start()
            up = time.monotonic()
            facts["outage_s"] = round(up - down, 1)

            async def calling_again() -> bool:
                return len(upstream.calls()) > calls_at_restart

            worker_recovery = await stage.wait_for("workers calling again", calling_again,
                                                   30, 0.02)
            api_recovery = await stage.wait_for("API answering again", prober.ok_again, 30)
        facts.update({"worker_recovery_s": round(worker_recovery, 2),
                      "api_recovery_s": round(api_recovery, 2),
                      "answers_during_outage": dict(sorted(during.items())),
                      "answers_overall": dict(sorted(prober.seen.items()))})
        stage.facts.update(facts)
        await stage.wait_all_finished(n, 60)
    check(during[503] > 0, f"no 503 seen during the outage: {dict(during)}")
    check(set(prober.seen) <= {200, 202, 503},
          f"answers other than 2xx and 503: {dict(prober.seen)}")
    check(prober.without_retry_after == 0, "a 503 without Retry-After")
    check(worker_recovery <= RECOVERY_LIMIT_S,
          f"workers took {worker_recovery:.1f} s to call again after the restart")
    check(api_recovery <= RECOVERY_LIMIT_S, f"the API took {api_recovery:.1f} s to recover")
    check(await stage.statuses() == {"succeeded": n}, f"items {await stage.statuses()}")
    per_key = Counter(c.idempotency_key for c in upstream.calls())
    duplicates = sum(v - 1 for v in per_key.values())
    check(set(per_key) == set(keys), "an item was never called")
    check(duplicates == 0, f"{duplicates} duplicate calls (leases of 20 s outlived the outage)")
    await stage.stop_all([*workers, api], exited_ok=True)
    facts.update({"lost": 0, "duplicates": duplicates})
    return facts


async def terminate_backends(stage: Stage) -> Facts:
    n = 200
    upstream = stage.start_upstream()
    stage.write_policies(rate=50, burst=1, lease=10, timeout=3)
    keys = await stage.register([f"o{i}" for i in range(n)])
    api = await stage.start_api()
    workers = [stage.start_worker(workers=4) for _ in range(2)]
    await stage.wait_started(*workers)
    run_id = await stage.release()
    terminated = 0
    async with stage.api_client(api) as client:
        with Prober(client, run_id) as prober:
            killer = await asyncpg.connect(stage.db_url)
            try:
                started = time.monotonic()
                while time.monotonic() - started < 4.0:
                    terminated += int(await killer.fetchval(
                        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM "
                        "pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid()) t"))
                    await asyncio.sleep(0.3)
            finally:
                await killer.close()
            stopped = time.monotonic()
            await stage.wait_all_finished(n, 60)
            drained = time.monotonic() - stopped
            await stage.wait_for("API answering", prober.ok_again, 15)
        ready = await client.get("/readyz")
    facts: Facts = {"backends_terminated": terminated, "drained_after_s": round(drained, 1),
                    "answers": dict(sorted(prober.seen.items()))}
    stage.facts.update(facts)
    check(terminated >= 10, f"only {terminated} backends terminated; the drill did not bite")
    check(set(prober.seen) <= {200, 202, 503}, f"answers {dict(prober.seen)}")
    check(ready.status_code == 200, f"/readyz {ready.status_code} after the storm")
    check(await stage.statuses() == {"succeeded": n}, f"items {await stage.statuses()}")
    leased = await stage.fetchval("SELECT count(*) FROM items WHERE lease_token IS NOT NULL")
    check(leased == 0, f"{leased} leases stuck")
    per_key = Counter(c.idempotency_key for c in upstream.calls())
    check(set(per_key) == set(keys), "an item was never called")
    facts["duplicates"] = sum(v - 1 for v in per_key.values())
    check(facts["duplicates"] == 0, f"{facts['duplicates']} duplicate calls")
    await stage.stop_all([*workers, api], exited_ok=True)
    return facts


async def pool_exhaustion(stage: Stage) -> Facts:
    stage.start_upstream()
    stage.write_policies()
    api = await stage.start_api({"SWEEPER_DB_POOL_SIZE": "2",
                                 "SWEEPER_DB_POOL_TIMEOUT_SECONDS": "1",
                                 "SWEEPER_DB_STATEMENT_TIMEOUT_MS": "3000"})
    # a session that took a table lock and went idle in its transaction (a stuck migration,
    # an operator's forgotten psql): every registration now waits on it
    holder = await asyncpg.connect(stage.db_url)
    tx = holder.transaction()
    await tx.start()
    await holder.execute("LOCK TABLE items IN EXCLUSIVE MODE")
    tenant = stage.tenant()

    def entry(i: int) -> dict[str, Any]:
        return {"tenant_id": tenant, "object_id": f"o{i}", "policy": "drill",
                "due_at": "2026-01-01T00:00:00Z"}

    try:
        async with stage.api_client(api, timeout=30) as client:
            started = time.monotonic()
            writes = await asyncio.gather(*(client.post("/v1/items", json={"items": [entry(i)]})
                                            for i in range(12)))
            elapsed = time.monotonic() - started
            health = await client.get("/healthz")
            await tx.rollback()
            released = time.monotonic()

            async def writable() -> bool:
                answer = await client.post("/v1/items", json={"items": [entry(100)]})
                return answer.status_code == 200

            recovery = await stage.wait_for("registration after the lock", writable, 15)
            recovered_at = time.monotonic() - released
            ready = await client.get("/readyz")
    finally:
        await holder.close()
    codes = Counter(w.status_code for w in writes)
    facts: Facts = {"answers": dict(sorted(codes.items())), "answered_within_s": round(elapsed, 1),
                    "recovery_s": round(max(recovery, recovered_at), 2)}
    stage.facts.update(facts)
    check(set(codes) <= {200, 503}, f"answers under exhaustion {dict(codes)}")
    check(codes[503] >= 1, "the pool never shed load")
    check(all("retry-after" in w.headers for w in writes if w.status_code == 503),
          "a 503 without Retry-After")
    check(health.status_code == 200, "liveness failed while the pool was exhausted")
    check(ready.status_code == 200, f"/readyz {ready.status_code} after the lock went")
    written = {r["object_id"] for r in await stage.fetch("SELECT object_id FROM items")}
    accepted = {f"o{i}" for i, w in enumerate(writes) if w.status_code == 200} | {"o100"}
    check(written == accepted, f"written {sorted(written)} but accepted {sorted(accepted)}")
    await stage.stop_all([api], exited_ok=True)
    return facts


DRILLS = [
    Drill(5, "database-restart",
          "a private PostgreSQL this drill may restart; 200 items at 40/s, 2 worker "
          "processes and an API process; leases of 20 s",
          f"stop the server (fast shutdown) mid-run for {OUTAGE_S:.0f} s, then start it",
          "the API answers 503 with Retry-After (never 500) during the outage; workers and "
          f"API recover by themselves within {RECOVERY_LIMIT_S:.0f} s; nothing lost or "
          "called twice", database_restart),
    Drill(6, "terminate-backends",
          "200 items at 50/s, 2 worker processes and an API process",
          "pg_terminate_backend on every connection to the database, every 0.3 s for 4 s",
          "only 2xx and 503 answers, no stuck leases, every item succeeds once, the pools "
          "recover", terminate_backends),
    Drill(20, "pool-exhaustion",
          "an API process with a pool of 2, pool timeout 1 s, statement timeout 3 s",
          "a session takes LOCK TABLE items and sits idle in its transaction while 12 "
          "registrations arrive at once",
          "the API sheds with 503 + Retry-After (never 500), stays live, and registers again "
          "once the session ends; exactly the accepted writes are stored", pool_exhaustion),
]
