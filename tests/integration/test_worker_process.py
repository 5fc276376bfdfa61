"""`sweeper worker` as a real OS process drains and stops cleanly on SIGTERM, serving its
counters and probes meanwhile. Crashes, stalls and shared budgets of worker processes are drills
(tests/drills, drills), built on the same stage."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from drills.stage import Stage
from service.protocols.egress import public_roots


@pytest.mark.slow
async def test_worker_process_drains_and_stops_on_sigterm(db_url: str, tmp_path: Path) -> None:
    stage = Stage(db_url, tmp_path, label="acme")
    try:
        upstream = stage.start_upstream()
        stage.write_policies()
        await stage.seed(50)
        worker = stage.start_worker(metrics=True)
        await stage.wait_all_finished(50, 30)
        # the worker process serves its own counters for Prometheus
        async with httpx.AsyncClient(verify=public_roots()) as client:
            scraped = (await client.get(f"{worker.base_url}/metrics")).text
            probes = {path: (await client.get(f"{worker.base_url}{path}")).status_code
                      for path in ("/healthz", "/readyz", "/elsewhere")}
        assert 'sweeper_build_info{version="' in scraped
        # its probes (service/worker/health.py), and nothing else
        assert probes == {"/healthz": 200, "/readyz": 200, "/elsewhere": 404}
        assert await stage.stop(worker) == 0, worker.log()
        assert len(upstream.calls()) == 50
        assert await stage.statuses() == {"succeeded": 50}
    finally:
        await stage.aclose()
