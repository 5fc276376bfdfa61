"""The stage a drill runs on: the fake upstream, a policies file, `sweeper worker` and
`sweeper serve` OS processes on the drill's database, seeding, waiting and counting.

Everything a drill starts is recorded here and stopped by `aclose()`, whatever happened.
Worker and API output goes to files (a pipe nobody reads can fill and stall a process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import asyncpg
import httpx

from drills.base import Facts, check
from drills.ledger_reads import ATTEMPT_HISTORY_SQL, CALL_STARTS_SQL, STATUSES_SQL
from drills.netns import Namespace
from drills.upstream import Call, FakeUpstream
from service.config.policies import Policies, load_policies
from service.config.settings import Settings, async_url
from service.db.engine import make_engine
from service.ledger import registration
from service.runs import publication, trigger

PAST: Final = datetime(2026, 1, 1, tzinfo=UTC)
STOP_GRACE_S: Final = 10.0
PROCESS_START_TIMEOUT_S: Final = 60.0  # two shared cores, several processes importing at once

POLICY_TEMPLATE: Final = """
[upstreams.drill]
base_url = "{base_url}"
timeout_seconds = {timeout}

[policies.drill]
version = 1
upstream = "drill"
path = "/t/{{tenant_id}}/{{object_id}}"
scope = "tenant:{{tenant_id}}"
rate = {{ per_second = {rate}, burst = {burst} }}
lease_seconds = {lease}
max_attempts = {max_attempts}
absent_means_deleted = true
backoff = {{ base_seconds = {backoff_base}, max_seconds = {backoff_max} }}
retry_after_max_seconds = {retry_after_max}
"""


def tenant_of_path(_method: str, path: str, _headers: Mapping[str, str]) -> str:
    """The fake upstream's scope for a drill call: the tenant segment of /t/{tenant}/{id}."""
    parts = path.split("/")
    return parts[2] if len(parts) > 3 and parts[1] == "t" else "default"


def trailing_counts(times: list[float], width: float = 1.0) -> list[int]:
    """For each call in time order, the calls in the `width` seconds up to it (itself
    included)."""
    times = sorted(times)
    counts, start = [], 0
    for end, t in enumerate(times):
        while t - times[start] >= width:
            start += 1
        counts.append(end - start + 1)
    return counts


def worst_window(times: list[float], width: float = 1.0) -> int:
    """The most calls seen in any window of `width` seconds."""
    return max(trailing_counts(times, width), default=0)


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A `sweeper` OS process the drill started, its output in a file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    async def wait(self, within: float) -> int:
        """Wait for the process to exit; its return code (negative: killed by a signal)."""
        deadline = time.monotonic() + within
        while self.popen.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} (pid {self.pid}) did not exit in {within} s")
            await asyncio.sleep(0.05)
        return int(self.popen.returncode)

    async def peak_rss_kib(self) -> int:
        """The process's peak resident memory so far (VmHWM), KiB; 0 when unreadable."""
        status = await asyncio.to_thread(Path(f"/proc/{self.pid}/status").read_text)
        match = re.search(r"VmHWM:\s+(\d+) kB", status)
        return int(match.group(1)) if match else 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RemoteUpstream:
    """The fake upstream in its own OS process (`python -m drills.upstream`), read
    over its control API: its arrival times are then taken by a process that does nothing
    else, which budget precision needs on a crowded machine."""

    def __init__(self, proc: Proc, base_url: str) -> None:
        self.proc = proc
        self.base_url = base_url

    async def calls(self) -> list[Call]:
        async with httpx.AsyncClient(timeout=10) as client:
            rows = (await client.get(f"{self.base_url}/_control/calls")).json()
        return [Call(**row) for row in rows]

    async def stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=10) as client:
            stats: dict[str, Any] = (await client.get(f"{self.base_url}/_control/stats")).json()
        return stats


class Stage:
    """One drill's world. `label` prefixes its tenants (`drill-1a2b3c4d-a`)."""

    def __init__(self, db_url: str, workdir: Path, *, label: str) -> None:
        self.db_url = db_url
        self.workdir = workdir
        self.label = label
        self.upstream: FakeUpstream | None = None
        self.upstream_url: str | None = None
        self.policies_file: Path | None = None
        self.policies: Policies | None = None
        self.procs: list[Proc] = []
        self.cleanups: list[Callable[[], Awaitable[None]]] = []
        self.facts: Facts = {}
        # a bearer token for this drill's own API processes only
        self.api_token = f"drill-{secrets.token_hex(16)}"

    # -- the upstream and the policy -------------------------------------------------

    def start_upstream(self, **options: Any) -> FakeUpstream:
        """The fake deletion API on loopback, in its own thread (calls are timed there, not
        in the drill's event loop); scopes are the tenant segment of the path."""
        options.setdefault("scope_fn", tenant_of_path)
        upstream = FakeUpstream(**options)
        upstream.start_in_thread()
        self.upstream = upstream
        self.upstream_url = upstream.base_url
        return upstream

    async def start_upstream_process(self, *, rate: float, burst: int) -> RemoteUpstream:
        """The fake upstream as its own process, limiting every scope to `rate`/`burst`."""
        ready = self.workdir / "upstream.url"
        proc = self._spawn("upstream", [
            sys.executable, "-m", "drills.upstream", "--port", "0",
            "--default-limit", str(rate), "--default-burst", str(burst),
            "--ready-file", str(ready)], self._env({}))

        async def listening() -> bool:
            check(proc.alive(), f"the fake upstream exited: {proc.log()[-1000:]}")
            return ready.exists()

        await self.wait_for("fake upstream listening", listening, PROCESS_START_TIMEOUT_S, 0.05)
        self.upstream_url = ready.read_text(encoding="utf-8").strip()
        return RemoteUpstream(proc, self.upstream_url)

    def tenant(self, suffix: str = "a") -> str:
        return f"{self.label}-{suffix}"

    def scope(self, suffix: str = "a") -> str:
        return f"tenant:{self.tenant(suffix)}"

    def write_policies(self, *, rate: float = 1000, burst: int = 1000, lease: int = 30,
                       max_attempts: int = 5, backoff_base: float = 0.1,
                       backoff_max: float = 2.0, timeout: float = 3.0,
                       retry_after_max: float = 3600) -> Path:
        """The drill's own policy `drill` against the fake upstream (started first)."""
        assert self.upstream_url is not None, "start the upstream first"
        path = self.workdir / "policies.toml"
        path.write_text(POLICY_TEMPLATE.format(
            base_url=self.upstream_url, rate=rate, burst=burst, lease=lease,
            max_attempts=max_attempts, backoff_base=backoff_base, backoff_max=backoff_max,
            timeout=timeout, retry_after_max=retry_after_max), encoding="utf-8")
        self.policies_file = path
        self.policies = load_policies(path)
        return path

    # -- the ledger ------------------------------------------------------------------

    async def register(self, objects: list[str], tenant: str | None = None) -> list[str]:
        """Register items of the drill policy (due long ago); returns their operation keys."""
        assert self.policies is not None, "write the policies first"
        policy = self.policies.policies["drill"]
        tenant = tenant or self.tenant()
        engine = make_engine(async_url(self.db_url), self._settings())
        try:
            await registration.register(engine, [registration.Registration(tenant, o, policy, PAST)
                                           for o in objects])
        finally:
            await engine.dispose()
        return [registration.operation_key(tenant, o, "drill", policy.version) for o in objects]

    async def release(self) -> int:
        """Trigger a run and publish it here (no API needed); returns the run id."""
        engine = make_engine(async_url(self.db_url), self._settings())
        try:
            run_id, _ = await trigger.create_run(
                engine, trigger.RunRequest("drill", None, None, False, None), None)
            await publication.publish(engine, run_id, batch_size=500)
        finally:
            await engine.dispose()
        return run_id

    async def seed(self, n: int, tenant: str | None = None, prefix: str = "o") -> list[str]:
        """Register and release `n` items; returns their operation keys."""
        keys = await self.register([f"{prefix}{i}" for i in range(n)], tenant)
        await self.release()
        return keys

    def _settings(self) -> Settings:
        return Settings(database_url=self.db_url, workers=0)

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.db_url)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    async def fetchval(self, sql: str, *args: Any) -> Any:
        conn = await asyncpg.connect(self.db_url)
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    async def statuses(self) -> dict[str, int]:
        rows = await self.fetch(STATUSES_SQL)
        return {r["status"]: int(r["n"]) for r in rows}

    async def database_now(self) -> float:
        """The database's clock (epoch seconds): a moment on the scale of `call_starts`."""
        return float(await self.fetchval("SELECT extract(epoch FROM clock_timestamp())"))

    async def attempt_history(self, object_id: str) -> list[tuple[str, bool]]:
        """An item's attempts as (outcome, fenced), in the order they finished: its attempt
        rows and its success, which the item records instead of a row."""
        return [(r["outcome"], r["fenced"])
                for r in await self.fetch(ATTEMPT_HISTORY_SQL, object_id)]

    async def call_starts(self, outcome: str | None = None) -> list[float]:
        """When each call recorded in the ledger started (its attempt's started_at, or a
        succeeded item's last_started_at: a success has no attempt row; epoch seconds),
        oldest first; with `outcome`, those calls only. The worker records it before the
        call is sent, so a fake upstream starved of CPU, which receives calls late and in
        bunches, does not move them."""
        rows = await self.fetch(CALL_STARTS_SQL, outcome)
        return [float(r["t"]) for r in rows]

    async def wait_for(self, what: str, predicate: Callable[[], Awaitable[bool]],
                       within: float, interval: float = 0.1) -> float:
        """Poll until `predicate` holds; seconds it took. Fails the drill on timeout."""
        started = time.monotonic()
        while True:
            if await predicate():
                return time.monotonic() - started
            if time.monotonic() - started > within:
                check(False, f"{what}: not reached within {within:.0f} s "
                             f"(items {await self.statuses()})")
            await asyncio.sleep(interval)

    async def wait_all_finished(self, n: int, within: float) -> float:
        """Wait until `n` items are terminal (succeeded or dead)."""
        async def finished() -> bool:
            s = await self.statuses()
            return s.get("succeeded", 0) + s.get("dead", 0) >= n

        return await self.wait_for(f"{n} items finished", finished, within)

    # -- processes -------------------------------------------------------------------

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
        env.update({"SWEEPER_DATABASE_URL": self.db_url, "SWEEPER_LOG_FORMAT": "json",
                    "SWEEPER_LOG_LEVEL": "INFO", "SWEEPER_MIGRATE_ON_START": "false",
                    "SWEEPER_RETENTION_DAYS": "0", "SWEEPER_SHUTDOWN_GRACE_SECONDS": "5",
                    "PYTHONUNBUFFERED": "1"})
        if self.policies_file is not None:
            env["SWEEPER_POLICIES_FILE"] = str(self.policies_file)
        env.update(extra)
        return env

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str], port: int = 0
               ) -> Proc:
        log_path = self.workdir / f"{name}.log"
        with log_path.open("wb") as out:
            # argv is this interpreter and a fixed `sweeper` command line
            popen = subprocess.Popen(argv, env=dict(env), stdout=out,  # noqa: S603
                                     stderr=subprocess.STDOUT, cwd=self.workdir,
                                     start_new_session=True)
        proc = Proc(name, popen, log_path, port)
        self.procs.append(proc)
        return proc

    def start_worker(self, *, workers: int = 2, env: Mapping[str, str] | None = None,
                     agent: Mapping[str, str] | None = None, metrics: bool = False,
                     host: Namespace | None = None) -> Proc:
        """`sweeper worker` as its own OS process. With `agent`, the same command runs under
        drills.agent, which installs the named faults (crash points, clock shift); with
        `host`, in that network namespace."""
        extra = {"SWEEPER_WORKERS": str(workers), **(env or {})}
        port = free_port() if metrics else 0
        if metrics:
            extra["SWEEPER_METRICS_PORT"] = str(port)
        module = "service"
        if agent:
            module = "drills.agent"
            extra.update(agent)
        name = f"worker{sum(p.name.startswith('worker') for p in self.procs) + 1}"
        argv = [sys.executable, "-m", module, "worker"]
        return self._spawn(name, host.argv(argv) if host else argv, self._env(extra), port)

    async def wait_started(self, *procs: Proc) -> None:
        """Wait until each worker logged its start (imports done, pool about to run)."""
        for proc in procs:
            async def started(p: Proc = proc) -> bool:
                if not p.alive():
                    check(False, f"{p.name} exited with {p.popen.returncode}: "
                                 f"{p.log()[-2000:]}")
                return '"worker started"' in p.log()

            await self.wait_for(f"{proc.name} started", started, PROCESS_START_TIMEOUT_S, 0.05)

    async def wait_ready(self, *procs: Proc) -> None:
        """Wait until each worker (started with `metrics=True`) answers its /readyz: warmed
        up, its pool claiming."""
        async with httpx.AsyncClient(timeout=2) as client:
            for proc in procs:
                async def ready(p: Proc = proc) -> bool:
                    if not p.alive():
                        check(False, f"{p.name} exited with {p.popen.returncode}: "
                                     f"{p.log()[-2000:]}")
                    try:
                        return (await client.get(f"{p.base_url}/readyz")).status_code == 200
                    except httpx.TransportError:
                        return False

                await self.wait_for(f"{proc.name} ready", ready, PROCESS_START_TIMEOUT_S, 0.05)

    async def start_api(self, env: Mapping[str, str] | None = None) -> Proc:
        """`sweeper serve --api-only` on a free port; returns once /readyz answers 200."""
        port = free_port()
        extra = {"SWEEPER_API_TOKENS": self.api_token, "SWEEPER_WORKERS": "0", **(env or {})}
        proc = self._spawn("api", [sys.executable, "-m", "service", "serve", "--api-only",
                                   "--port", str(port)], self._env(extra), port)
        async with httpx.AsyncClient(timeout=2) as client:
            async def ready() -> bool:
                if not proc.alive():
                    check(False, f"api exited with {proc.popen.returncode}: {proc.log()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    return (await client.get(f"{proc.base_url}/readyz")).status_code == 200
                return False

            await self.wait_for("api ready", ready, PROCESS_START_TIMEOUT_S, 0.1)
        return proc

    def api_client(self, proc: Proc, timeout: float = 10) -> httpx.AsyncClient:
        # uvicorn closes a connection idle 5 s, maybe just as the client reuses it
        # ("Server disconnected without sending a response"): let them go before that
        return httpx.AsyncClient(base_url=proc.base_url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {self.api_token}"},
                                 limits=httpx.Limits(keepalive_expiry=1.0))

    async def stop(self, proc: Proc, within: float = STOP_GRACE_S + 10) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time."""
        if proc.alive():
            proc.signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            proc.signal(signal.SIGTERM)
        try:
            return await proc.wait(within)
        except TimeoutError:
            proc.signal(signal.SIGKILL)
            return await proc.wait(5)

    async def stop_all(self, procs: list[Proc], *, exited_ok: bool = False) -> None:
        """Stop each process, failing the drill unless it exits cleanly; `exited_ok`: one
        that has exited already (a drill's fault) is left alone."""
        for proc in procs:
            if exited_ok and not proc.alive():
                continue
            check(await self.stop(proc) == 0, f"{proc.name} did not stop cleanly")

    async def aclose(self) -> None:
        """Stop every process and the upstream."""
        for proc in self.procs:
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(TimeoutError):
                await proc.wait(10)
        if self.upstream is not None:
            self.upstream.stop_thread()
            self.upstream = None
        for cleanup in reversed(self.cleanups):
            await cleanup()
        self.cleanups.clear()

    def log_tail(self, lines: int = 8) -> str:
        """The last lines of every process log, for a failed drill's report."""
        out = []
        for proc in self.procs:
            tail = proc.log().splitlines()[-lines:]
            if tail:
                out.append(f"--- {proc.name} (pid {proc.pid}, exit {proc.popen.returncode})")
                out += [line[:300] for line in tail]
        return "\n".join(out)
