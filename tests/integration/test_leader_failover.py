"""Two `sweeper serve` processes on one database: one leads; frozen (SIGSTOP, as a partition
or a long pause would leave it), it is replaced within seconds, the survivor publishes a
run, and the old leader, thawed, finds its term over and stays a follower."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from drills.stage import Proc, Stage
from service.cluster.leader import LEASE_S, RENEW_EVERY_S
from service.protocols.egress import public_roots


def holder_pid(holder: str) -> int:
    """The pid in a holder's name (`host:pid:random`, service/worker/pool.worker_name)."""
    return int(holder.split(":")[1])


async def leader_gauge(proc: Proc) -> float:
    async with httpx.AsyncClient(verify=public_roots(), timeout=2) as client:
        text = (await client.get(f"{proc.base_url}/metrics")).text
    [line] = [x for x in text.splitlines() if x.startswith("sweeper_leader ")]
    return float(line.split()[1])


@pytest.mark.slow
async def test_a_frozen_leader_is_replaced_and_stays_out(db_url: str, tmp_path: Path) -> None:
    stage = Stage(db_url, tmp_path, label="leader")
    try:
        stage.start_upstream()
        stage.write_policies()
        first, second = await stage.start_api(), await stage.start_api()
        by_pid = {first.pid: first, second.pid: second}

        async def led() -> bool:
            return bool(await stage.fetch(
                "SELECT 1 FROM leader WHERE expires_at > now()"))

        await stage.wait_for("a leader elected", led, 10)
        [row] = await stage.fetch("SELECT holder, term FROM leader")
        leader, term = by_pid[holder_pid(row["holder"])], row["term"]
        survivor = second if leader is first else first
        assert await leader_gauge(leader) == 1 and await leader_gauge(survivor) == 0

        leader.signal(signal.SIGSTOP)

        async def taken_over() -> bool:
            rows = await stage.fetch("SELECT holder, term FROM leader WHERE expires_at > now()")
            return bool(rows) and holder_pid(rows[0]["holder"]) == survivor.pid

        took = await stage.wait_for("the survivor elected", taken_over, 15, 0.05)
        assert took < LEASE_S + 2 * RENEW_EVERY_S + 1, took
        [row] = await stage.fetch("SELECT term FROM leader")
        assert row["term"] == term + 1

        # the survivor now publishes
        await stage.register([f"o{i}" for i in range(20)])
        async with stage.api_client(survivor) as api:
            created = await api.post("/v1/runs", json={})
            assert created.status_code == 202, created.text
            run_id = created.json()["id"]

            async def published() -> bool:
                return (await api.get(f"/v1/runs/{run_id}")).json()["state"] == "published"

            await stage.wait_for("the run published", published, 10)
            workers = (await api.get("/v1/workers")).json()
        assert holder_pid(workers["leader"]["name"]) == survivor.pid
        assert workers["leader"]["term"] == term + 1

        # thawed, the old leader's renewal finds its term over: it steps down, for good
        leader.signal(signal.SIGCONT)

        async def stepped_down() -> bool:
            return await leader_gauge(leader) == 0

        await stage.wait_for("the old leader stepped down", stepped_down, 10)
        [row] = await stage.fetch("SELECT holder, term FROM leader")
        assert (holder_pid(row["holder"]), row["term"]) == (survivor.pid, term + 1)
    finally:
        await stage.aclose()
