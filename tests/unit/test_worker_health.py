"""`sweeper worker`'s probes (service/worker/health.py): /healthz fails once the pool's
loop stops turning, /readyz follows the pool's warm-up and stop, any other path is a 404.
Before, the worker's port answered 200 on every path, hung or not."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx

from service.ledger.claims import Admission
from service.protocols.egress import public_roots
from service.worker.health import WorkerHealth, serve_probes
from service.worker.pool import WARM_UP_SCOPE
from tests.unit.test_worker_rounds import rig


async def test_a_stalled_loop_fails_healthz_and_readyz() -> None:
    r = rig(concurrency=2)
    r.ledger.add("tenant:a", 1)
    stalled, release = asyncio.Event(), asyncio.Event()

    async def hung_admit(wants: Mapping[str, int]) -> Admission:
        if WARM_UP_SCOPE in wants:
            return Admission(grants=[], leases=[])
        stalled.set()
        await release.wait()  # a claim that never answers: the loop cannot turn
        return Admission(grants=[], leases=[])

    r.ledger.admit = hung_admit  # type: ignore[method-assign]
    health = WorkerHealth(r.clock.monotonic, stall_s=5.0)
    server = serve_probes(health, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    async with httpx.AsyncClient(verify=public_roots(), base_url=base, timeout=5) as client:
        assert (await client.get("/readyz")).status_code == 503  # no pool yet
        health.pool = r.pool
        running = asyncio.create_task(r.pool.run())
        try:
            async with asyncio.timeout(10):
                await stalled.wait()
            statuses = {p: (await client.get(p)).status_code
                        for p in ("/healthz", "/readyz", "/metrics", "/", "/v1/items")}
            assert statuses == {"/healthz": 200, "/readyz": 200, "/metrics": 200, "/": 404,
                                "/v1/items": 404}
            r.clock.t += 5.5  # the pool's clock moves on; its loop does not
            assert (await client.get("/healthz")).status_code == 503
            assert (await client.get("/readyz")).status_code == 503
            r.pool.stop()
            release.set()
            await running
            r.clock.t -= 5.5
            assert (await client.get("/readyz")).status_code == 503  # stopped
        finally:
            r.pool.stop()
            release.set()
            await running
            server.shutdown()
